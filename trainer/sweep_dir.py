"""The sweep directory: what scripts/sweep.py writes and the ablation report reads.

    out/sweeps/<name>/
      sweep_state.json        the sweep's config and its proposed trials (written atomically)
      results.jsonl           one line per finished attempt of a trial (appended whole)
      trials/<trial_id>/      each trial's run directory (trainer/run_dir.py) and its train.log
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dataset.atomic_io import atomic_write_text
from trainer.run_dir import append_jsonl, read_jsonl, resolve_path

SWEEP_STATE_FILE = "sweep_state.json"
RESULTS_FILE = "results.jsonl"
TRIALS_DIR = "trials"
TRIAL_LOG = "train.log"
DONE_STATUSES = ("finished", "diverged")


def default_sweep_dir(name: str) -> Path:
    return resolve_path(f"out/sweeps/{name}")


def trial_dir_name(trial_id: str) -> str:
    """A trial's folder, relative to the sweep directory (as results.jsonl records it)."""
    return f"{TRIALS_DIR}/{trial_id}"


def swept_names(config: dict[str, Any]) -> list[str]:
    """The parameters of a sweep config that vary between trials (not fixed `value:` entries)."""
    return [name for name, spec in config["parameters"].items() if "value" not in spec]


def read_results(sweep_dir: Path) -> list[dict[str, Any]]:
    """results.jsonl records in order; a torn last line (a kill mid-write) is ignored."""
    path = sweep_dir / RESULTS_FILE
    return read_jsonl(path) if path.exists() else []


def append_result(sweep_dir: Path, record: dict[str, Any]) -> None:
    append_jsonl(sweep_dir / RESULTS_FILE, record)


def read_state(sweep_dir: Path) -> dict[str, Any] | None:
    """sweep_state.json ({"name", "config", "trials"}); None when there is none. A ValueError names a file that
    is not a sweep state."""
    path = sweep_dir / SWEEP_STATE_FILE
    try:
        state = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(state, dict) or not isinstance(state.get("trials"), list):
        raise ValueError(f"{path}: not a sweep state (expected name, config and trials)")
    return state


def write_state(sweep_dir: Path, state: dict[str, Any]) -> None:
    atomic_write_text(sweep_dir / SWEEP_STATE_FILE, json.dumps(state, indent=1, default=str))
