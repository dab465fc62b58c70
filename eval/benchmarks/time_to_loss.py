"""Time-to-loss benchmark: how good a model each training recipe gives for the same wall-clock time.

Each recipe (a named set of trainer flags; `baseline` is today's defaults) trains the pretraining task on the
default corpus for a fixed budget of training time, and the table reports, per recipe:

  - val loss and bits/byte at the budget (the whole validation split, at the end of the run),
  - the training seconds it took to first reach --target_loss (the first validation at or below it), and
  - the steps, tokens, dtype and compile setting the run ended up with.

The budget is the trainer's own `--time_budget_s` (trainer/budget.py): each run fixes its length from the pace of
its first timed steps so that its learning-rate schedule ends where the budget does. Training time is the sum of
the optimizer steps' times, the first step included (it compiles: the norm kernels, and with --compile on the
whole model; a later seed of the same recipe finds torch's compile cache warm); validation, checkpoints and
start-up are not in it.

The recipes run one after the other in one invocation, so they share the machine's state (load, caches, clock);
with several --seeds they are interleaved per seed, and the table shows medians with the range over seeds.

    python eval/benchmarks/time_to_loss.py                     # previous_default vs baseline, 100 s each
    python eval/benchmarks/time_to_loss.py --budget_s 300 --target_loss 5.0 --seeds 0,1,2 --recipes baseline,wsd
    python eval/benchmarks/time_to_loss.py --recipes baseline,big_batch \\
        --recipe "big_batch=--batch_size 32 --learning_rate 3e-3"
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script, from any directory
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trainer.cli import quiet_ctrl_c_while_loading  # noqa: E402

quiet_ctrl_c_while_loading(__name__)  # a Ctrl-C while the imports below load: one line, exit 130

import argparse  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import shlex  # noqa: E402
import statistics  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402

import torch  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402

from dataset.atomic_io import atomic_write_text, check_folder_path, make_dirs  # noqa: E402
from dataset.json_text import strict_json  # noqa: E402
from dataset.shown_value import shown_text, shown_value  # noqa: E402
from trainer.arg_checks import A_YEAR_S  # noqa: E402
from trainer.cli import (SEED_RANGE, RawDescriptionDefaultsHelpFormatter, ToolParser, benchmark_threads,  # noqa: E402
                         float_within, int_list, int_within, output_folder, run_main)
from trainer.args import parse_args  # noqa: E402
from trainer.core import Trainer  # noqa: E402
from trainer.memory import out_of_memory_line  # noqa: E402
from trainer.run_dir import read_metrics, report_error  # noqa: E402
from trainer.run_summary import RunSummary, TrainingDiverged  # noqa: E402
from trainer.machine import machine_line  # noqa: E402

# Named recipes: trainer flags on top of the defaults. `baseline` is the default pretraining run's recipe;
# `previous_default` the AdamW recipe it replaced (docs/recipe.md).
RECIPES: dict[str, tuple[str, ...]] = {
    "baseline": (),
    "previous_default": ("--preset", "cpu-default", "--optimizer", "adamw", "--learning_rate", "2e-3",
                         "--batch_size", "16", "--warmup_steps", "30"),
    "wsd": ("--lr_schedule", "wsd"),
    "compiled": ("--compile", "on"),
}
# Flags the benchmark sets itself: a recipe that sets them would fight the budget or the measurement.
OWN_FLAGS = ("--max_steps", "--time_budget_s", "--epochs", "--out_dir", "--seed", "--eval_interval",
             "--save_interval", "--resume", "--overwrite")
RESULTS_NAME = "results"  # OUT_DIR/results.{json,md}


@dataclass
class RunResult:
    recipe: str
    seed: int
    steps: int
    tokens: int
    train_time_s: float          # the sum of the optimizer steps' times
    wall_time_s: float           # the whole run, validation and start-up included
    val_loss: float              # at the budget, over the whole validation split
    bits_per_byte: float
    time_to_target_s: float | None  # training seconds to the first validation at or below the target
    dtype: str
    compiled: bool
    status: str                  # finished | diverged


def time_to_target(train: list[dict], val: list[dict], target: float) -> float | None:
    """Training seconds (the steps' times, summed) up to the first validation record whose loss is at or below
    `target`; None if none is. Records are the trainer's metrics.jsonl rows (train: step, step_time_s; val: step,
    val_loss)."""
    reached = next((record["step"] for record in val if record["val_loss"] <= target), None)
    if reached is None:
        return None
    return sum(record["step_time_s"] for record in train if record["step"] <= reached)


def recipe_flags(name: str, custom: dict[str, tuple[str, ...]]) -> tuple[str, ...]:
    recipes = {**RECIPES, **custom}
    if name not in recipes:
        raise ValueError(f"--recipes: unknown recipe {shown_value(name)}; known: {', '.join(recipes)} (define more "
                         f"with --recipe NAME=FLAGS)")
    flags = recipes[name]
    for flag in flags:
        if flag.split("=")[0] in OWN_FLAGS:
            raise ValueError(f"recipe {shown_value(name)}: {shown_text(flag)} is set by the benchmark (the budget and "
                             f"the measurement)")
    return flags


def parse_custom_recipes(items: list[str]) -> dict[str, tuple[str, ...]]:
    custom = {}
    for item in items:
        name, sep, flags = item.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"--recipe {shown_value(item)}: expected NAME=FLAGS, e.g. big=\"--batch_size 32\"")
        custom[name.strip()] = tuple(shlex.split(flags))
    return custom


def train(argv: list[str], recipe: str) -> tuple[RunSummary, Trainer]:
    """One training run in this process (each run builds its own Accelerator). The trainer's refusal of its flags or
    data, and an allocation that fails, end the benchmark in the trainer's own one line (trainer/command.py's),
    naming `recipe` (the recipe and seed): they were tracebacks."""
    AcceleratorState._reset_state(reset_partial_state=True)
    train_args = parse_args("pretrain", argv)
    try:
        trainer = Trainer(train_args)
        return trainer.run(), trainer
    except (ValueError, FileNotFoundError) as error:
        raise SystemExit(report_error(f"{recipe}: {error}")) from None
    except (MemoryError, RuntimeError) as error:
        memory = out_of_memory_line(error, train_args)
        if memory is None:
            raise
        raise SystemExit(report_error(f"{recipe}: {memory}")) from None
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def run_recipe(name: str, flags: list[str], seed: int, args: argparse.Namespace) -> RunResult:
    out_dir = args.out_dir / f"{name}_seed{seed}"
    try:
        summary, trainer = train([*flags, "--seed", str(seed), "--time_budget_s", str(args.budget_s),
                                  "--out_dir", str(out_dir), "--eval_interval", str(args.eval_interval),
                                  "--eval_batches", str(args.eval_batches), "--save_interval", "1000000000",
                                  "--overwrite"], f"recipe {name}, seed {seed}")  # a rerun replaces its earlier runs
    except TrainingDiverged as error:
        train_records = read_metrics(out_dir, "train")
        return RunResult(recipe=name, seed=seed, steps=error.step, tokens=0, status="diverged",
                         train_time_s=sum(r["step_time_s"] for r in train_records), wall_time_s=math.nan,
                         val_loss=math.nan, bits_per_byte=math.nan, time_to_target_s=None, dtype="", compiled=False)
    train_records, val_records = read_metrics(out_dir, "train"), read_metrics(out_dir, "val")
    return RunResult(status="finished", recipe=name, seed=seed, steps=summary.steps, tokens=summary.tokens_seen,
                     train_time_s=sum(r["step_time_s"] for r in train_records), wall_time_s=summary.wall_time_s,
                     val_loss=summary.final_val["loss"], bits_per_byte=summary.final_val["bits_per_byte"],
                     time_to_target_s=time_to_target(train_records, val_records, args.target_loss),
                     dtype=trainer.args.dtype, compiled=trainer.compiled)


# --------------------------------------------------------------------------- the report
def _spread(values: list[float], fmt: str) -> str:
    """The median, with the range when there are several values."""
    middle, low, high = (format(v, fmt) for v in (statistics.median(values), min(values), max(values)))
    return middle if low == high else f"{middle} ({low}-{high})"


def _flags_cell(flags: tuple[str, ...]) -> str:
    return f"`{shlex.join(flags)}`" if flags else "the defaults"


def results_table(results: list[RunResult], recipes: dict[str, tuple[str, ...]], budget_s: float,
                  target: float) -> str:
    lines = [f"| recipe | flags | dtype, compile | steps | tokens | train time (s) | val loss at {budget_s:g} s | "
             f"bits/byte | time to val loss {target:g} (s) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, flags in recipes.items():
        all_runs = [r for r in results if r.recipe == name]
        runs = [r for r in all_runs if r.status == "finished"]
        diverged = f"{len(all_runs) - len(runs)} of {len(all_runs)} seeds diverged" if len(runs) < len(all_runs) else ""
        if not runs:
            lines.append(f"| {name} | {_flags_cell(flags)} | {diverged} | | | | | | |")
            continue
        reached = [r.time_to_target_s for r in runs if r.time_to_target_s is not None]
        to_target = _spread(reached, ".0f") if reached else "not reached"
        if reached and len(reached) < len(runs):
            to_target += f" ({len(reached)} of {len(runs)} seeds)"
        if diverged:
            to_target += f"; {diverged}"
        setup = ", ".join(sorted({f"{r.dtype}, {'compiled' if r.compiled else 'eager'}" for r in runs}))
        cells = [_spread([r.steps for r in runs], ".0f"), _spread([r.tokens for r in runs], ",.0f"),
                 _spread([r.train_time_s for r in runs], ".0f"), _spread([r.val_loss for r in runs], ".3f"),
                 _spread([r.bits_per_byte for r in runs], ".3f"), to_target]
        lines.append(f"| {name} | {_flags_cell(flags)} | {setup} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = ToolParser(description=__doc__, formatter_class=RawDescriptionDefaultsHelpFormatter)
    parser.add_argument("--recipes", default="previous_default,baseline",
                        help=f"comma-separated; built in: {', '.join(RECIPES)}")
    parser.add_argument("--recipe", action="append", default=[], metavar="NAME=FLAGS",
                        help="define a recipe, e.g. 'big=--batch_size 32 --learning_rate 3e-3' (repeatable)")
    parser.add_argument("--budget_s", type=float_within(0, A_YEAR_S, above_low=True), default=100.0,
                        help="training seconds per run (the trainer's --time_budget_s: at most a year)")
    parser.add_argument("--target_loss", type=float_within(0, math.inf), default=5.43,
                        help="the val loss whose time to reach is timed; the default value is the previous default "
                             "recipe's end-of-run loss (docs/recipe.md)")
    parser.add_argument("--seeds", type=int_list(*SEED_RANGE), default="0",
                        help="comma-separated; recipes are interleaved per seed")
    parser.add_argument("--common_flags", default="", help="trainer flags added to every recipe (data, model)")
    parser.add_argument("--eval_interval", type=int_within(1), default=25,
                        help="optimizer steps between validations (for the time to target)")
    parser.add_argument("--eval_batches", type=int_within(0, note="0: the whole validation split"), default=10,
                        help="batches per intermediate validation (0: the whole validation split)")
    parser.add_argument("--threads", type=benchmark_threads(), help="torch threads (default: torch's)")
    parser.add_argument("--out_dir", type=output_folder, default="out/time_to_loss",
                        help="the runs and the results (.json, .md)")
    args = parser.parse_args(argv)
    try:
        custom = parse_custom_recipes(args.recipe)
        names = [n.strip() for n in args.recipes.split(",") if n.strip()]
        recipes = {name: recipe_flags(name, custom) for name in names}
        common = shlex.split(args.common_flags)
        for flag in common:
            if flag.split("=")[0] in OWN_FLAGS:
                raise ValueError(f"--common_flags: {flag} is set by the benchmark")
    except ValueError as error:
        parser.error(str(error))
    if args.threads:
        torch.set_num_threads(args.threads)
    args.out_dir = Path(args.out_dir)  # under the repo root, checked as parsed (output_folder)
    try:  # a folder where a results file goes: refused now, not after every recipe's run
        for suffix in ("json", "md"):
            check_folder_path(args.out_dir / f"{RESULTS_NAME}.{suffix}", "--out_dir", itself=False)
        make_dirs(args.out_dir)
    except ValueError as error:
        parser.error(str(error))
    load_start = os.getloadavg()[0]
    header = f"{machine_line()}; load average {load_start:.2f} at start"
    print(header, flush=True)
    results = []
    for seed in args.seeds:
        for name, flags in recipes.items():
            result = run_recipe(name, [*common, *flags], seed, args)
            results.append(result)
            print(f"{name} seed {seed}: {result.status}, {result.steps} steps in {result.train_time_s:.0f} s, val "
                  f"loss {result.val_loss:.4f}, {result.bits_per_byte:.3f} bits/byte", flush=True)
    load_end = os.getloadavg()[0]
    table = results_table(results, recipes, args.budget_s, args.target_loss)
    common_text = f"; common flags `{shlex.join(common)}`" if common else ""
    report = (f"{header}, {load_end:.2f} at end. Budget {args.budget_s:g} s of training per run, seeds "
              f"{', '.join(map(str, args.seeds))}{common_text}.\n\n{table}\n")
    print("\n" + report)
    atomic_write_text(args.out_dir / f"{RESULTS_NAME}.md", report)
    atomic_write_text(args.out_dir / f"{RESULTS_NAME}.json", strict_json(
        {"machine": header, "load_end": load_end, "budget_s": args.budget_s, "target_loss": args.target_loss,
         "recipes": {n: list(f) for n, f in recipes.items()}, "common_flags": common,
         "runs": [asdict(r) for r in results]}, indent=2))
    return 0 if all(r.status == "finished" for r in results) else 1


if __name__ == "__main__":
    run_main(main)
