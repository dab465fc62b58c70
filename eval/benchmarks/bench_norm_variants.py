"""Interleaved step time of every variant of a normalization-study sweep (the second edition, docs/study.md):

    OMP_NUM_THREADS=1 python eval/benchmarks/bench_norm_variants.py scripts/sweep_configs/study2_lr.yaml \\
        --out eval/studies/results/study2/step_times.json

One trainer per variant (the sweep's `config` values: scripts/sweep_configs/study2_variants/*.yaml), each built
exactly as the sweep builds a trial (its fixed parameters, the variant file, the middle rate of its grid; whole-
model compile as the trial's --compile decides, diagnostics off), all in one process. After `--warmup` rounds,
each of `--rounds` rounds times `--steps` optimizer steps of every variant in turn, the order rotated by one
variant per round, so a change in the machine's load hits every variant alike and no variant always follows the
same one. Per variant: the median of its timed steps and its ratio to the baseline's (pre RMSNorm). The JSON is
what `eval/studies/ablation_report.py --study2 --step_times FILE` reads; a markdown table goes next to it.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script, from any directory
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trainer.cli import quiet_ctrl_c_while_loading  # noqa: E402

quiet_ctrl_c_while_loading(__name__)  # a Ctrl-C while the imports below load: one line, exit 130

import math  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

from dataset.json_text import strict_json  # noqa: E402
from trainer.run_dir import resolve_input_path  # noqa: E402

VARIANT_KEY, LR_KEY, SEED_KEY = "config", "learning_rate", "seed"
BASELINE = "pre_rmsnorm"
# Sweep parameters that do not change a step's work, or that the benchmark sets itself.
NOT_PASSED = ("out_dir", "use_wandb", "diag_interval")


def variant_name(path: str) -> str:
    return Path(path).stem


def rotation(names: list[str], round_index: int) -> list[str]:
    """The order of one round: the names rotated left by the round's index."""
    if not names:
        return []
    shift = round_index % len(names)
    return names[shift:] + names[:shift]


def variant_argv(config: dict[str, Any], variant: str, out_dir: str, compile_mode: str | None = None) -> list[str]:
    """The trainer flags of one trial of the sweep for `variant`: its fixed parameters, the variant file, the middle
    learning rate of the grid (a rate changes no work) and the first seed; diagnostics off."""
    params = config["parameters"]
    argv = []
    for name, spec in params.items():
        if name in (VARIANT_KEY, *NOT_PASSED):
            continue
        value = spec["value"] if "value" in spec else spec["values"][len(spec["values"]) // 2 if name == LR_KEY else 0]
        argv.append(f"--{name}={str(value).lower() if isinstance(value, bool) else value}")
    argv += [f"--config={variant}", f"--out_dir={out_dir}", "--diag_interval=0"]
    if compile_mode is not None:
        argv.append(f"--compile={compile_mode}")
    return argv


def interleaved(fns: dict[str, Callable[[], float]], rounds: int, steps: int, warmup: int) -> dict[str, list[float]]:
    """Seconds per step of each fn (each runs one step and returns its duration), `steps` in a row per turn, the
    turns in rotated order; the first `warmup` rounds are not kept."""
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    for index in range(warmup + rounds):
        for name in rotation(names, index):
            measured = [fns[name]() for _ in range(steps)]
            if index >= warmup:
                times[name].extend(measured)
    return times


def summarize(times: dict[str, list[float]], baseline: str = BASELINE) -> dict[str, dict[str, float]]:
    """Per variant: median step (s), its ratio to the baseline's median (NaN without a baseline), timed steps."""
    medians = {name: statistics.median(t) if t else math.nan for name, t in times.items()}
    base = medians.get(baseline, math.nan)
    return {name: {"median_step_s": m, "vs_baseline": m / base if base and math.isfinite(base) else math.nan,
                   "steps": len(times[name])} for name, m in medians.items()}


def markdown_table(summary: dict[str, dict[str, float]], baseline: str = BASELINE) -> str:
    lines = [f"| variant | median step (ms) | vs {baseline} | timed steps |", "|---|---|---|---|"]
    for name, row in summary.items():
        ratio = "–" if math.isnan(row["vs_baseline"]) else f"{row['vs_baseline']:.3f}"
        lines.append(f"| {name} | {row['median_step_s'] * 1000:.1f} | {ratio} | {row['steps']} |")
    return "\n".join(lines)


def run(config: dict[str, Any], rounds: int, steps: int, warmup: int, compile_mode: str | None,
        variants: list[str] | None = None) -> dict[str, Any]:
    """Build a trainer per variant and time them interleaved; the JSON payload."""
    from accelerate.state import AcceleratorState

    from trainer.args import parse_args
    from trainer.core import Trainer
    from trainer.machine import machine_line
    from trainer.step_timer import timed_step

    files = [str(v) for v in config["parameters"][VARIANT_KEY]["values"]]
    if variants:
        unknown = sorted(set(variants) - {variant_name(f) for f in files})
        if unknown:
            raise ValueError(f"--variants: {', '.join(unknown)} not in the sweep's {VARIANT_KEY} values; "
                             f"allowed: {','.join(variant_name(f) for f in files)}")
        files = [f for f in files if variant_name(f) in variants]
    import torch._dynamo

    # Every variant compiles the same forward code for its own modules, one recompilation each: dynamo's default
    # limit (8 per code object) would leave the later variants of twelve eager, timed unlike their trials.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * len(files) + 8)
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit,
                                                           64 * len(files))
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as scratch:
        fns = {}
        for file in files:
            AcceleratorState._reset_state(reset_partial_state=True)
            argv = variant_argv(config, file, str(Path(scratch) / variant_name(file)), compile_mode)
            fns[variant_name(file)] = timed_step(Trainer(parse_args("pretrain", argv)))
        times = interleaved(fns, rounds, steps, warmup)
    summary = summarize(times)
    return {"sweep": config.get("name"), "machine": machine_line(), "threads": _threads(),
            "rounds": rounds, "steps_per_turn": steps, "warmup_rounds": warmup, "compile": compile_mode or "as trials",
            "load_average": [load_start, os.getloadavg()[0]], "variants": summary, "times_s": times,
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}


def _threads() -> int:
    import torch
    return torch.get_num_threads()


def main(argv: list[str] | None = None) -> int:
    from dataset.atomic_io import atomic_write_text, check_output_file
    from trainer.cli import MAX_COUNT, ToolParser, int_within, output_file
    from trainer.run_dir import report_error
    from trainer.yaml_file import read_yaml

    parser = ToolParser(description="Interleaved step time of every variant of a normalization-study sweep")
    parser.add_argument("sweep", help="sweep YAML whose `config` values are the variant files, e.g. "
                                      "scripts/sweep_configs/study2_lr.yaml")
    parser.add_argument("--out", type=output_file, required=True,
                        help="JSON to write (a .md table is written beside it)")
    parser.add_argument("--rounds", type=int_within(1, MAX_COUNT), default=10, help="timed rounds")
    parser.add_argument("--steps", type=int_within(1, MAX_COUNT), default=5, help="steps of a variant per turn")
    parser.add_argument("--warmup", type=int_within(0, MAX_COUNT), default=2,
                        help="untimed rounds first (compile, caches)")
    parser.add_argument("--compile", choices=("on", "off"), default=None,
                        help="whole-model compile for every variant (default: as the sweep's trials decide)")
    parser.add_argument("--variants", help="comma-separated variant names (default: all of the sweep's)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    try:
        sweep = resolve_input_path(args.sweep)
        for path in (out, out.with_suffix(".md")):  # refused before the rounds, not after them
            check_output_file(path, "--out", [("the sweep", sweep)])
        config = read_yaml(sweep, "a sweep YAML")  # one line naming it: missing, a folder, not YAML
        parameters = config.get("parameters") if isinstance(config, dict) else None
        if not isinstance(parameters, dict) or VARIANT_KEY not in parameters:
            raise ValueError(f"{args.sweep}: no `{VARIANT_KEY}` parameter (the variant files) to time")
        payload = run(config, args.rounds, args.steps, args.warmup, args.compile,
                      args.variants.split(",") if args.variants else None)
    except (FileNotFoundError, ValueError) as error:
        return report_error(error)
    atomic_write_text(out, strict_json(payload, indent=1))
    table = markdown_table(payload["variants"])
    atomic_write_text(out.with_suffix(".md"),
                      f"# Interleaved step times: `{payload['sweep']}`\n\n{payload['machine']}; "
                      f"{payload['threads']} threads; load average {payload['load_average'][0]:.2f} "
                      f"at start, {payload['load_average'][1]:.2f} at end; {args.rounds} rounds x "
                      f"{args.steps} steps after {args.warmup} warmup rounds.\n\n{table}\n")
    print(table)
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    from trainer.cli import run_main  # as main()'s imports: importing this module loads none of the library

    run_main(main)
