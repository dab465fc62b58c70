"""The norms' speed inside a training step: RMSNorm vs LayerNorm (and pRMSNorm), with the fast norm paths.

For each norm type, the study's model (docs/study.md: 8 layers, hidden 128, pre-LN by default) takes full
training steps (forward, backward, clipping, AdamW; `--dtype auto` as the trainer picks it) on token batches of
the study's shape, with `norm_impl auto` (on CPU the compiled RMSNorm; LayerNorm is torch's native kernel). Two
measurements, both interleaved round by round across the norm types, so that a change of the machine's load hits
every variant alike:

  - step time: unprofiled steps, the median over rounds;
  - the norms' share of the step, profiled: torch.profiler records a few steps with every norm module's forward
    and backward marked by a `record_function` range (module hooks), so the time inside the norms, both ways,
    is read from the same trace as the whole step's.

    python eval/studies/norm_share.py                         # rmsnorm, layernorm, prmsnorm; 1 thread
    python eval/studies/norm_share.py --placement post --rounds 9 --threads 2
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script, from any directory
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trainer.cli import quiet_ctrl_c_while_loading  # noqa: E402

quiet_ctrl_c_while_loading(__name__)  # a Ctrl-C while the imports below load: one line, exit 130

import argparse  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

from model.config import MAX_SIZE, MiniNormConfig  # noqa: E402
from model.model import MiniNormForCausalLM  # noqa: E402
from model.norms import DyT, LayerNorm, RMSNorm, resolve_norm_impl  # noqa: E402
from model.rmsnorm_math import P_RANGE  # noqa: E402
from trainer.cli import (MAX_COUNT, RawDescriptionDefaultsHelpFormatter, ToolParser, benchmark_threads, float_within,  # noqa: E402
                         int_within, run_main)
from trainer.machine import machine_line, resolve_dtype  # noqa: E402

# The study's model (scripts/sweep_configs/study_norms.yaml) and batch.
STUDY_SHAPE = dict(hidden_size=128, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=352, max_position_embeddings=512)
FORWARD_RANGE, BACKWARD_RANGE = "norm.forward", "norm.backward"


@dataclass
class Variant:
    name: str
    model: MiniNormForCausalLM
    optimizer: torch.optim.Optimizer
    dtype: torch.dtype
    step_times: list[float]
    shares: list[tuple[float, float, float]]  # per profiled round: (norm forward, norm backward, step) seconds


def mark_norms(model: torch.nn.Module) -> int:
    """Wrap every norm module's forward and backward in profiler ranges; returns how many norms were marked."""
    marked = 0
    for module in model.modules():
        if not isinstance(module, (RMSNorm, LayerNorm, DyT)):
            continue
        marked += 1
        ranges: dict[str, record_function] = {}

        def enter(name: str, key: str):
            def hook(*_):
                ranges[key] = record_function(name)
                ranges[key].__enter__()
            return hook

        def leave(key: str):
            def hook(*_):
                ranges.pop(key).__exit__(None, None, None)
            return hook

        module.register_forward_pre_hook(enter(FORWARD_RANGE, "forward"))
        module.register_forward_hook(leave("forward"))
        module.register_full_backward_pre_hook(enter(BACKWARD_RANGE, "backward"))
        module.register_full_backward_hook(leave("backward"))
    return marked


def batches(vocab_size: int, batch_size: int, seq_len: int, seed: int) -> Iterator[torch.Tensor]:
    """Random token batches: a step's speed does not depend on which tokens it sees (no data-dependent work)."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        yield torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator)


def train_step(variant: Variant, input_ids: torch.Tensor) -> float:
    started = time.perf_counter()
    with torch.autocast("cpu", dtype=variant.dtype, enabled=variant.dtype != torch.float32):
        loss = variant.model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(variant.model.parameters(), 1.0)
    variant.optimizer.step()
    variant.optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - started


def profiled_steps(variant: Variant, inputs: Iterator[torch.Tensor], steps: int) -> tuple[float, float, float]:
    """(norm forward, norm backward, whole steps) seconds over `steps` profiled steps."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("train.step"):
            for _ in range(steps):
                train_step(variant, next(inputs))
    totals = {event.key: event.cpu_time_total for event in prof.key_averages()}
    return (totals.get(FORWARD_RANGE, 0.0) / 1e6, totals.get(BACKWARD_RANGE, 0.0) / 1e6,
            totals["train.step"] / 1e6)


def build(norm_type: str, placement: str, args: argparse.Namespace) -> Variant:
    torch.manual_seed(0)
    config = MiniNormConfig(**STUDY_SHAPE, norm_type=norm_type, norm_placement=placement, prms_p=args.prms_p,
                            norm_impl="auto")
    model = MiniNormForCausalLM(config).train()
    if mark_norms(model) == 0:
        raise ValueError(f"norm_type {norm_type}: no norm modules to profile")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return Variant(norm_type, model, optimizer, getattr(torch, args.dtype), [], [])


def table(variants: list[Variant], args: argparse.Namespace) -> str:
    reference = statistics.median(variants[0].step_times)
    lines = ["| norm | step (ms) | vs " + variants[0].name + " | norm forward (ms/step) | norm backward (ms/step) | "
             "norms' share of the step |", "|---|---|---|---|---|---|"]
    for variant in variants:
        step = statistics.median(variant.step_times)
        forward = statistics.median(f / args.profile_steps for f, _, _ in variant.shares)
        backward = statistics.median(b / args.profile_steps for _, b, _ in variant.shares)
        share = statistics.median((f + b) / s for f, b, s in variant.shares)
        lines.append(f"| {variant.name} | {step * 1e3:.1f} | {step / reference:.3f} | {forward * 1e3:.2f} | "
                     f"{backward * 1e3:.2f} | {share:.1%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = ToolParser(description=__doc__, formatter_class=RawDescriptionDefaultsHelpFormatter)
    parser.add_argument("--norms", default="rmsnorm,layernorm,prmsnorm", help="comma-separated norm types to profile")
    parser.add_argument("--placement", default="pre", help="norm_placement of every variant")
    parser.add_argument("--prms_p", type=float_within(*P_RANGE, above_low=True), default=0.0625,
                        help="partial RMSNorm's ratio p (prmsnorm only)")
    parser.add_argument("--batch_size", type=int_within(1, MAX_SIZE), default=8, help="sequences per step")
    parser.add_argument("--seq_len", type=int_within(2, MAX_SIZE), default=128, help="tokens per sequence")
    parser.add_argument("--rounds", type=int_within(1, MAX_COUNT), default=7,
                        help="interleaved rounds (each: steps, then a profile)")
    parser.add_argument("--steps", type=int_within(1, MAX_COUNT), default=5, help="timed steps per variant per round")
    parser.add_argument("--profile_steps", type=int_within(1, MAX_COUNT), default=3,
                        help="profiled steps per variant per round")
    parser.add_argument("--warmup", type=int_within(0, MAX_COUNT), default=3,
                        help="untimed steps per variant first (compiles)")
    parser.add_argument("--threads", type=benchmark_threads(), default=1, help="torch threads")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                        help="autocast precision; auto: as the trainer picks it on this CPU (bf16 where it is fast)")
    args = parser.parse_args(argv)
    args.dtype = resolve_dtype(args.dtype)
    torch.set_num_threads(args.threads)
    names = [n.strip() for n in args.norms.split(",") if n.strip()]
    try:
        variants = [build(name, args.placement, args) for name in names]
    except ValueError as error:
        parser.error(str(error))
    inputs = batches(variants[0].model.config.vocab_size, args.batch_size, args.seq_len, seed=0)
    impl = resolve_norm_impl("auto", torch.device("cpu")).value
    header = (f"{machine_line()}; load average {os.getloadavg()[0]:.2f} at start; "
              f"placement {args.placement}, norm_impl auto ({impl} for RMSNorm on CPU), {args.dtype}, batch "
              f"{args.batch_size} x {args.seq_len}, {args.rounds} interleaved rounds of {args.steps} timed + "
              f"{args.profile_steps} profiled steps per variant")
    print(header, flush=True)
    for variant in variants:
        for _ in range(args.warmup):
            train_step(variant, next(inputs))
    for round_index in range(args.rounds):
        order = variants if round_index % 2 == 0 else variants[::-1]  # no variant always first after another
        for variant in order:
            variant.step_times.extend(train_step(variant, next(inputs)) for _ in range(args.steps))
            variant.shares.append(profiled_steps(variant, inputs, args.profile_steps))
    report = f"{header}\n\n{table(variants, args)}\n"
    print("\n" + report)
    return 0


if __name__ == "__main__":
    run_main(main)
