"""Heatmaps (layer x step) of the normalization diagnostics a training run logged.

    python eval/studies/diagnostics.py out/pretrain                  # a run directory (finds its metrics jsonl)
    python eval/studies/diagnostics.py out/pretrain/metrics.jsonl --out out/pretrain_heatmaps

Writes one PNG per per-layer quantity (`resid_rms.png`, `attn_norm_in_rms.png`, `grad_norm.png`,
`update_ratio.png`, ...) plus `global.png` (global gradient norm and update ratio over steps). Colours are on a
log scale: these quantities span orders of magnitude across layers and training.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `import trainer...` work from any directory
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trainer.cli import quiet_ctrl_c_while_loading  # noqa: E402

quiet_ctrl_c_while_loading(__name__)  # a Ctrl-C while the imports below load: one line, exit 130

from collections.abc import Sequence  # noqa: E402

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.colors import LogNorm, Normalize  # noqa: E402

from trainer.cli import ToolParser, output_folder, run_main  # noqa: E402
from trainer.diagnostics import PREFIX, layer_quantities, metric_matrix, metric_series, recorded_layers  # noqa: E402
from trainer.figures import save_figure  # noqa: E402
from trainer.run_dir import METRICS_FILE, note_on_stderr, read_metrics, report_error, resolve_input_path  # noqa: E402

# What each quantity means, for the plot titles.
TITLES = {
    "resid_rms": "RMS of the residual stream leaving each block",
    "resid_grad_rms": "RMS of dLoss/d(residual stream) leaving each block",
    "grad_norm": "gradient norm of each block's parameters (pre-clip)",
    "grad_norm_attn": "gradient norm of each block's attention parameters",
    "grad_norm_mlp": "gradient norm of each block's MLP parameters",
    "update_ratio": "update-to-weight ratio ||dW|| / ||W|| per block",
}


def find_metrics_file(path: str | Path) -> Path:
    """The metrics jsonl itself, or the one inside a run directory that holds diagnostics."""
    path = Path(path)
    if path.is_file():
        return path
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is neither a metrics jsonl file nor a run directory")
    own = [path / METRICS_FILE] if (path / METRICS_FILE).is_file() else []
    candidates = (own + sorted(path.glob("metrics*.jsonl")) + sorted(path.glob("*.jsonl"))
                  + sorted(path.rglob("*.jsonl")))
    for candidate in dict.fromkeys(candidates):  # de-duplicated, first listed first
        if layer_quantities(read_metrics(candidate)):
            return candidate
    raise FileNotFoundError(f"no jsonl file with '{PREFIX}/...' per-layer keys under {path}; "
                            "was the run trained with --diag_interval > 0?")


def _edges(centres: np.ndarray, lowest: float | None = None) -> np.ndarray:
    """Cell edges around (possibly unevenly spaced) centres, for pcolormesh; none below `lowest`."""
    centres = centres.astype(float)
    if len(centres) == 1:
        return np.array([centres[0] - 0.5, centres[0] + 0.5])
    mids = (centres[1:] + centres[:-1]) / 2
    first = 2 * centres[0] - mids[0]
    if lowest is not None:
        first = max(first, min(lowest, centres[0]))
    return np.concatenate([[first], mids, [2 * centres[-1] - mids[-1]]])


def _title(quantity: str) -> str:
    if quantity in TITLES:
        return TITLES[quantity]
    if quantity.endswith("_in_rms"):
        return f"RMS of the input of {quantity[:-len('_in_rms')]}"
    if quantity.endswith("_out_rms"):
        return f"RMS of the output of {quantity[:-len('_out_rms')]}"
    return quantity


def plot_heatmap(steps: np.ndarray, matrix: np.ndarray, quantity: str, out_path: Path, run_label: str = "") -> None:
    finite = matrix[np.isfinite(matrix)]
    positive = finite.size > 0 and bool((finite > 0).all())
    norm = LogNorm(finite.min(), finite.max()) if positive and finite.min() < finite.max() else Normalize()
    fig, ax = plt.subplots(figsize=(8, 0.35 * matrix.shape[0] + 2.2))
    # a step's cell starts no earlier than step 0 (the steps 1 and 21 drew one from step -9)
    mesh = ax.pcolormesh(_edges(steps, lowest=0), _edges(np.arange(matrix.shape[0])), np.ma.masked_invalid(matrix),
                         norm=norm, cmap="viridis", shading="flat")
    fig.colorbar(mesh, ax=ax, label=quantity + (" (log scale)" if isinstance(norm, LogNorm) else ""))
    ax.set_xlabel("step")
    ax.set_ylabel("layer")
    ax.set_yticks(np.arange(matrix.shape[0]))
    ax.set_title(_title(quantity) + (f"\n{run_label}" if run_label else ""), fontsize=10)
    save_figure(fig, out_path)


def plot_globals(records: list[dict], out_path: Path, run_label: str = "") -> bool:
    series = [(key, *metric_series(records, f"{PREFIX}/{key}")) for key in ("grad_norm_global", "update_ratio_global")]
    series = [s for s in series if len(s[1])]
    if not series:
        return False
    fig, axes = plt.subplots(1, len(series), figsize=(5 * len(series), 3.5), squeeze=False)
    for ax, (key, steps, values) in zip(axes[0], series):
        ax.plot(steps, values, marker=".")
        if (values > 0).all():
            ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_title(key + (f" — {run_label}" if run_label else ""), fontsize=10)
        ax.grid(alpha=0.3)
    save_figure(fig, out_path)
    return True


def plot_run(source: str | Path, out_dir: str | Path) -> list[Path]:
    """Draw every per-layer heatmap and the global plot of one run; returns the PNG paths written."""
    metrics = find_metrics_file(source)
    records = read_metrics(metrics, note_skipped=note_on_stderr)  # a torn line in the middle: said, not skipped
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    label = metrics.parent.name if metrics.name.startswith("metrics") else metrics.stem
    written = []
    layers = recorded_layers(metrics)  # the run's model's blocks bound the layer indices, where it recorded them
    for quantity in layer_quantities(records):
        steps, matrix = metric_matrix(records, quantity, layers)
        if matrix.size == 0:
            continue
        path = out_dir / f"{quantity}.png"
        plot_heatmap(steps, matrix, quantity, path, label)
        written.append(path)
    if plot_globals(records, out_dir / "global.png", label):
        written.append(out_dir / "global.png")
    return written


def main(argv: Sequence[str] | None = None) -> list[Path]:
    parser = ToolParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="a run directory or its metrics jsonl file")
    parser.add_argument("--out", type=output_folder, default=None,
                        help="output folder (default: <run dir>/diagnostics)")
    args = parser.parse_args(argv)
    source = resolve_input_path(args.source)  # from here, else from the repo root, as the trainer wrote it
    out = Path(args.out) if args.out else find_metrics_file(source).parent / "diagnostics"
    written = plot_run(source, out)
    for path in written:
        print(path)
    return written


def command_line() -> int:
    """The command: main()'s paths are for in-process callers, which get its FileNotFoundError and ValueError too;
    here a missing run or metrics file, or a value in it that is not a number, is one line."""
    try:
        main()
    except (FileNotFoundError, ValueError) as error:
        return report_error(error)
    return 0


if __name__ == "__main__":
    run_main(command_line)
