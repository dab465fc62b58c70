"""What the runner records: the sweep's state read back (and refused when the folder holds another sweep), its
writes to the sweep and records folders (a full disk is one line), done trials brought back from a records folder,
and a finished trial's metric. The files themselves are trainer/sweep_dir.py's."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dataset.shown_value import shown_value
from scripts.sweep_runner.command import trainer_of
from scripts.sweep_runner.errors import SweepConfigError, SweepWriteError
from trainer.run_dir import FINAL_METRIC_PLACES, final_metric
from trainer.sweep_dir import read_state, restore_records

def metric_value(summary: dict[str, Any], metric: str | None) -> float | None:
    """The sweep metric of a finished trial, from its run_summary.json: a metric a trainer logs (trainer/run_dir.py,
    FINAL_METRIC_PLACES); for another program, a number of that name in its summary or in the summary's final_val."""
    if not metric or not summary:
        return None
    if metric in FINAL_METRIC_PLACES:
        return final_metric(summary, metric)
    value = summary.get(metric, (summary.get("final_val") or {}).get(metric))
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def load_state(sweep_dir: Path, name: str, config: dict[str, Any], flag: str = "--sweep_dir") -> dict[str, Any]:
    state = read_state(sweep_dir)
    if state is None:
        return {"name": name, "config": config, "trials": []}
    if state.get("config") != config:
        raise SweepConfigError(f"{sweep_dir}: holds sweep {shown_value(state.get('name'))} with a different config; "
                               f"use another {flag} (or delete it to start over)")
    return state


def cannot_write(error: OSError, path: Path) -> str:
    return f"{error.filename or path}: cannot be written ({error.strerror or error})"


@contextmanager
def writing(folder: Path, trial: str = "") -> Iterator[None]:
    """The runner's writes to the sweep (or records) folder, for `trial` (its label, "[2] seed-2_eca4f571", when the
    write is one trial's): a full disk, or a folder turned read-only, ends the sweep in one line naming the trial and
    the file (a SweepWriteError), not an OSError traceback; what was written before stays whole."""
    try:
        yield
    except OSError as error:
        raise SweepWriteError(f"{f'trial {trial}: ' if trial else ''}{cannot_write(error, folder)}; the done trials "
                              f"are kept: run the same command again once it can be") from None


def bring_back_records(sweep_dir: Path, records_dir: Path, name: str, config: dict[str, Any]) -> None:
    """Bring the done trials of the records folder back into the sweep folder (trainer/sweep_dir.py)."""
    # another sweep in either folder: refused before anything is copied, not mixed
    load_state(sweep_dir, name, config)
    load_state(records_dir, name, config, "--records_dir")
    restored = restore_records(records_dir, sweep_dir, by_trainer=trainer_of(config) is not None)
    print(f"{len(restored)} done trials brought back from {records_dir}", flush=True)
