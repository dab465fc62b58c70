"""Saving a matplotlib figure the one way every plot of the studies does: tight layout, PNG at FIGURE_DPI, then
the figure closed (a report draws dozens; open figures would pile up in pyplot's registry).

matplotlib is imported only when a figure is saved: the library imports without it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

FIGURE_DPI = 110


def save_figure(fig: Any, path: str | Path) -> None:
    """Lay out, write and close `fig` (a matplotlib Figure)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=FIGURE_DPI)
    plt.close(fig)
