"""The second edition's PNG plots: loss against the learning rate (every variant in one plot), val loss against
steps and against wall-clock seconds, and the residual RMS per layer."""

from __future__ import annotations

import math
from pathlib import Path

from trainer.figures import save_figure


def _color(index: int):
    """Twelve and more variants: tab20's ten dark hues first, then their light partners."""
    import matplotlib.pyplot as plt
    return plt.get_cmap("tab20")((2 * index) % 20 + (index // 10) % 2)


def _line_style(name: str) -> str:
    return "--" if any(k in name for k in ("post", "deepnorm", "mix")) else "-"


def plot_loss_vs_rate(points: dict[str, dict[float, float]], diverged: dict[str, list[float]], path: Path,
                      baseline: float | None = None) -> bool:
    """Final val loss (mean over seeds) against the peak rate, a line per variant; rates where every seed diverged
    or failed are marked with an x on the top edge."""
    import matplotlib.pyplot as plt
    if not points:
        return False
    fig, ax = plt.subplots(figsize=(9, 5.5))
    finite = [v for rates in points.values() for v in rates.values() if math.isfinite(v)]
    top = max(finite + ([baseline] if baseline else [])) + 0.2 if finite else 10.0
    for index, (name, rates) in enumerate(points.items()):
        xs = sorted(rates)
        line, = ax.plot(xs, [rates[x] for x in xs], marker="o", markersize=4, linestyle=_line_style(name), label=name,
                        color=_color(index))
        if diverged.get(name):
            ax.plot(diverged[name], [top] * len(diverged[name]), "x", color=line.get_color())
    if baseline is not None:
        ax.axhline(baseline, color="grey", linestyle=":", linewidth=1, label=f"unigram ({baseline:.2f})")
    ax.set_xscale("log")
    ax.set_xlabel("peak learning rate")
    ax.set_ylabel("final val loss (mean over seeds; x: all seeds diverged)")
    ax.set_title("loss against learning rate, per variant")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    save_figure(fig, path)
    return True


def plot_curves_steps_and_time(by_steps: dict[str, list[tuple[int, float]]],
                               by_seconds: dict[str, list[tuple[float, float]]], path: Path,
                               baseline: float | None = None) -> bool:
    """Two panels: val loss against optimizer steps and against wall-clock seconds, a line per variant."""
    import matplotlib.pyplot as plt
    if not by_steps:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(14, 5), sharey=True)
    for ax, curves, xlabel in ((axes[0], by_steps, "optimizer step"), (axes[1], by_seconds, "wall-clock seconds")):
        for index, (name, curve) in enumerate(curves.items()):
            if curve:
                ax.plot([x for x, _ in curve], [y for _, y in curve], linestyle=_line_style(name), label=name,
                        color=_color(index))
        if baseline is not None:
            ax.axhline(baseline, color="grey", linestyle=":", linewidth=1, label="unigram")
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("val loss (each variant at its best rate, seed 0)")
    axes[0].set_title("val loss against steps")
    axes[1].set_title("val loss against wall-clock time")
    axes[1].legend(fontsize=7, ncol=2)
    save_figure(fig, path)
    return True


def plot_resid_rms(profiles: dict[str, list[float]], path: Path) -> bool:
    """Residual-stream RMS leaving each block at the last diagnostic step, log scale, a line per variant."""
    import matplotlib.pyplot as plt
    profiles = {k: v for k, v in profiles.items() if v}
    if not profiles:
        return False
    fig, ax = plt.subplots(figsize=(8, 5))
    for index, (name, profile) in enumerate(profiles.items()):
        ax.plot(range(len(profile)), profile, marker="o", markersize=3, linestyle=_line_style(name), label=name,
                color=_color(index))
    ax.set_yscale("log")
    ax.set_xlabel("block (0 = next to the embedding)")
    ax.set_ylabel("residual RMS at the last diagnostic step")
    ax.set_title("residual stream RMS per layer (each variant at its best rate, seed 0)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    save_figure(fig, path)
    return True
