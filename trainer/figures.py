"""Saving a matplotlib figure the one way every plot of the studies does: tight layout, PNG at FIGURE_DPI, then
the figure closed (a report draws dozens; open figures would pile up in pyplot's registry).

matplotlib is imported only when a figure is saved: the library imports without it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dataset.atomic_io import atomic_path

FIGURE_DPI = 110


def save_figure(fig: Any, path: str | Path) -> None:
    """Lay out, write (atomically) and close `fig` (a matplotlib Figure)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    with atomic_path(path) as staged:  # the temp file's name has no image suffix: name the format
        fig.savefig(staged, dpi=FIGURE_DPI, format=Path(path).suffix.lstrip(".") or "png")
    plt.close(fig)
