"""Ablation report of one or more sweeps run by scripts/sweep.py:

    python eval/studies/ablation_report.py SWEEP_DIR [SWEEP_DIR ...] [--out DIR] [--unigram]

Writes DIR/report.md (default: the first SWEEP_DIR's report/) with one section per sweep (a "part" of a study):
per variant (a trial's swept parameters minus `seed`), the final validation loss mean ± std over seeds, how
many seeds diverged, the gradient-norm ratio between the first and the last block at the last diagnostics step
(when the trials logged diagnostics), median step time and tokens/s; plus report.json with the same numbers and
PNG plots per part (prefixed with the part's name when there are several):
- val_curves.png: validation-loss curves per variant (mean over the finished seeds); panels by learning rate
  when it is swept without the norm type, else by everything but the norm type;
- prms_p.png: final validation loss against p for pRMSNorm (RMSNorm drawn at p = 1, its special case);
- pre_post_warmup.png: pre vs post placement, with and without warmup, per norm type (bars);
- lr_warmup.png: final validation loss against the learning rate, one line per placement x warmup (the Post-LN
  warmup plot of Xiong et al. 2020), when learning rate and warmup are both swept;
- grad_profile.png: each block's gradient norm at the last diagnostics step, one line per variant.

Trials that ran in two parts with the same parameters are listed with the difference of their final losses (a
determinism check: the same parameters must give the same numbers). `--unigram` adds the unigram baseline (the
loss of a model that knows only the training split's token frequencies) for each part's data and sequence length,
rebuilt from a trial's own train_config.yaml, to the tables and plots.

Every number comes from the trials' own files: run_summary.json (final val loss, step time, tokens/s) and
metrics.jsonl (the curves, the diagnostics). Diverged and failed trials are counted, not averaged.
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

from trainer.diagnostics import metric_matrix  # noqa: E402
from trainer.run_dir import CONFIG_FILE, METRICS_FILE, read_metrics, read_summary, report_error  # noqa: E402
from trainer.sweep_dir import SWEEP_STATE_FILE, read_results, read_state, swept_names, trial_dir_name  # noqa: E402

SEED_KEY = "seed"
LINE_KEY = "norm_type"  # the parameter drawn as separate lines when present
LR_KEY, WARMUP_KEY, PLACEMENT_KEY = "learning_rate", "warmup_steps", "norm_placement"
# The trainer arguments that decide the data a trial is scored on, hence its unigram baseline.
DATA_KEYS = ("data_path", "val_data_path", "val_fraction", "tokenizer_path", "max_seq_len")


@dataclass
class Trial:
    trial_id: str
    params: dict[str, Any]
    status: str                                  # finished | diverged | failed | not run (yet)
    summary: dict[str, Any] = field(default_factory=dict)
    val_curve: list[tuple[int, float]] = field(default_factory=list)
    grad_profile: list[float] = field(default_factory=list)  # grad_norm per block at the last diagnostics step
    run_dir: Path | None = None

    @property
    def final_val_loss(self) -> float | None:
        value = (self.summary.get("final_val") or {}).get("loss")
        return value if self.status == "finished" and isinstance(value, (int, float)) else None

    @property
    def grad_in_out(self) -> float | None:
        """Gradient norm of the first block over the last block's, at the last diagnostics step."""
        if len(self.grad_profile) < 2 or not self.grad_profile[-1]:
            return None
        return self.grad_profile[0] / self.grad_profile[-1]


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

    def grad_in_out(self) -> float:
        """Geometric mean over the finished seeds of the first/last block gradient-norm ratio."""
        ratios = [t.grad_in_out for t in self.finished() if t.grad_in_out]
        return math.exp(statistics.fmean(math.log(r) for r in ratios)) if ratios else math.nan

    def mean_grad_profile(self) -> list[float]:
        """Geometric mean per block over the finished seeds of the last diagnostics step's gradient norms."""
        profiles = [t.grad_profile for t in self.finished() if t.grad_profile and all(g > 0 for g in t.grad_profile)]
        if not profiles or len({len(p) for p in profiles}) > 1:
            return []
        return [math.exp(statistics.fmean(math.log(p[i]) for p in profiles)) for i in range(len(profiles[0]))]

    def mean_curve(self) -> list[tuple[int, float]]:
        """Mean val loss per step over the finished seeds, at the steps all of them logged."""
        curves = [dict(t.val_curve) for t in self.finished() if t.val_curve]
        if not curves:
            return []
        steps = sorted(set.intersection(*(set(c) for c in curves)))
        return [(s, statistics.fmean(c[s] for c in curves)) for s in steps]


@dataclass
class Part:
    """One sweep of the report: its folder, config, trials and variants, and the unigram baseline of its data."""
    sweep_dir: Path
    config: dict[str, Any]
    trials: list[Trial]
    variants: list[Variant] = field(default_factory=list)
    unigram: dict[str, Any] | None = None

    @property
    def name(self) -> str:
        return str(self.config.get("name") or self.sweep_dir.name)

    @property
    def baseline(self) -> float | None:
        return self.unigram["loss"] if self.unigram else None


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
        trial = Trial(entry["trial_id"], entry["params"], record["status"] if record else "not run", run_dir=trial_dir)
        trial.summary = read_summary(trial_dir)
        if (trial_dir / METRICS_FILE).exists():
            metrics = read_metrics(trial_dir / METRICS_FILE)
            trial.val_curve = [(r["step"], float(r["val_loss"])) for r in metrics if r.get("split") == "val"]
            _, grads = metric_matrix(metrics, "grad_norm")
            if grads.size and not any(math.isnan(g) for g in grads[:, -1]):
                trial.grad_profile = [float(g) for g in grads[:, -1]]
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


def duplicate_trials(parts: list[Part]) -> list[dict[str, Any]]:
    """Finished trials of different parts with identical parameters, with their final losses: deterministic
    training must give them the same numbers."""
    seen: dict[str, tuple[Part, Trial]] = {}
    pairs = []
    for part in parts:
        for trial in part.trials:
            if trial.final_val_loss is None:
                continue
            key = json.dumps(trial.params, sort_keys=True, default=str)
            if key in seen and seen[key][0] is not part:
                other_part, other = seen[key]
                pairs.append({"params": trial.params, "parts": [other_part.name, part.name],
                              "trial_ids": [other.trial_id, trial.trial_id],
                              "final_val_loss": [other.final_val_loss, trial.final_val_loss],
                              "abs_diff": abs(other.final_val_loss - trial.final_val_loss)})
            else:
                seen.setdefault(key, (part, trial))
    return pairs


def _run_args(run_dir: Path):
    """The trainer arguments a trial ran with, from its train_config.yaml."""
    import yaml

    from trainer.args import args_from_run_config

    config_path = run_dir / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path}: missing; --unigram rebuilds a trial's data from it")
    return args_from_run_config(yaml.safe_load(config_path.read_text()))


def unigram_baseline(run_dir: Path) -> dict[str, Any]:
    """The unigram baseline on the data a trial trained and was scored on, rebuilt from its train_config.yaml."""
    from torch.utils.data import DataLoader

    from dataset.tokenization import load_tokenizer
    from trainer.data import build_run_data
    from trainer.evaluation import token_byte_lengths, unigram_eval
    from trainer.run_dir import resolve_path

    args = _run_args(run_dir)
    tokenizer = load_tokenizer(resolve_path(args.tokenizer_path) if args.tokenizer_path else None)
    data = build_run_data(args, tokenizer, quiet=True)
    train = DataLoader(data.train, batch_size=256, collate_fn=data.collate)  # every row, in order
    result = unigram_eval(train, data.val_loader, len(tokenizer), token_byte_lengths(tokenizer))
    return {**result.as_dict(), "from_trial": run_dir.name, "max_seq_len": args.max_seq_len,
            "data": data.description}


def _data_key(run_dir: Path) -> str:
    """What decides a trial's unigram baseline: its data, tokenizer and sequence length (and, when the validation
    split is held out of the training file, the seed that draws it)."""
    args = _run_args(run_dir)
    key = {name: getattr(args, name) for name in DATA_KEYS}
    if args.data_path is not None and args.val_data_path is None:
        key["seed"] = args.seed
    return json.dumps(key, sort_keys=True, default=str)


# --------------------------------------------------------------------------- outputs
def _fmt(value: float | None, digits: int = 4) -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def _ratio(value: float) -> str:
    return "–" if math.isnan(value) else f"{value:.2g}"


def variant_rows(variants: list[Variant], part: str = "", baseline: float | None = None) -> list[dict[str, Any]]:
    rows = []
    for v in variants:
        mean, std = v.loss_stats()
        rows.append({"part": part, "params": v.params, "seeds": len(v.trials), "finished": len(v.finished()),
                     "diverged": v.count("diverged"), "failed": v.count("failed"),
                     "val_loss_mean": mean, "val_loss_std": std,
                     "vs_unigram": mean - baseline if baseline is not None else math.nan,
                     "val_loss_per_seed": {str(t.params.get(SEED_KEY)): t.final_val_loss for t in v.trials},
                     "grad_in_out": v.grad_in_out(),
                     "median_step_time_s": v.median_of("median_step_time_s"),
                     "tokens_per_s": v.median_of("tokens_per_s")})
    return rows


def markdown_table(config: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    keys = swept_keys(config)
    with_unigram = any(not math.isnan(row["vs_unigram"]) for row in rows)
    with_grads = any(not math.isnan(row["grad_in_out"]) for row in rows)
    header = (keys + ["final val loss (mean ± std)"] + (["vs unigram"] if with_unigram else [])
              + ["finished", "diverged"] + (["grad L0 / L_last"] if with_grads else [])
              + ["step time (ms)", "tokens/s"])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        loss = (f"{_fmt(row['val_loss_mean'])} ± {_fmt(row['val_loss_std'])}"
                if not math.isnan(row["val_loss_mean"]) else "–")
        failed = f" (+{row['failed']} failed)" if row["failed"] else ""
        cells = ([str(row["params"][k]) for k in keys] + [loss]
                 + ([f"{row['vs_unigram']:+.2f}" if not math.isnan(row["vs_unigram"]) else "–"] if with_unigram else [])
                 + [f"{row['finished']}/{row['seeds']}", f"{row['diverged']}{failed}"]
                 + ([_ratio(row["grad_in_out"])] if with_grads else [])
                 + [_fmt(row["median_step_time_s"] * 1000, 1), _fmt(row["tokens_per_s"], 0)])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _panels(variants: list[Variant]) -> tuple[list[str], dict[str, list[Variant]]]:
    """(line keys, panels): variants grouped into panels by everything but the line keys. The norm type is drawn
    as lines when it varies; otherwise, with the learning rate swept, one panel per learning rate."""
    keys = list(variants[0].params) if variants else []
    if LINE_KEY in keys:
        line_keys = [LINE_KEY]
    elif LR_KEY in keys and len(keys) > 1:
        line_keys = [k for k in keys if k != LR_KEY]
    else:
        line_keys = []
    panels: dict[str, list[Variant]] = {}
    for v in variants:
        rest = {k: val for k, val in v.params.items() if k not in line_keys}
        panels.setdefault(label(rest), []).append(v)
    return line_keys, panels


def _baseline_line(ax, baseline: float | None, horizontal: bool = True) -> None:
    if baseline is not None and horizontal:
        ax.axhline(baseline, color="grey", linestyle="--", linewidth=1, label=f"unigram ({baseline:.2f})")


def plot_curves(variants: list[Variant], path: Path, baseline: float | None = None) -> bool:
    import matplotlib.pyplot as plt
    line_keys, panels = _panels(variants)
    if not any(v.mean_curve() for v in variants):
        return False
    cols = min(3 if len(panels) > 4 else 2, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 4 * rows), squeeze=False, sharey=True)
    for ax, (title, members) in zip(axes.flat, panels.items()):
        for v in members:
            curve = v.mean_curve()
            name = label({k: v.params[k] for k in line_keys}) if line_keys else label(v.params)
            diverged = v.count("diverged")
            if curve:
                ax.plot(*zip(*curve), marker="o", markersize=3,
                        label=f"{name} (n={len(v.finished())}" + (f", {diverged} diverged)" if diverged else ")"))
            elif diverged:
                ax.plot([], [], " ", label=f"{name}: all {diverged} diverged")
        _baseline_line(ax, baseline)
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
    """Bars: per norm type, pre/post × without/with warmup; diverged seeds written on the bar. Only for sweeps
    that vary nothing else (with the learning rate swept too, lr_warmup.png draws the grid)."""
    import matplotlib.pyplot as plt
    needed = (PLACEMENT_KEY, WARMUP_KEY)
    if not variants or not all(k in variants[0].params for k in needed):
        return False
    if set(variants[0].params) - {*needed, LINE_KEY}:
        return False
    kinds = list(dict.fromkeys(v.params.get(LINE_KEY, "all") for v in variants))
    combos = list(dict.fromkeys((v.params[PLACEMENT_KEY], v.params[WARMUP_KEY]) for v in variants
                                if v.params[PLACEMENT_KEY] in ("pre", "post")))
    if len({c[0] for c in combos}) < 2:
        return False
    fig, ax = plt.subplots(figsize=(max(7, 1.8 * len(kinds) + 2), 4.5))
    width = 0.8 / len(combos)
    for i, (placement, warmup) in enumerate(combos):
        xs, ys, errs, notes = [], [], [], []
        for j, kind in enumerate(kinds):
            match = [v for v in variants if v.params.get(LINE_KEY, "all") == kind
                     and v.params[PLACEMENT_KEY] == placement and v.params[WARMUP_KEY] == warmup]
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


def plot_lr_warmup(variants: list[Variant], path: Path, baseline: float | None = None) -> bool:
    """Final val loss against the peak learning rate, one line per (placement, warmup) and one panel per norm
    type; points with diverged seeds are annotated. Xiong et al. 2020's claim in one picture: Post-LN without
    warmup falls behind as the learning rate grows, Pre-LN does not need the warmup."""
    import matplotlib.pyplot as plt
    if not variants or not {LR_KEY, WARMUP_KEY} <= set(variants[0].params):
        return False
    kinds = list(dict.fromkeys(v.params.get(LINE_KEY, "all") for v in variants))
    fig, axes = plt.subplots(1, len(kinds), figsize=(7 * len(kinds), 4.8), squeeze=False, sharey=True)
    for ax, kind in zip(axes.flat, kinds):
        lines: dict[str, list[Variant]] = {}
        for v in variants:
            if v.params.get(LINE_KEY, "all") == kind:
                rest = {k: val for k, val in v.params.items() if k not in (LR_KEY, LINE_KEY)}
                lines.setdefault(label(rest), []).append(v)
        for name, members in lines.items():
            members.sort(key=lambda v: v.params[LR_KEY])
            stats = [v.loss_stats() for v in members]
            xs = [v.params[LR_KEY] for v in members]
            ax.errorbar(xs, [m for m, _ in stats], yerr=[0.0 if math.isnan(s) else s for _, s in stats],
                        marker="o", capsize=3, linestyle="--" if "post" in name else "-", label=name)
            for x, v, (mean, _) in zip(xs, members, stats):
                if v.count("diverged"):
                    ax.annotate(f"{v.count('diverged')} div.", (x, mean if not math.isnan(mean) else baseline or 0),
                                fontsize=7, color="red")
        _baseline_line(ax, baseline)
        ax.set_xscale("log")
        ax.set_xlabel("peak learning rate")
        ax.set_ylabel("final val loss (mean ± std over seeds)")
        ax.set_title(f"learning rate x warmup ({LINE_KEY}={kind})" if kind != "all" else "learning rate x warmup")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_grad_profile(variants: list[Variant], path: Path) -> bool:
    """Each block's gradient norm at the last diagnostics step (geometric mean over seeds), log scale."""
    import matplotlib.pyplot as plt
    profiles = [(v, v.mean_grad_profile()) for v in variants]
    profiles = [(v, p) for v, p in profiles if p]
    if not profiles:
        return False
    fig, ax = plt.subplots(figsize=(8, 5))
    for v, profile in profiles:
        post = v.params.get(PLACEMENT_KEY) == "post"
        ax.plot(range(len(profile)), profile, marker="o", markersize=3, linestyle="--" if post else "-",
                label=label(v.params))
    ax.set_yscale("log")
    ax.set_xlabel("block (0 = next to the embedding)")
    ax.set_ylabel("gradient norm of the block's parameters")
    ax.set_title("gradient norm per block at the last diagnostics step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _part_markdown(part: Part, rows: list[dict[str, Any]], plots: dict[str, bool], heading: bool) -> list[str]:
    config, trials = part.config, part.trials
    fixed = {k: spec["value"] for k, spec in config["parameters"].items() if "value" in spec}
    counts = {s: sum(t.status == s for t in trials) for s in ("finished", "diverged", "failed", "not run")}
    seeds = sorted({t.params.get(SEED_KEY) for t in trials if SEED_KEY in t.params}, key=str)
    md = [f"## Part `{part.name}`", ""] if heading else []
    if heading and config.get("description"):
        md += [str(config["description"]), ""]
    md += [f"Method `{config['method']}`, metric `{(config.get('metric') or {}).get('name')}`; "
           f"{len(trials)} trials: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n) +
           (f"; seeds {seeds}" if seeds else "") + f"; folder `{part.sweep_dir}`.", "",
           markdown_table(config, rows), ""]
    for name, made in plots.items():
        if made:
            md += [f"![{name[:-4]}]({name})", ""]
    md += ["Fixed settings: " + ", ".join(f"`{k}={v}`" for k, v in fixed.items()), ""]
    return md


def write_report(sweep_dirs: str | Path | list[str | Path], out_dir: str | Path | None = None,
                 unigram: bool = False) -> Path:
    """Write report.md, report.json and the plots of one or more sweeps; returns the markdown path."""
    import matplotlib
    matplotlib.use("Agg")
    dirs = [Path(d) for d in (sweep_dirs if isinstance(sweep_dirs, (list, tuple)) else [sweep_dirs])]
    out = Path(out_dir) if out_dir else dirs[0] / "report"
    out.mkdir(parents=True, exist_ok=True)
    parts = [Part(d, *load_sweep(d)) for d in dirs]
    names = [p.name for p in parts]
    if len(set(names)) < len(names):
        raise ValueError(f"two sweep folders hold sweeps of the same name ({', '.join(names)}); report them apart")
    baselines: dict[str, dict[str, Any]] = {}
    for part in parts:
        part.variants = group_variants(part.config, part.trials)
        source = next((t for t in part.trials if t.final_val_loss is not None), None)
        if unigram and source is not None:
            data_key = _data_key(source.run_dir)
            if data_key not in baselines:
                baselines[data_key] = unigram_baseline(source.run_dir)
            part.unigram = baselines[data_key]
    several = len(parts) > 1
    md = [f"# Ablation report: {', '.join(f'`{n}`' for n in names)}", "",
          "Final val loss: the trainer's last evaluation over the whole validation split (run_summary.json), "
          "mean ± sample std (n-1) over the finished seeds; diverged (NaN/inf) and failed trials are counted "
          "and left out of the mean. grad L0 / L_last: the gradient norm of the first block's parameters over "
          "the last block's at the last diagnostics step (geometric mean over seeds; far below 1: the gradient "
          "vanishes toward the input). Step time and tokens/s: median over the variant's trials of each run's "
          "median step (the machine may be shared, so treat speed as indicative).", ""]
    for baseline in baselines.values():
        md += [f"Unigram baseline: **{baseline['loss']:.4f}** nats ({baseline['bits_per_byte']:.3f} bits/byte) on "
               f"{baseline['tokens']:,} validation targets at max_seq_len {baseline['max_seq_len']}: add-one-smoothed "
               f"token frequencies of the training split, scored like the trials (data: {baseline['data']}; "
               f"rebuilt from trial `{baseline['from_trial']}`). \"vs unigram\" is the final loss minus it.", ""]
    duplicates = duplicate_trials(parts)
    if duplicates:
        worst = max(d["abs_diff"] for d in duplicates)
        md += [f"{len(duplicates)} trials ran in two parts with identical parameters; their final val losses differ "
               f"by at most {worst:.2g} (the same parameters give the same numbers: "
               + ("**yes**" if worst == 0 else "**no**") + "). Each part's table counts its own copy.", ""]
    rows_all, plots_all, counts = [], [], {"finished": 0, "diverged": 0, "failed": 0, "not run": 0}
    for part in parts:
        rows = variant_rows(part.variants, part.name, part.baseline)
        prefix = f"{part.name}_" if several else ""
        plots = {f"{prefix}val_curves.png": plot_curves(part.variants, out / f"{prefix}val_curves.png", part.baseline),
                 f"{prefix}prms_p.png": plot_prms_p(part.variants, out / f"{prefix}prms_p.png"),
                 f"{prefix}pre_post_warmup.png": plot_pre_post(part.variants, out / f"{prefix}pre_post_warmup.png"),
                 f"{prefix}lr_warmup.png": plot_lr_warmup(part.variants, out / f"{prefix}lr_warmup.png",
                                                          part.baseline),
                 f"{prefix}grad_profile.png": plot_grad_profile(part.variants, out / f"{prefix}grad_profile.png")}
        md += _part_markdown(part, rows, plots, heading=several)
        rows_all += rows
        plots_all += [name for name, made in plots.items() if made]
        for status in counts:
            counts[status] += sum(t.status == status for t in part.trials)
    (out / "report.md").write_text("\n".join(md))
    payload = {"sweeps": names, "counts": counts, "variants": rows_all, "plots": plots_all,
               "unigram": {p.name: p.unigram for p in parts if p.unigram}, "duplicates": duplicates,
               "trials": [{"part": p.name, "trial_id": t.trial_id, "status": t.status, "params": t.params,
                           "final_val_loss": t.final_val_loss, "grad_in_out": t.grad_in_out,
                           "median_step_time_s": t.summary.get("median_step_time_s"),
                           "tokens_per_s": t.summary.get("tokens_per_s")} for p in parts for t in p.trials]}
    (out / "report.json").write_text(json.dumps(payload, indent=1, default=str, allow_nan=True))
    return out / "report.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Markdown + PNG report of sweeps run by scripts/sweep.py")
    parser.add_argument("sweep_dirs", nargs="+", metavar="sweep_dir",
                        help="e.g. out/sweeps/study_norms; several: one section per sweep")
    parser.add_argument("--out", help="output folder (default: the first SWEEP_DIR's report/)")
    parser.add_argument("--unigram", action="store_true",
                        help="add the unigram baseline of each sweep's data (rebuilt from a trial's train_config.yaml)")
    args = parser.parse_args(argv)
    try:
        path = write_report(args.sweep_dirs, args.out, args.unigram)
    except (FileNotFoundError, ValueError) as error:
        return report_error(error)
    print(f"report written to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
