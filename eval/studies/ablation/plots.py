"""The report's PNG plots, one function each; a function returns False (and draws nothing) when its sweep does
not vary what the plot compares."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from eval.studies.ablation.load import Variant
from trainer.figures import save_figure

LINE_KEY = "norm_type"  # the parameter drawn as separate lines when present
LR_KEY, WARMUP_KEY, PLACEMENT_KEY = "learning_rate", "warmup_steps", "norm_placement"


def label(params: dict[str, Any]) -> str:
    """A legend entry; a trainer --config file is named by its stem, as the report names a variant."""
    return ", ".join(f"{k}={_short(v)}" for k, v in params.items()) or "all trials"


def _short(value: Any) -> Any:
    return Path(value).stem if isinstance(value, str) and value.endswith((".yaml", ".yml")) else value


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
    save_figure(fig, path)
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
    save_figure(fig, path)
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
    save_figure(fig, path)
    return True


def plot_lr_warmup(variants: list[Variant], path: Path, baseline: float | None = None) -> bool:
    """Final val loss against the peak learning rate, one line per (placement, warmup) and one panel per norm
    type; points with diverged seeds are annotated. Xiong et al. 2020's claim in one picture: Post-LN without
    warmup falls behind as the learning rate grows, Pre-LN does not need the warmup."""
    import matplotlib.pyplot as plt
    if not variants or not {LR_KEY, WARMUP_KEY} <= set(variants[0].params):
        return False
    kinds = list(dict.fromkeys(v.params.get(LINE_KEY, "all") for v in variants))
    fig, axes = plt.subplots(1, len(kinds), figsize=(7 * len(kinds), 6.6), squeeze=False, sharey=True)
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
        # Below the axes: with a line per warmup x init, a legend inside hides the points.
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12))
    save_figure(fig, path)
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
    save_figure(fig, path)
    return True
