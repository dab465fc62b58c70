"""The second edition's section of the report (`--study2`): tables, plots and numbers over all the parts together,
and the second-seed sweep YAML written from the learning-rate grid's results (`--write_seed2`)."""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path
from typing import Any

from dataset.atomic_io import atomic_write_text
from eval.studies.ablation.load import SEED_KEY, Part, Trial
from eval.studies.ablation.study2 import (BASELINE_VARIANT, ESCAPE_MARGIN, INIT_KEY, LR_KEY, POST_LN_VARIANT,
                                          VARIANT_KEY, WARMUP_KEY, best_rate, escape_step, losses_by_rate,
                                          lr_sensitivity, relative_step_times, run_value, stability,
                                          trial_metrics, variant_name, wall_clock_curve)
from eval.studies.ablation.study2_plots import plot_curves_steps_and_time, plot_loss_vs_rate, plot_resid_rms
from trainer.run_dir import REPO_ROOT, shown_path
from trainer.sweep_dir import swept_names


def _f(value: float | None, digits: int = 3) -> str:
    return "–" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


def _trial_numbers(trial: Trial, unigram: float | None, margin: float) -> dict[str, Any]:
    records = trial_metrics(trial)
    steps = trial.summary.get("steps") if trial.status == "diverged" else None
    return {"variant": variant_name(trial.params), "trial_id": trial.trial_id, "status": trial.status,
            "learning_rate": run_value(trial, LR_KEY), "seed": run_value(trial, SEED_KEY),
            "warmup_steps": run_value(trial, WARMUP_KEY), "init_depth_scaling": run_value(trial, INIT_KEY),
            "final_val_loss": trial.final_val_loss, "val_curve": trial.val_curve,
            "wall_clock_curve": wall_clock_curve(records),
            "median_step_time_s": trial.summary.get("median_step_time_s"),
            "escape_step": escape_step(trial.val_curve, unigram, margin) if unigram is not None else None,
            "stability": stability(records, trial.status, steps).as_dict()}


def _representative(rows: list[dict[str, Any]], variant: str, lr: float) -> dict[str, Any] | None:
    """The variant's lowest-seed finished trial at the rate: the one drawn in the curves and profiles."""
    match = [r for r in rows
             if r["variant"] == variant and r["learning_rate"] == lr and r["final_val_loss"] is not None]
    return min(match, key=lambda r: (r["seed"] is None, r["seed"] or 0)) if match else None


def _escape_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per Post-LN rate x warmup x init, every seed's escape. A training two parts both ran (the grid's Post-LN
    point is also a cell of the Post-LN part: same settings, same seed) counts once, as the first part ran it."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        if r["variant"] == POST_LN_VARIANT and r["status"] in ("finished", "diverged"):
            members = groups.setdefault((r["learning_rate"], r["warmup_steps"], r["init_depth_scaling"]), [])
            if all(m["seed"] != r["seed"] for m in members):
                members.append(r)
    out = []
    for (lr, warmup, init), members in sorted(groups.items(), key=lambda kv: tuple(str(x) for x in kv[0])):
        members.sort(key=lambda r: (r["seed"] is None, r["seed"] or 0))
        out.append({"learning_rate": lr, "warmup_steps": warmup, "init_depth_scaling": init,
                    "seeds": [r["seed"] for r in members], "escape_steps": [r["escape_step"] for r in members],
                    "escaped": sum(r["escape_step"] is not None for r in members), "runs": len(members),
                    "final_val_loss": [r["final_val_loss"] for r in members]})
    return out


def is_rate_grid(part: Part) -> bool:
    """A part that varies nothing but the variant, the learning rate and the seed: the grid, its extra rates, its
    second seed. Such parts pool into one learning-rate grid."""
    return set(swept_names(part.config)) <= {VARIANT_KEY, LR_KEY, SEED_KEY}


def shared_rates(grid: list[Part]) -> set[float]:
    """The rates of the grid parts that cover every variant of the grid (part 1 and its extra rate, not a part that
    extends a few variants upward): the rates the learning-rate sensitivity is taken over, so that every variant's is
    a mean over the same rates. Empty when no part declares its rates."""
    variants = [{variant_name(t.params) for t in p.trials} for p in grid]
    everyone = set().union(*variants) if variants else set()
    return {lr for p, names in zip(grid, variants) if names == everyone for lr in _part_rates(p)}


def chosen_rate_losses(grid: list[Part]) -> dict[str, dict[float, list[float | None]]]:
    """losses_by_rate over the grid parts that declare their rates (the grid's own seed): the losses a variant's best
    rate is chosen on, by the report and by --write_seed2 alike. A second-seed part (its rate inside each variant
    file) is left out, so it refines the chosen rate's loss but never moves the choice."""
    return losses_by_rate([t for p in grid if _part_rates(p) for t in p.trials])


def _part_rates(part: Part) -> list[float]:
    spec = part.config["parameters"].get(LR_KEY, {})
    return [float(lr) for lr in (spec["values"] if "values" in spec else [spec["value"]] if "value" in spec else [])]


def _chosen_best(rates: dict[float, list[float | None]],
                 first_seed_rates: dict[float, list[float | None]]) -> tuple[float, float] | None:
    """A variant's (best rate, its mean loss over every finished seed): the rate chosen on the grid's own seed
    (chosen_rate_losses), else the best of all its rates."""
    # Re-choosing among means of unequal seed counts would favour the rates that ran once (chosen_rate_losses).
    chosen = best_rate(first_seed_rates)
    finished = [v for v in rates.get(chosen[0], []) if v is not None] if chosen else []
    return (chosen[0], statistics.fmean(finished)) if finished else best_rate(rates)


def _finite_max(rows: list[dict[str, Any]], key: str) -> float:
    """The largest finite stability number `key` of the rows (NaN when none)."""
    return max((r["stability"][key] for r in rows if math.isfinite(r["stability"][key])), default=math.nan)


def _variant_numbers(name: str, rates: dict[float, list[float | None]], best: tuple[float, float] | None,
                     rows_grid: list[dict[str, Any]], shared: set[float], unigram: float | None) -> dict[str, Any]:
    """A variant's best rate and loss, learning-rate sensitivity, rate counts, failures and stability maxima."""
    at_best = [r for r in rows_grid if r["variant"] == name and best and r["learning_rate"] == best[0]]
    mine = [r for r in rows_grid if r["variant"] == name]
    return {
        "variant": name, "rates": len(rates), "best_rate": best[0] if best else None,
        # the lowest or highest rate of the variant's grid: its optimum may lie outside the grid
        "best_rate_at_edge": bool(best and len(rates) >= 3 and best[0] in (min(rates), max(rates))),
        "best_loss": best[1] if best else None,
        "best_loss_seeds": [v for v in rates.get(best[0], [])] if best else [],
        # over the shared rates only: a variant's extra rates move its best rate, not its sensitivity
        "lr_sensitivity": (lr_sensitivity({lr: s for lr, s in rates.items() if lr in shared}, unigram,
                                          best[1] if best and best[0] in shared else None)
                           if unigram is not None else None),
        "shared_rates": sum(lr in shared for lr in rates),
        "extra_rates": sorted(lr for lr in rates if lr not in shared),
        "diverged_or_failed": sum(r["status"] != "finished" for r in mine), "trials": len(mine),
        "nonfinite_rates": sorted({r["learning_rate"] for r in mine if r["status"] == "diverged"}),
        "attn_logit_max_grid": _finite_max([r for r in mine if r["learning_rate"] in shared], "attn_logit_max"),
        "attn_logit_max": _finite_max(at_best, "attn_logit_max"),
        "logits_rms_max": _finite_max(at_best, "logits_rms_max"),
        "logits_max": _finite_max(at_best, "logits_max"),
        "loss_spikes": sum(len(r["stability"]["loss_spikes"]) for r in at_best),
        "grad_spikes": sum(len(r["stability"]["grad_spikes"]) for r in at_best)}


def _median_step_times(by_rate: dict[str, dict[float, list[float | None]]],
                       rows_grid: list[dict[str, Any]]) -> dict[str, float]:
    """Per variant, the median over its grid trials of each trial's median step time (NaN when none recorded one)."""
    # A trial that diverged before its first timed step has no time: null in its summary, NaN in one written before
    # the writers went strict. Only finite times count: a NaN, truthy and unordered, once sat in study 2's median
    # and moved no_norm's from 217.8 to 224.7 ms.
    trial_times: dict[str, float] = {}
    for name in by_rate:
        times = [t for r in rows_grid if r["variant"] == name
                 and isinstance(t := r["median_step_time_s"], (int, float)) and math.isfinite(t) and t > 0]
        trial_times[name] = statistics.median(times) if times else math.nan
    return trial_times


def _section_plots(by_rate: dict[str, dict[float, list[float | None]]], curves_steps: dict, curves_time: dict,
                   profiles: dict, out: Path, unigram: float | None) -> dict[str, bool]:
    """Draw the section's plots into `out`: the loss per rate, the curves over steps and time, the residual RMS
    profiles; by file name, whether each was drawn."""
    return {"study2_loss_vs_rate.png": plot_loss_vs_rate(
                {n: {lr: statistics.fmean(f) for lr, s in r.items() if (f := [v for v in s if v is not None])}
                 for n, r in by_rate.items()},
                {n: [lr for lr, s in r.items() if all(v is None for v in s)] for n, r in by_rate.items()},
                out / "study2_loss_vs_rate.png", unigram),
            "study2_curves_steps_time.png": plot_curves_steps_and_time(curves_steps, curves_time,
                                                                       out / "study2_curves_steps_time.png", unigram),
            "study2_resid_rms.png": plot_resid_rms(profiles, out / "study2_resid_rms.png")}


def study2_section(parts: list[Part], out: Path, unigram: float | None, bench_step_times: dict[str, float] | None,
                   margin: float = ESCAPE_MARGIN) -> tuple[list[str], dict[str, Any]]:
    """Markdown lines and the JSON payload of the second edition's section; writes its plots into `out`."""
    trials = [t for p in parts for t in p.trials]
    rows = [_trial_numbers(t, unigram, margin) for t in trials if t.status != "not run"]
    # The rate tables pool only the parts that vary nothing but the variant, the rate and the seed (the grid and its
    # second seed); a part that also sweeps, say, the warmup (the Post-LN part) feeds the escape table alone.
    grid_parts = [p for p in parts if is_rate_grid(p)]
    grid_ids = {t.trial_id for p in grid_parts for t in p.trials}
    by_rate = losses_by_rate([t for t in trials if t.trial_id in grid_ids])
    first_seed = chosen_rate_losses(grid_parts)
    rows_grid = [r for r in rows if r["trial_id"] in grid_ids]
    shared = shared_rates(grid_parts) or {lr for r in by_rate.values() for lr in r}
    trial_times = _median_step_times(by_rate, rows_grid)
    relative = relative_step_times(trial_times)
    bench_relative = relative_step_times(bench_step_times or {})
    variants, curves_steps, curves_time, profiles = [], {}, {}, {}
    for name, rates in by_rate.items():
        best = _chosen_best(rates, first_seed.get(name, {}))
        rep = _representative(rows_grid, name, best[0]) if best else None
        seconds_per_step = (bench_step_times or {}).get(name)
        if rep is not None:  # the representative trial's curves, over steps and over time, and its profile
            curves_steps[name] = rep["val_curve"]
            curves_time[name] = ([(s * seconds_per_step, v) for s, v in rep["val_curve"]] if seconds_per_step
                                 else rep["wall_clock_curve"])
            profiles[name] = rep["stability"]["resid_rms"]
        variants.append(_variant_numbers(name, rates, best, rows_grid, shared, unigram) | {
            "resid_rms": profiles.get(name, []),
            "median_step_time_s": trial_times[name], "step_time_vs_baseline": relative.get(name, math.nan),
            "bench_step_time_s": (bench_step_times or {}).get(name, math.nan),
            "bench_step_time_vs_baseline": bench_relative.get(name, math.nan)})
    escapes = _escape_rows(rows)
    plots = _section_plots(by_rate, curves_steps, curves_time, profiles, out, unigram)
    md = _markdown(variants, by_rate, escapes, plots, unigram, len(shared), margin, bench_step_times is not None)
    payload = {"variants": variants, "losses_by_rate": {n: {str(lr): s for lr, s in r.items()}
                                                         for n, r in by_rate.items()},
               "post_ln_escapes": escapes, "escape_margin": margin, "unigram": unigram,
               "trials": rows, "plots": [n for n, made in plots.items() if made]}
    return md, payload


def _explanation() -> list[str]:
    """The section's heading and what its numbers mean."""
    return ["## Second edition: learning rates, depth, time and stability", "",
            "Best rate: per variant, the rate with the lowest final val loss of the grid's own seed (the parts that "
            "declare rates); best loss: the mean over the finished seeds at that rate (a second seed refines it, "
            "never moves the rate). "
            "LR sensitivity (Wortsman et al. 2023, capped at the unigram loss instead of the loss at initialization): "
            "the mean over the variant's rates of min(loss, unigram), a rate's loss being the mean over its seeds "
            "with a diverged or failed seed counted as the unigram loss, minus the best loss (0 when every rate is "
            "capped), both terms over the rates every variant ran (a part that adds rates for some variants only "
            "moves their best rate; the rates column counts those as \"+ N\"). Step time: median over the variant's "
            "trials of each trial's median step; \"vs "
            f"{BASELINE_VARIANT}\": its ratio to the baseline's (above 1: slower). Spikes: a step whose loss (or "
            "gradient norm) exceeds 1.5 x the median of the previous 50 finite values (at least 10 of them), or is "
            "not finite, counted over the best rate's trials. Attention logit: the largest q.k/sqrt(d) before the "
            "softmax on the diagnostic steps. A best rate marked (edge) is the lowest or highest rate of the "
            "variant's grid: its optimum may lie outside the grid, and its sensitivity is then a lower bound.", ""]


def _variants_table(variants: list[dict[str, Any]], unigram: float | None, grid_size: int,
                    interleaved: bool) -> list[str]:
    """Per variant: its rates, best rate and loss, LR sensitivity, failures and step times."""
    header = ["variant", "rates", "best rate", "best loss (seeds)", "vs unigram", "LR sensitivity",
              "diverged/failed", "step (ms)", f"vs {BASELINE_VARIANT}"] + (["interleaved vs baseline"]
                                                                         if interleaved else [])
    md = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for v in variants:
        seeds = ", ".join(_f(s) for s in v["best_loss_seeds"])
        partial = f" ({v['shared_rates']}/{grid_size} rates)" if v["shared_rates"] < grid_size else ""
        edge = " (edge)" if v["best_rate_at_edge"] else ""
        extra = f" + {len(v['extra_rates'])}" if v["extra_rates"] else ""
        cells = [v["variant"], f"{v['shared_rates']}{extra}", f"{v['best_rate']:.3g}{edge}" if v["best_rate"] else "–",
                 f"{_f(v['best_loss'])} ({seeds})" if v["best_loss"] is not None else "–",
                 f"{v['best_loss'] - unigram:+.3f}" if unigram is not None and v["best_loss"] is not None else "–",
                 _f(v["lr_sensitivity"]) + partial, f"{v['diverged_or_failed']}/{v['trials']}",
                 _f(v["median_step_time_s"] * 1000, 1), _f(v["step_time_vs_baseline"], 2)]
        if interleaved:
            cells.append(_f(v["bench_step_time_vs_baseline"], 2))
        md.append("| " + " | ".join(cells) + " |")
    return md


def _rates_table(by_rate: dict[str, dict[float, list[float | None]]]) -> list[str]:
    """Per variant and rate, the mean final val loss over the finished seeds (`div`: none finished)."""
    rates = sorted({lr for r in by_rate.values() for lr in r})
    md = ["", "Final val loss per rate (mean over finished seeds; `div` every seed diverged or failed):", "",
          "| variant | " + " | ".join(f"{lr:.3g}" for lr in rates) + " |", "|" + "---|" * (len(rates) + 1)]
    for name, r in by_rate.items():
        cells = []
        for lr in rates:
            finished = [v for v in r.get(lr, []) if v is not None]
            cells.append(_f(statistics.fmean(finished)) if finished else ("div" if lr in r else ""))
        md.append(f"| {name} | " + " | ".join(cells) + " |")
    return md


def _stability_table(variants: list[dict[str, Any]]) -> list[str]:
    """Per variant, the stability maxima at its best rate, its residual RMS profile and its non-finite stops."""
    md = ["", "Stability at each variant's best rate (max over its seeds); non-finite stops over all its rates, "
          "the attention logit over the rates every variant ran too. Residual RMS: first / last block at the last "
          "diagnostic step.", "",
          "| variant | attn logit max (best rate) | attn logit max (grid) | logits RMS max | logits max | "
          "resid RMS first / last | loss spikes | grad spikes | non-finite stops at rates |",
          "|---|---|---|---|---|---|---|---|---|"]
    for v in variants:
        resid = v["resid_rms"]
        md.append(f"| {v['variant']} | {_f(v['attn_logit_max'], 2)} | {_f(v['attn_logit_max_grid'], 2)} | "
                  f"{_f(v['logits_rms_max'], 2)} | {_f(v['logits_max'], 2)} | "
                  + (f"{resid[0]:.3g} / {resid[-1]:.3g}" if resid else "–")
                  + f" | {v['loss_spikes']} | {v['grad_spikes']} | "
                  + (", ".join(f"{lr:.3g}" for lr in v["nonfinite_rates"]) or "none") + " |")
    return md


def _escapes_table(escapes: list[dict[str, Any]], unigram: float | None, margin: float) -> list[str]:
    """Per Post-LN rate x warmup x init, which seeds escaped the unigram plateau and when (nothing without any)."""
    if not escapes:
        return []
    md = ["", f"Post-LN (`{POST_LN_VARIANT}`) plateau escape: the first evaluation step whose val loss is at "
          f"least {margin} nats below the unigram loss ({_f(unigram)}); `–` never. A training two parts both ran "
          "(same settings and seed) counts once.", "",
          "| learning rate | warmup steps | init_depth_scaling | escaped / runs | escape step per seed | "
          "final val loss per seed |", "|---|---|---|---|---|---|"]
    for e in escapes:
        md.append(f"| {e['learning_rate']:.3g} | {e['warmup_steps']} | {e['init_depth_scaling']} | "
                  f"{e['escaped']}/{e['runs']} | "
                  + ", ".join(f"seed {s}: {'–' if x is None else x}" for s, x in zip(e["seeds"], e["escape_steps"]))
                  + " | " + ", ".join(_f(x) for x in e["final_val_loss"]) + " |")
    return md


def _markdown(variants: list[dict[str, Any]], by_rate: dict[str, dict[float, list[float | None]]],
              escapes: list[dict[str, Any]], plots: dict[str, bool], unigram: float | None, grid_size: int,
              margin: float, interleaved: bool) -> list[str]:
    """The section's markdown: what its numbers mean, its tables and its plots."""
    md = _explanation()
    if not variants:
        return md + ["No trial of the second edition has run yet.", ""]
    md += (_variants_table(variants, unigram, grid_size, interleaved) + _rates_table(by_rate)
           + _stability_table(variants) + _escapes_table(escapes, unigram, margin))
    md.append("")
    for name, made in plots.items():
        if made:
            md += [f"![{name[:-4]}]({name})", ""]
    return md


# --------------------------------------------------------------------------------------------- second seed
def write_seed2_yaml(part: Part, directory: str | Path, more: list[Part] | None = None) -> Path:
    """From a finished learning-rate grid (a part sweeping `config` and `learning_rate`), write a sweep YAML that
    runs one more seed of every variant at its best rate, DIRECTORY/<part>_seed2.yaml: per variant a --config file
    (its variant file plus `learning_rate: BEST`) in DIRECTORY/<part>_seed2_rates/, and the sweep over those files.
    `more`: other parts; those that are rate grids too (`is_rate_grid`, e.g. the grid's extra rates) pool into the
    best rate, and each must be complete. Returns the YAML's path."""
    import yaml
    config = part.config
    swept = {k for k, spec in config["parameters"].items() if "values" in spec}
    if not {VARIANT_KEY, LR_KEY} <= swept:
        raise ValueError(f"{part.sweep_dir}: --write_seed2 needs a part that sweeps {VARIANT_KEY} and {LR_KEY}")
    grid = [part] + [p for p in more or [] if is_rate_grid(p)]
    for member in grid:
        expected = len(_part_rates(member))
        mine = losses_by_rate(member.trials)
        names = {variant_name(t.params) for t in member.trials}
        incomplete = sorted(n for n in names if len(mine.get(n, {})) < expected)
        if incomplete:
            raise ValueError(f"{member.sweep_dir}: the grid is not complete for {', '.join(incomplete)}; "
                             f"finish the learning-rate part first")
    by_rate = chosen_rate_losses(grid)
    files = {Path(str(t.params[VARIANT_KEY])).stem: str(t.params[VARIANT_KEY]) for t in part.trials}
    path = Path(directory) / f"{part.name}_seed2.yaml"
    rates_dir = path.parent / f"{path.stem}_rates"
    rates_dir.mkdir(parents=True, exist_ok=True)
    seeds = [t.params.get(SEED_KEY, 0) for member in grid for t in member.trials]
    seed = max(int(s) for s in seeds) + 1 if seeds else 1
    stamp = time.strftime("%Y-%m-%d")
    sources = " + ".join(f"{shown_path(m.sweep_dir)} ({m.name})" for m in grid)
    generated, chosen = [], {}
    for name, source in files.items():  # the grid's order: the baseline first
        best = best_rate(by_rate[name])
        if best is None:
            continue  # no rate finished: nothing to repeat
        chosen[name] = best
        text = (REPO_ROOT / source).read_text()
        target = rates_dir / f"{name}.yaml"
        atomic_write_text(target, f"# Generated {stamp} by eval/studies/ablation_report.py --write_seed2 from "
                                  f"{sources}:\n# {source} at its best rate (final val loss {best[1]:.4f}).\n"
                                  f"{text.rstrip()}\nlearning_rate: {best[0]}\n")
        generated.append(shown_path(target))  # the sweep runs trials from the repo root
    new = {k: v for k, v in config.items()}
    new["name"] = path.stem
    new["description"] = f"second seed of every variant of {config.get('name')} at its best learning rate"
    parameters = {k: v for k, v in config["parameters"].items() if k not in (LR_KEY, SEED_KEY)}
    parameters[VARIANT_KEY] = {"values": generated}
    parameters[SEED_KEY] = {"values": [seed]}
    new["parameters"] = parameters
    lines = [f"# Generated {stamp} by eval/studies/ablation_report.py --write_seed2 from {sources}:",
             f"# seed {seed} of every variant at its best rate (the lowest final val loss of "
             "the grid):"] + [f"#   {n}: {lr:.3g} ({loss:.4f})" for n, (lr, loss) in chosen.items()]
    atomic_write_text(path, "\n".join(lines) + "\n" + yaml.safe_dump(new, sort_keys=False, width=120))
    return path
