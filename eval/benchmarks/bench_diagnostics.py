"""Step-time overhead of the normalization diagnostics (trainer/diagnostics.py).

    python eval/benchmarks/bench_diagnostics.py                 # cpu-default preset, batch 8 x seq 256, AdamW, fp32
    python eval/benchmarks/bench_diagnostics.py --blocks 6 --intervals 1,10,50,100

A training step here is what the training core does: forward, backward, clip_grad_norm_, AdamW step,
zero_grad; with diagnostics, arm() before the forward, after_backward() after the backward, after_step() after
the optimizer step, on steps where step % interval == 0. Batches are random tokens (step time does not depend on
the data). Modes are run interleaved, in blocks of `--block_steps` steps, so that drifting machine load hits
every mode alike.

Reported per mode: the median single-step time, and the median over blocks of each block's mean step time (the
honest number for "every k steps", whose slow armed step a per-step median would hide). The overhead at an
interval k is also derived from the armed-step cost: (median armed step - median plain step) / k. On a busy
machine those differences drown in noise, so the time spent inside the diagnostics' own code (arm, every hook's
statistic, after_backward, after_step) is also clocked directly: that is the cost they add.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `import model...` work from any directory
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trainer.cli import quiet_ctrl_c_while_loading  # noqa: E402

quiet_ctrl_c_while_loading(__name__)  # a Ctrl-C while the imports below load: one line, exit 130

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402

import torch  # noqa: E402

from model.config import PLACEMENT_ALIASES, PRESETS, MiniNormConfig, NormImpl, NormPlacement, NormType  # noqa: E402
from model.model import MiniNormForCausalLM  # noqa: E402
from trainer.cli import MAX_COUNT, ToolParser, benchmark_threads, int_list, int_within, run_main  # noqa: E402
from trainer.diagnostics import NormDiagnostics  # noqa: E402
from trainer.machine import machine_line  # noqa: E402
from trainer.memory import FP32_BYTES, allocation_failure_line, past_memory  # noqa: E402
from trainer.run_dir import report_error  # noqa: E402


CALL_TIMES: list[float] = []  # per armed step: seconds spent inside arm(), after_backward() and after_step()
HOOK_TIME = [0.0]  # seconds spent inside the hooks' statistics since the last armed step was recorded


def time_hooks(diag: NormDiagnostics) -> None:
    """Wrap the one method every hook calls, so the hooks' own work is timed without the machine's noise."""
    record = diag._record

    def timed(key: str, t: torch.Tensor) -> None:
        start = time.perf_counter()
        record(key, t)
        HOOK_TIME[0] += time.perf_counter() - start
    diag._record = timed


def train_step(model: MiniNormForCausalLM, optimizer: torch.optim.Optimizer, ids: torch.Tensor,
               diag: NormDiagnostics | None) -> float:
    """One optimizer step; returns its wall time in seconds."""
    start = time.perf_counter()
    in_calls = 0.0
    if diag is not None:
        t = time.perf_counter()
        diag.arm()
        in_calls += time.perf_counter() - t
    loss = model(ids, labels=ids).loss
    loss.backward()
    stats: dict[str, float] = {}
    if diag is not None:
        t = time.perf_counter()
        stats = diag.after_backward()
        in_calls += time.perf_counter() - t
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if diag is not None:
        t = time.perf_counter()
        stats.update(diag.after_step())
        CALL_TIMES.append(in_calls + time.perf_counter() - t + HOOK_TIME[0])
        HOOK_TIME[0] = 0.0
    return time.perf_counter() - start


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The benchmark's flags."""
    parser = ToolParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="cpu-default", choices=list(PRESETS), help="model preset (model/config.py)")
    # the model config's values (an unknown one was its ValueError's traceback, after the flags were taken)
    parser.add_argument("--norm_type", default="rmsnorm", choices=[str(v) for v in NormType],
                        help="the model's norm, as the trainer's --norm_type")
    parser.add_argument("--norm_placement", default="pre", choices=[*map(str, NormPlacement), *PLACEMENT_ALIASES],
                        help="as the trainer's --norm_placement")
    parser.add_argument("--norm_impl", default="auto", choices=[str(v) for v in NormImpl],
                        help="as in training (auto: compile on CPU)")
    parser.add_argument("--batch_size", type=int_within(1), default=8, help="sequences per step")
    parser.add_argument("--seq_len", type=int_within(1), default=256, help="tokens per sequence")
    parser.add_argument("--intervals", type=int_list(1), default="1,10",
                        help="diagnostic intervals to time besides 'off'")
    parser.add_argument("--derive", type=int_list(1), default="10,50,100", help="intervals to derive the overhead for")
    parser.add_argument("--block_steps", type=int_within(1, MAX_COUNT), default=10,
                        help="steps of one mode before the next mode's block")
    parser.add_argument("--blocks", type=int_within(1, MAX_COUNT), default=2,
                        help="blocks per mode (steps per mode = blocks x block_steps)")
    parser.add_argument("--warmup", type=int_within(0, MAX_COUNT), default=3,
                        help="untimed steps first (the first with diagnostics)")
    parser.add_argument("--threads", type=benchmark_threads(), default=None,
                        help="torch threads (default: torch's choice)")
    return parser.parse_args(argv)


@dataclass
class Timings:
    """Every timed step's seconds: per mode, its steps and its blocks' mean steps; and the armed and plain steps."""
    step_times: dict[str, list[float]]
    block_means: dict[str, list[float]]
    armed_times: list[float] = field(default_factory=list)
    plain_times: list[float] = field(default_factory=list)


def run_modes(model: MiniNormForCausalLM, optimizer: torch.optim.Optimizer, ids: torch.Tensor,
              diag: NormDiagnostics, modes: list[str], args: argparse.Namespace) -> Timings:
    """The warm-up steps, then --blocks rounds of one --block_steps block per mode, interleaved; prints each block's
    mean step."""
    for i in range(args.warmup):  # compile, allocator, and one armed step each
        train_step(model, optimizer, ids, diag if i == 0 else None)
    timings = Timings({m: [] for m in modes}, {m: [] for m in modes})
    for block in range(args.blocks):
        for mode in modes:
            interval = None if mode == "off" else int(mode.split()[1])
            times = []
            for step in range(args.block_steps):
                armed = interval is not None and step % interval == 0
                t = train_step(model, optimizer, ids, diag if armed else None)
                times.append(t)
                (timings.armed_times if armed else timings.plain_times).append(t)
            timings.step_times[mode] += times
            timings.block_means[mode].append(sum(times) / len(times))
            print(f"block {block} {mode:>9s}: mean step {timings.block_means[mode][-1] * 1e3:7.1f} ms", flush=True)
    return timings


def report(timings: Timings, modes: list[str], args: argparse.Namespace) -> dict:
    """Print the table of the modes' step times, the armed step's cost, the time inside the diagnostics and the
    derived overheads; returns the numbers (main's)."""
    step_times, block_means = timings.step_times, timings.block_means
    armed_times, plain_times = timings.armed_times, timings.plain_times
    base_median = statistics.median(step_times["off"])
    base_block = statistics.median(block_means["off"])
    print(f"\n{args.preset}, {args.norm_placement}/{args.norm_type} (norm_impl={args.norm_impl}), batch "
          f"{args.batch_size} x seq {args.seq_len}, AdamW, fp32, {args.blocks} blocks x {args.block_steps} steps per "
          f"mode; {machine_line()}\n")
    print("| diagnostics | median step (ms) | overhead | median block-mean step (ms) | overhead |")
    print("|---|---|---|---|---|")
    rows = {}
    for mode in modes:
        med, blk = statistics.median(step_times[mode]), statistics.median(block_means[mode])
        rows[mode] = (med, blk)
        print(f"| {mode} | {med * 1e3:.1f} | {100 * (med / base_median - 1):+.1f}% | {blk * 1e3:.1f} | "
              f"{100 * (blk / base_block - 1):+.1f}% |")
    armed_cost = statistics.median(armed_times) - statistics.median(plain_times)
    print(f"\narmed step: median {statistics.median(armed_times) * 1e3:.1f} ms vs plain step "
          f"{statistics.median(plain_times) * 1e3:.1f} ms: +{armed_cost * 1e3:.1f} ms "
          f"({100 * armed_cost / statistics.median(plain_times):+.1f}% of one step)")
    calls = statistics.median(CALL_TIMES)
    print(f"time inside the diagnostics (arm, hooks, after_backward, after_step): median {calls * 1e3:.1f} ms "
          f"per armed step = {100 * calls / statistics.median(plain_times):.2f}% of a plain step; at "
          + ", ".join(f"diag_interval={k}: {100 * calls / k / statistics.median(plain_times):.3f}%"
                      for k in args.derive))
    derived = {}
    for k in args.derive:
        derived[k] = armed_cost / k / statistics.median(plain_times)
        print(f"derived overhead at diag_interval={k}: {100 * derived[k]:+.2f}%")
    return {"rows": rows, "armed_cost_s": armed_cost, "derived": derived}


def main(argv: Sequence[str] | None = None) -> dict:
    """Time the modes (diagnostics off, and every k steps for each --intervals k) on one model and batch, and print
    the table; returns its numbers: per mode the median step and median block-mean step (seconds), the armed step's
    extra seconds, and the derived overhead (a fraction of a step) at each --derive interval."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = MiniNormConfig.from_preset(args.preset, norm_type=args.norm_type, norm_placement=args.norm_placement,
                                        norm_impl=args.norm_impl)
    logits = args.batch_size * args.seq_len * config.vocab_size * FP32_BYTES  # a step's one largest tensor
    refusal = past_memory(logits, f"--batch_size {args.batch_size} x --seq_len {args.seq_len}: a step's logits "
                                  f"({config.vocab_size} vocabulary, fp32)", torch.device("cpu"),
                          "lower --batch_size or --seq_len")
    if refusal is not None:  # as the trainer refuses its logits
        raise SystemExit(report_error(refusal))
    model = MiniNormForCausalLM(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    diag = NormDiagnostics(model)
    time_hooks(diag)
    ids = torch.randint(0, config.vocab_size, (args.batch_size, args.seq_len))
    modes = ["off"] + [f"every {k}" for k in args.intervals]
    try:
        timings = run_modes(model, optimizer, ids, diag, modes, args)
    except (MemoryError, RuntimeError) as error:  # sizes whose logits fit alone, not with the activations: one line
        line = allocation_failure_line(error, "lower --batch_size or --seq_len")
        if line is None:
            raise
        raise SystemExit(report_error(line)) from None
    return report(timings, modes, args)

def command_line() -> int:
    """The command: main()'s numbers are for in-process callers; here its printed table is the answer."""
    main()
    return 0


if __name__ == "__main__":
    run_main(command_line)
