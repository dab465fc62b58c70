"""The default training step on a busy machine: idle, then beside 1 and 2 busy competitor processes (that this
benchmark starts and stops itself), for

  - MiniNorm as it ships: `--threads auto` and OpenMP's spin bounded (trainer/threads.py),
  - MiniNorm on one thread (`--threads 1`, spin bounded): what `auto` chooses when it finds a core taken at start,
  - MiniNorm with that policy off: one thread per core and OpenMP's default spin,
  - `before`: MiniNorm as it was before issue 26, the policy off and the optimizer stepping as torch's own classes
    do (unfused AdamW, Muon's per-matrix Newton-Schulz loop): the same arithmetic in more parallel regions, and
  - transformers' LlamaForCausalLM of the same shape in a plain loop (fp32, torch.optim.AdamW, torch's defaults),

each in a worker process of its own (OpenMP reads its wait policy when a process loads torch), all measured in
one run: round after round, each load level in turn and each variant at that level, a few steps each; the table
gives the median step of every variant at every level and its ratio to the same variant idle.

    python eval/benchmarks/bench_load.py                     # 4 rounds of 4 steps per variant and level
    python eval/benchmarks/bench_load.py --rounds 6 --steps 5 --competitors 0,1
    python eval/benchmarks/bench_load.py --variants mininorm,mininorm:30000,policy_off   # other spin counts
    python eval/benchmarks/bench_load.py --competitors 0,1 --rounds 8 --variants mininorm,before   # the goal's pair
    python eval/benchmarks/bench_load.py --start_bursts 5 --rounds 0   # `auto`'s count beside a burst at start only
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script, from any directory
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trainer.cli import quiet_ctrl_c_while_loading  # noqa: E402

quiet_ctrl_c_while_loading(__name__)  # a Ctrl-C while the imports below load: one line, exit 130

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

from trainer.cli import (MAX_COUNT, RawDescriptionDefaultsHelpFormatter, ToolParser, int_list, int_within,  # noqa: E402
                         output_folder, run_main)
from trainer.threads import bound_openmp_waits, usable_cores  # noqa: E402

VARIANTS = {
    "mininorm": "MiniNorm (threads auto, bounded spin)",
    "one_thread": "MiniNorm on one thread (bounded spin)",
    "policy_off": "MiniNorm, policy off (all cores, default spin)",
    "before": "MiniNorm before issue 26 (policy off, torch's per-matrix Muon step, unfused AdamW)",
    "llama": "HF Llama, plain fp32 AdamW loop",
}
BUSY_LOOP = "while True:\n    pass\n"
BURST_S = 0.4  # a competitor busy this long as `auto` starts looking: a compiler, a test's worker starting
BURST_LOOP = f"import time\nend = time.time() + {BURST_S}\nwhile time.time() < end:\n    pass\n"


def label(variant: str) -> str:
    """`mininorm:N` is MiniNorm's policy with OpenMP spinning N iterations (GOMP_SPINCOUNT) instead of ours."""
    name, _, spin = variant.partition(":")
    return f"MiniNorm (threads auto, spin {spin})" if spin else VARIANTS[name]


def use_torch_optimizer_steps() -> None:
    """The optimizer as it stepped before issue 26's changes to trainer/optim.py: AdamW unfused (about ten
    elementwise operations per parameter) and torch.optim.Muon's own step (Newton-Schulz one matrix at a time)."""
    import torch

    import trainer.optim as optim

    optim.adamw = lambda params, lr: torch.optim.AdamW(params, lr=lr, betas=optim.ADAMW_BETAS, eps=optim.ADAMW_EPS)
    optim.muon_step = lambda muon, dtype: muon.step()


def worker(variant: str, out_dir: str) -> None:
    """Build the variant's model and train it on request: each stdin line `N` runs N steps and answers with their
    times (a JSON list) on stdout."""
    import torch  # only in the worker: its process has the variant's OpenMP settings

    from model.llama_compat import to_llama_config
    from trainer.args import parse_args
    from trainer.core import Trainer

    threads = "auto" if variant.startswith("mininorm") else "1" if variant == "one_thread" else str(usable_cores())
    if variant == "before":
        use_torch_optimizer_steps()
    trainer = Trainer(parse_args("pretrain", ["--out_dir", out_dir, "--overwrite", "--threads", threads]))
    batches = iter(trainer.train_loader)
    if variant == "llama":
        from transformers import LlamaForCausalLM
        model = LlamaForCausalLM(to_llama_config(trainer.unwrapped.config))
        optimizer = torch.optim.AdamW(model.parameters(), lr=trainer.args.learning_rate, weight_decay=0.1)

        def train_step(batch: dict) -> None:
            loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    else:
        def train_step(batch: dict) -> None:
            trainer.train_step([batch])

    print(json.dumps({"ready": trainer.threads.describe(), "threads": torch.get_num_threads()}), flush=True)
    for line in sys.stdin:
        times = []
        for _ in range(int(line)):
            batch = next(batches)
            started = time.perf_counter()
            train_step(batch)
            times.append(time.perf_counter() - started)
        print(json.dumps(times), flush=True)


class Worker:
    def __init__(self, variant: str, out_dir: str) -> None:
        env = {key: value for key, value in os.environ.items()
               if key not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
        if variant.startswith("mininorm") or variant == "one_thread":
            bound_openmp_waits(env)
            env["GOMP_SPINCOUNT"] = variant.partition(":")[2] or env["GOMP_SPINCOUNT"]
        self.process = subprocess.Popen([sys.executable, __file__, "--worker", variant, "--out_dir", out_dir],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.ready = self._answer()

    def _answer(self):
        line = self.process.stdout.readline()
        if not line:
            raise SystemExit(f"a worker stopped (exit code {self.process.wait()})")
        return json.loads(line)

    def steps(self, count: int) -> list[float]:
        self.process.stdin.write(f"{count}\n")
        self.process.stdin.flush()
        return self._answer()

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


def start_decisions(trials: int) -> None:
    """`--threads auto`'s count when a burst of BURST_S runs beside its start, as shipped and with one window
    (the policy before 2026-12-02), alternating, `trials` times each; and beside a steady competitor."""
    from trainer.threads import START_WINDOWS, ThreadPolicy

    counts: dict[str, list[int]] = {}
    for scene, loop in (("a burst at start", BURST_LOOP), ("a steady competitor", BUSY_LOOP)):
        for _ in range(trials):
            for windows in (1, START_WINDOWS):
                competitor = subprocess.Popen([sys.executable, "-c", loop])
                try:
                    time.sleep(0.05)  # let it start
                    policy = ThreadPolicy("auto", environ={}, windows=windows)
                    policy.start()
                finally:
                    competitor.kill()
                    competitor.wait()
                counts.setdefault(f"{scene}, {windows} window{'s' if windows > 1 else ''}", []).append(policy.threads)
                time.sleep(0.5)
    print(f"\n`--threads auto` on {usable_cores()} usable cores, {trials} starts each (alternating): thread counts\n")
    for scene, chosen in counts.items():
        print(f"- {scene}: {' '.join(map(str, chosen))}")


def step_table(variants: list[str], levels: list[int], rounds: int, steps: int, warmup: int) -> None:
    """Every variant's training step at every load level, interleaved round after round; the medians' table."""
    times: dict[tuple[str, int], list[float]] = {(v, n): [] for v in variants for n in levels}
    with tempfile.TemporaryDirectory() as scratch:
        workers = {}
        for variant in variants:  # one at a time, on an idle machine: `auto` decides its threads at start
            workers[variant] = Worker(variant, f"{scratch}/{variant}")
            workers[variant].steps(warmup)
            print(f"{label(variant)}: {workers[variant].ready['ready']}", flush=True)
        try:
            for _ in range(rounds):
                for level in levels:
                    competitors = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(level)]
                    try:
                        time.sleep(0.5)
                        for variant in variants:
                            times[variant, level] += workers[variant].steps(steps)
                    finally:
                        for competitor in competitors:
                            competitor.kill()
                            competitor.wait()
        finally:
            for process in workers.values():
                process.close()
    print(f"\nDefault pretraining step (cpu-wide preset, batch 8 x 256, `--dtype auto`; the Llama loop fp32), "
          f"median of {rounds} rounds x {steps} steps per cell, ms; x: the same variant's idle median\n")
    header = " | ".join(f"{n} busy process{'es' if n != 1 else ''}" if n else "idle" for n in levels)
    print(f"| variant | {header} |")
    print("|---" * (len(levels) + 1) + "|")
    for variant in variants:
        idle = statistics.median(times[variant, levels[0]])
        cells = []
        for level in levels:
            median = statistics.median(times[variant, level])
            cells.append(f"{median * 1e3:.0f}" + (f" ({median / idle:.2f}x)" if level else ""))
        print(f"| {label(variant)} | {' | '.join(cells)} |")


def main(argv: list[str] | None = None) -> None:
    parser = ToolParser(description=__doc__, formatter_class=RawDescriptionDefaultsHelpFormatter)
    parser.add_argument("--rounds", type=int_within(0, MAX_COUNT), default=4,
                        help="rounds over every load level and variant (0: no step table)")
    parser.add_argument("--steps", type=int_within(1, MAX_COUNT), default=4,
                        help="timed steps per variant, level and round")
    parser.add_argument("--warmup", type=int_within(0, MAX_COUNT), default=4,
                        help="steps per variant before the first round")
    parser.add_argument("--competitors", type=int_list(0), default="0,1,2",
                        help="comma-separated numbers of busy processes")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated: {', '.join(VARIANTS)}")
    parser.add_argument("--start_bursts", type=int_within(0, MAX_COUNT), default=0,
                        help="also start `--threads auto` this many times beside a short burst and a steady load")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out_dir", type=output_folder, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.out_dir)
        return
    from dataset.shown_value import shown_value
    from trainer.machine import machine_line

    levels = args.competitors
    variants = args.variants.split(",")
    for variant in variants:
        name, _, spin = variant.partition(":")
        if name not in VARIANTS or (spin and (name != "mininorm" or not spin.isdigit())):
            parser.error(f"--variants: {shown_value(variant)} is not allowed; choose from {', '.join(VARIANTS)} or "
                         f"mininorm:N")
    print(f"{machine_line()}; load average {os.getloadavg()[0]:.2f} at start", flush=True)
    if args.rounds > 0:
        step_table(variants, levels, args.rounds, args.steps, args.warmup)
    if args.start_bursts > 0:
        start_decisions(args.start_bursts)
    print(f"\nload average {os.getloadavg()[0]:.2f} at end")


if __name__ == "__main__":
    run_main(main)
