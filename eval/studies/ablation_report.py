"""Ablation report of a sweep run by scripts/sweep.py: `python eval/studies/ablation_report.py SWEEP_DIR [--out DIR]`.

Writes DIR/report.md (default SWEEP_DIR/report/): per variant (a trial's swept parameters minus `seed`), the
final validation loss mean ± std over seeds, median step time, tokens/s and how many seeds diverged; plus
report.json with the same numbers and PNG plots:
- val_curves.png: validation-loss curves per variant (mean over the finished seeds);
- prms_p.png: final validation loss against p for pRMSNorm (RMSNorm drawn at p = 1, its special case);
- pre_post_warmup.png: pre vs post placement, with and without warmup, per norm type.

Every number comes from the trials' own files: run_summary.json (final val loss, step time, tokens/s) and
metrics.jsonl (the curves). Diverged and failed trials are counted, not averaged.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script, from any directory
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trainer.run_dir import METRICS_FILE, read_metrics, read_summary, report_error  # noqa: E402
from trainer.sweep_dir import SWEEP_STATE_FILE, read_results, read_state, swept_names, trial_dir_name  # noqa: E402

SEED_KEY = "seed"
LINE_KEY = "norm_type"  # the parameter drawn as separate lines when present


@dataclass
class Trial:
    trial_id: str
    params: dict[str, Any]
    status: str                                  # finished | diverged | failed | not run (yet)
    summary: dict[str, Any] = field(default_factory=dict)
    val_curve: list[tuple[int, float]] = field(default_factory=list)

    @property
    def final_val_loss(self) -> float | None:
        value = (self.summary.get("final_val") or {}).get("loss")
        return value if self.status == "finished" and isinstance(value, (int, float)) else None


@dataclass
class Variant:
    params: dict[str, Any]                       # swept parameters without the seed
    trials: list[Trial] = field(default_factory=list)

    def finished(self) -> list[Trial]:
        return [t for t in self.trials if t.final_val_loss is not None]

    def count(self, status: str) -> int:
        return sum(t.status == status for t in self.trials)

    def loss_stats(self) -> tuple[float, float]:
        """Mean and sample standard deviation (n-1) of the finished seeds' final val loss."""
        losses = [t.final_val_loss for t in self.finished()]
        if not losses:
            return math.nan, math.nan
        return statistics.fmean(losses), statistics.stdev(losses) if len(losses) > 1 else math.nan

    def median_of(self, key: str) -> float:
        values = [t.summary[key] for t in self.finished() if isinstance(t.summary.get(key), (int, float))]
        return statistics.median(values) if values else math.nan

    def mean_curve(self) -> list[tuple[int, float]]:
        """Mean val loss per step over the finished seeds, at the steps all of them logged."""
        curves = [dict(t.val_curve) for t in self.finished() if t.val_curve]
        if not curves:
            return []
        steps = sorted(set.intersection(*(set(c) for c in curves)))
        return [(s, statistics.fmean(c[s] for c in curves)) for s in steps]


# --------------------------------------------------------------------------- loading
def load_sweep(sweep_dir: Path) -> tuple[dict[str, Any], list[Trial]]:
    """The sweep's config and its trials, in proposal order; the last results.jsonl record of a trial wins."""
    state = read_state(sweep_dir)
    if state is None:
        raise FileNotFoundError(f"{sweep_dir}: no {SWEEP_STATE_FILE}; run `python scripts/sweep.py FILE.yaml` first")
    records = {record["trial_id"]: record for record in read_results(sweep_dir)}
    trials = []
    for entry in state["trials"]:
        record = records.get(entry["trial_id"])
        trial_dir = sweep_dir / (record or {}).get("trial_dir", trial_dir_name(entry["trial_id"]))
        trial = Trial(entry["trial_id"], entry["params"], record["status"] if record else "not run")
        trial.summary = read_summary(trial_dir)
        if (trial_dir / METRICS_FILE).exists():
            trial.val_curve = [(r["step"], float(r["val_loss"])) for r in read_metrics(trial_dir / METRICS_FILE, "val")]
        trials.append(trial)
    return state["config"], trials


def swept_keys(config: dict[str, Any]) -> list[str]:
    """The swept parameters that define a variant: the seeds of one variant are averaged."""
    return [name for name in swept_names(config) if name != SEED_KEY]


def group_variants(config: dict[str, Any], trials: list[Trial]) -> list[Variant]:
    keys = swept_keys(config)
    variants: dict[str, Variant] = {}
    for trial in trials:
        if trial.status == "not run":
            continue
        params = {k: trial.params.get(k) for k in keys}
        variants.setdefault(json.dumps(params, sort_keys=True, default=str), Variant(params)).trials.append(trial)
    return list(variants.values())


def label(params: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items()) or "all trials"


# --------------------------------------------------------------------------- outputs
def _fmt(value: float, digits: int = 4) -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def variant_rows(variants: list[Variant]) -> list[dict[str, Any]]:
    rows = []
    for v in variants:
        mean, std = v.loss_stats()
        rows.append({"params": v.params, "seeds": len(v.trials), "finished": len(v.finished()),
                     "diverged": v.count("diverged"), "failed": v.count("failed"),
                     "val_loss_mean": mean, "val_loss_std": std,
                     "val_loss_per_seed": {str(t.params.get(SEED_KEY)): t.final_val_loss for t in v.trials},
                     "median_step_time_s": v.median_of("median_step_time_s"),
                     "tokens_per_s": v.median_of("tokens_per_s")})
    return rows


def markdown_table(config: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    keys = swept_keys(config)
    header = keys + ["final val loss (mean ± std)", "finished", "diverged", "step time (ms)", "tokens/s"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        loss = (f"{_fmt(row['val_loss_mean'])} ± {_fmt(row['val_loss_std'])}"
                if not math.isnan(row["val_loss_mean"]) else "–")
        failed = f" (+{row['failed']} failed)" if row["failed"] else ""
        cells = [str(row["params"][k]) for k in keys] + [
            loss, f"{row['finished']}/{row['seeds']}", f"{row['diverged']}{failed}",
            _fmt(row["median_step_time_s"] * 1000, 1), _fmt(row["tokens_per_s"], 0)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _panels(variants: list[Variant]) -> tuple[str | None, dict[str, list[Variant]]]:
    """Variants grouped into panels by everything but the line key (norm_type)."""
    line_key = LINE_KEY if variants and LINE_KEY in variants[0].params else None
    panels: dict[str, list[Variant]] = {}
    for v in variants:
        rest = {k: val for k, val in v.params.items() if k != line_key}
        panels.setdefault(label(rest), []).append(v)
    return line_key, panels


def plot_curves(variants: list[Variant], path: Path) -> bool:
    import matplotlib.pyplot as plt
    line_key, panels = _panels(variants)
    if not any(v.mean_curve() for v in variants):
        return False
    cols = min(2, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 4 * rows), squeeze=False, sharey=True)
    for ax, (title, members) in zip(axes.flat, panels.items()):
        for v in members:
            curve = v.mean_curve()
            name = str(v.params[line_key]) if line_key else label(v.params)
            diverged = v.count("diverged")
            if curve:
                ax.plot(*zip(*curve), marker="o", markersize=3,
                        label=f"{name} (n={len(v.finished())}" + (f", {diverged} diverged)" if diverged else ")"))
            elif diverged:
                ax.plot([], [], " ", label=f"{name}: all {diverged} diverged")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel("val loss (mean over seeds)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_prms_p(variants: list[Variant], path: Path) -> bool:
    """Final val loss against p: pRMSNorm variants at their p, RMSNorm at p = 1 (same panels as the curves)."""
    import matplotlib.pyplot as plt
    points: dict[str, list[tuple[float, float, float]]] = {}
    for v in variants:
        finished = v.finished()
        if not finished:
            continue
        kind = finished[0].params.get(LINE_KEY)  # the trial's full parameters: norm_type may be fixed, not swept
        if kind not in ("prmsnorm", "rmsnorm"):
            continue
        p = 1.0 if kind == "rmsnorm" else float(finished[0].params.get("prms_p", 0.0625))
        mean, std = v.loss_stats()
        rest = {k: val for k, val in v.params.items() if k not in (LINE_KEY, "prms_p")}
        points.setdefault(label(rest), []).append((p, mean, 0.0 if math.isnan(std) else std))
    if not any(any(p < 1 for p, _, _ in pts) for pts in points.values()):
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, pts in points.items():
        pts.sort()
        ax.errorbar([p for p, _, _ in pts], [m for _, m, _ in pts], yerr=[s for _, _, s in pts], marker="o",
                    capsize=3, label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("p (fraction of the hidden vector used for the RMS; 1 = RMSNorm)")
    ax.set_ylabel("final val loss (mean ± std over seeds)")
    ax.set_title("pRMSNorm: final val loss vs p")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_pre_post(variants: list[Variant], path: Path) -> bool:
    """Bars: per norm type, pre/post × without/with warmup; diverged seeds written on the bar."""
    import matplotlib.pyplot as plt
    needed = ("norm_placement", "warmup_steps")
    if not variants or not all(k in variants[0].params for k in needed):
        return False
    kinds = list(dict.fromkeys(v.params.get(LINE_KEY, "all") for v in variants))
    combos = list(dict.fromkeys((v.params["norm_placement"], v.params["warmup_steps"]) for v in variants
                                if v.params["norm_placement"] in ("pre", "post")))
    if len({c[0] for c in combos}) < 2:
        return False
    fig, ax = plt.subplots(figsize=(max(7, 1.8 * len(kinds) + 2), 4.5))
    width = 0.8 / len(combos)
    for i, (placement, warmup) in enumerate(combos):
        xs, ys, errs, notes = [], [], [], []
        for j, kind in enumerate(kinds):
            match = [v for v in variants if v.params.get(LINE_KEY, "all") == kind
                     and v.params["norm_placement"] == placement and v.params["warmup_steps"] == warmup]
            if not match:
                continue
            mean, std = match[0].loss_stats()
            xs.append(j + (i - (len(combos) - 1) / 2) * width)
            ys.append(0.0 if math.isnan(mean) else mean)
            errs.append(0.0 if math.isnan(std) else std)
            notes.append(match[0].count("diverged"))
        bars = ax.bar(xs, ys, width, yerr=errs, capsize=2, label=f"{placement}, warmup {warmup}")
        for bar, diverged in zip(bars, notes):
            if diverged:
                ax.annotate(f"{diverged} div.", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize=7, color="red")
    finite = [v.loss_stats()[0] for v in variants if not math.isnan(v.loss_stats()[0])]
    if finite:
        ax.set_ylim(min(finite) - 0.3, max(finite) + 0.3)
    ax.set_xticks(range(len(kinds)), [str(k) for k in kinds])
    ax.set_ylabel("final val loss (mean ± std over seeds)")
    ax.set_title("pre vs post placement, with and without warmup")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_report(sweep_dir: str | Path, out_dir: str | Path | None = None) -> Path:
    """Write report.md, report.json and the plots; returns the markdown path."""
    import matplotlib
    matplotlib.use("Agg")
    sweep_dir = Path(sweep_dir)
    out = Path(out_dir) if out_dir else sweep_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    config, trials = load_sweep(sweep_dir)
    variants = group_variants(config, trials)
    rows = variant_rows(variants)
    plots = {"val_curves.png": plot_curves(variants, out / "val_curves.png"),
             "prms_p.png": plot_prms_p(variants, out / "prms_p.png"),
             "pre_post_warmup.png": plot_pre_post(variants, out / "pre_post_warmup.png")}
    fixed = {k: spec["value"] for k, spec in config["parameters"].items() if "value" in spec}
    counts = {s: sum(t.status == s for t in trials) for s in ("finished", "diverged", "failed", "not run")}
    seeds = sorted({t.params.get(SEED_KEY) for t in trials if SEED_KEY in t.params}, key=str)
    md = [f"# Ablation report: sweep `{config.get('name', sweep_dir.name)}`", "",
          f"Method `{config['method']}`, metric `{(config.get('metric') or {}).get('name')}`; "
          f"{len(trials)} trials: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n) +
          (f"; seeds {seeds}" if seeds else "") + ".", "",
          "Final val loss: the trainer's last evaluation over the whole validation split (run_summary.json), "
          "mean ± sample std (n-1) over the finished seeds; diverged (NaN/inf) and failed trials are counted "
          "and left out of the mean. Step time and tokens/s: median over the variant's trials of each run's "
          "median step (the machine may be shared, so treat speed as indicative).", "",
          markdown_table(config, rows), ""]
    for name, made in plots.items():
        if made:
            md += [f"![{name[:-4]}]({name})", ""]
    md += ["Fixed settings: " + ", ".join(f"`{k}={v}`" for k, v in fixed.items()), ""]
    (out / "report.md").write_text("\n".join(md))
    payload = {"sweep": config.get("name"), "method": config["method"], "counts": counts, "variants": rows,
               "trials": [{"trial_id": t.trial_id, "status": t.status, "params": t.params,
                           "final_val_loss": t.final_val_loss,
                           "median_step_time_s": t.summary.get("median_step_time_s"),
                           "tokens_per_s": t.summary.get("tokens_per_s")} for t in trials],
               "plots": [name for name, made in plots.items() if made]}
    (out / "report.json").write_text(json.dumps(payload, indent=1, default=str, allow_nan=True))
    return out / "report.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Markdown + PNG report of a sweep run by scripts/sweep.py")
    parser.add_argument("sweep_dir", help="e.g. out/sweeps/paper_cpu")
    parser.add_argument("--out", help="output folder (default: SWEEP_DIR/report/)")
    args = parser.parse_args(argv)
    try:
        path = write_report(args.sweep_dir, args.out)
    except (FileNotFoundError, ValueError) as error:
        return report_error(error)
    print(f"report written to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
