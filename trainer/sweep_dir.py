"""The sweep directory: what scripts/sweep.py writes and the ablation report reads.

    out/sweeps/<name>/
      sweep_state.json        the sweep's config and its proposed trials (written atomically)
      results.jsonl           one line per finished attempt of a trial (appended whole)
      trials/<trial_id>/      each trial's run directory (trainer/run_dir.py) and its train.log

A records folder (`scripts/sweep.py --records_dir`) is the part of a sweep directory worth committing: the state,
the results and each done trial's run_summary.json, train_config.yaml and metrics.jsonl (gzipped, as
metrics.jsonl.gz), without checkpoints, models or logs. It outlives the machine: a sweep started elsewhere with the
same records folder brings its done trials back into the sweep directory (`restore_records`) and runs only the
rest, and every trial that ends is saved into it (`save_records`).
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from dataset.atomic_io import atomic_path, atomic_write_text
from trainer.run_dir import CONFIG_FILE, METRICS_FILE, SUMMARY_FILE, append_jsonl, read_jsonl, resolve_path

SWEEP_STATE_FILE = "sweep_state.json"
RESULTS_FILE = "results.jsonl"
TRIALS_DIR = "trials"
TRIAL_LOG = "train.log"
DONE_STATUSES = ("finished", "diverged")
RECORD_FILES = (SUMMARY_FILE, CONFIG_FILE)  # a done trial's files kept as they are in a records folder
RECORD_METRICS = METRICS_FILE + ".gz"       # ... and its metrics, gzipped (a quarter of the size in the study)


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


def _write_bytes(path: Path, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def done_records(sweep_dir: Path) -> dict[str, dict[str, Any]]:
    """The last finished-or-diverged results.jsonl record of each done trial, by trial id."""
    return {r["trial_id"]: r for r in read_results(sweep_dir) if r.get("status") in DONE_STATUSES}


def save_records(sweep_dir: Path, records_dir: Path, trial_ids: Iterable[str] | None = None) -> None:
    """Copy the sweep's state and results, and the record files of its done trials (those of ``trial_ids``, or
    all), into ``records_dir``; each file is written atomically, so a kill leaves every file whole."""
    state = read_state(sweep_dir)
    if state is None:
        return
    done = done_records(sweep_dir)
    for tid in done if trial_ids is None else [t for t in trial_ids if t in done]:
        source, target = sweep_dir / trial_dir_name(tid), records_dir / trial_dir_name(tid)
        for name in RECORD_FILES:
            if (source / name).is_file():
                _write_bytes(target / name, (source / name).read_bytes())
        if (source / METRICS_FILE).is_file():  # mtime 0: the same metrics give the same bytes (no churn in git)
            _write_bytes(target / RECORD_METRICS, gzip.compress((source / METRICS_FILE).read_bytes(), mtime=0))
    if (sweep_dir / RESULTS_FILE).is_file():
        _write_bytes(records_dir / RESULTS_FILE, (sweep_dir / RESULTS_FILE).read_bytes())
    write_state(records_dir, state)


def restore_records(records_dir: Path, sweep_dir: Path) -> list[str]:
    """Bring the done trials of ``records_dir`` that ``sweep_dir`` has not done back into it (their record
    files, their results line, their place in the state); returns their ids. The caller checks first that both
    folders hold the sweep it runs (scripts/sweep.py's state check, naming the flag)."""
    records_state = read_state(records_dir)
    if records_state is None:
        return []
    state = read_state(sweep_dir)
    have = done_records(sweep_dir)
    missing = {tid: r for tid, r in done_records(records_dir).items() if tid not in have}
    for tid, record in missing.items():
        source, target = records_dir / trial_dir_name(tid), sweep_dir / trial_dir_name(tid)
        for name in RECORD_FILES:
            if (source / name).is_file():
                _write_bytes(target / name, (source / name).read_bytes())
        if (source / RECORD_METRICS).is_file():
            _write_bytes(target / METRICS_FILE, gzip.decompress((source / RECORD_METRICS).read_bytes()))
        append_result(sweep_dir, record)
    if state is None:
        state = records_state
    else:
        known = {t["trial_id"] for t in state["trials"]}
        state["trials"] += [t for t in records_state["trials"] if t["trial_id"] not in known]
    for trial in state["trials"]:
        if (record := missing.get(trial["trial_id"])) is not None:
            trial["status"], trial["metric"] = record["status"], record.get("metric")
    write_state(sweep_dir, state)
    return list(missing)
