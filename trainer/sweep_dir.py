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
import os
import re
import zlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dataset.atomic_io import NAME_MAX, atomic_path, atomic_write_text, check_not_a_folder, read_text_file
from dataset.json_text import strict_json
from dataset.shown_value import shown_value
from trainer.run_dir import (CONFIG_FILE, METRICS_FILE, SUMMARY_FILE, NoteSink, append_jsonl, jsonl_lines,
                             read_summary, recorded_config, resolve_path, skipped_lines_note)

SWEEP_STATE_FILE = "sweep_state.json"
RESULTS_FILE = "results.jsonl"
TRIALS_DIR = "trials"
TRIAL_LOG = "train.log"
# Set ("1") in each trial's environment by scripts/sweep.py's runner (`wandb agent` sets WANDB_SWEEP_ID): a trainer
# then takes its command line as a sweep's, whose unused flags it notes instead of refusing (trainer/args.py).
SWEEP_TRIAL_VARIABLE = "MININORM_SWEEP_TRIAL"
DONE_STATUSES = ("finished", "diverged")
# The run_summary.json numbers each results.jsonl record repeats: they outlive the trial's folder (the report reads
# them there when the folder is gone).
RESULT_SUMMARY_KEYS = ("final_val", "steps", "median_step_time_s", "tokens_per_s")
RESULT_STATUSES = ("failed", *DONE_STATUSES)  # a results.jsonl record's status: how an attempt ended
TRIAL_STATUSES = ("pending", "running", *RESULT_STATUSES)  # a trial's status in the state file
LOCK_FILE = ".sweep.lock"  # held by the one runner of a sweep folder
# A trial id names its folder: one plain path component (scripts/sweep_runner/command.py's trial_id makes them
# so), never a path that leads out of the sweep folder.
_FOLDER_NAME = re.compile(r"[A-Za-z0-9_=-][A-Za-z0-9._=-]*")
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


def is_folder_name(name: Any) -> bool:
    """Whether ``name`` is one plain path component (a sweep's or a trial's folder), not a path, that the system
    takes (at most NAME_MAX characters: the pattern's are one byte each)."""
    return isinstance(name, str) and len(name) <= NAME_MAX and _FOLDER_NAME.fullmatch(name) is not None


def _read_text(path: Path) -> str | None:
    """A sweep file's text; None when it does not exist. A ValueError names a file that cannot be read."""
    if not path.exists() and not path.is_symlink():
        return None
    return read_text_file(path)


def read_results(sweep_dir: Path, note_skipped: NoteSink | None = None) -> list[dict[str, Any]]:
    """results.jsonl records in order; a torn last line (a kill mid-write) is ignored, and so is a line that is no
    trial's result (its trial_id not a folder name, its status missing or not one of RESULT_STATUSES) or no record
    at all: `note_skipped` (a tool's) is given one line counting those before the last (run_dir's jsonl_lines and
    skipped_lines_note). [] when there is no file yet. A ValueError names a file that cannot be read."""
    path = sweep_dir / RESULTS_FILE
    if not path.exists() and not path.is_symlink():  # no results yet (a dangling link is refused by the read)
        return []
    # one read, by the shared torn-line-tolerant reader (the runner calls this after every trial); its ValueError
    # names a file that cannot be read (a directory, not UTF-8)
    records, skipped = jsonl_lines(path, keep=lambda record: is_folder_name(record.get("trial_id"))
                                   and record.get("status") in RESULT_STATUSES)
    if skipped and note_skipped is not None:
        note_skipped(skipped_lines_note(path, skipped, "torn, damaged or no trial's result"))
    return records


def append_result(sweep_dir: Path, record: dict[str, Any]) -> None:
    append_jsonl(sweep_dir / RESULTS_FILE, record)


def read_state(sweep_dir: Path) -> dict[str, Any] | None:
    """sweep_state.json ({"name", "config", "trials"}); None when there is none. A ValueError names a file that
    is not a sweep state."""
    path = sweep_dir / SWEEP_STATE_FILE
    text = _read_text(path)
    if text is None:
        return None
    try:
        state = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(state, dict) or not isinstance(state.get("trials"), list):
        raise ValueError(f"{path}: not a sweep state (expected name, config and trials)")
    # The config is the sweep's YAML as the runner checked it: the report reads its parameters (an edited config
    # that is not a mapping, or parameters that are not, was an AttributeError traceback there).
    config = state.get("config")
    if not isinstance(config, dict):
        raise ValueError(f"{path}: config: expected the sweep's YAML config (a mapping), got {shown_value(config)}")
    parameters = config.get("parameters", {})
    if not isinstance(parameters, dict) or not all(isinstance(spec, dict) for spec in parameters.values()):
        raise ValueError(f"{path}: config.parameters: expected a mapping of parameter name to spec, got "
                         f"{shown_value(parameters)}")
    # Each trial is checked here, once, so the runner and the report never meet a trial they cannot use (nor
    # one whose id would put its folder outside the sweep folder).
    for index, trial in enumerate(state["trials"]):
        where = f"{path}: trials[{index}]"
        if not isinstance(trial, dict):
            raise ValueError(f"{where}: expected a mapping (trial_id, params, status, metric)")
        if not is_folder_name(trial.get("trial_id")):
            raise ValueError(f"{where}.trial_id: expected a folder name, got {shown_value(trial.get('trial_id'))}")
        if not isinstance(trial.get("params"), dict):
            raise ValueError(f"{where}.params: expected a mapping of parameter name to value")
        if trial.get("status") not in TRIAL_STATUSES:
            raise ValueError(f"{where}.status: expected one of {', '.join(TRIAL_STATUSES)}, "
                             f"got {shown_value(trial.get('status'))}")
    return state


@contextmanager
def sweep_dir_lock(sweep_dir: Path) -> Iterator[None]:
    """Hold the sweep folder for one runner: a second one on it would run the same trials in the same folders and
    record them twice. A ValueError names the folder when another runner holds it. The lock goes with the
    process, so a killed runner leaves none behind."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): unguarded, as before
        yield
        return
    fd = os.open(sweep_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            raise ValueError(f"{sweep_dir}: another sweep runner is using it" + (f" (pid {holder})" if holder else "")
                             + "; wait for it to end, or use another --sweep_dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)


def write_state(sweep_dir: Path, state: dict[str, Any]) -> None:
    atomic_write_text(sweep_dir / SWEEP_STATE_FILE, strict_json(state, indent=1, default=str))


def _write_bytes(path: Path, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def done_records(sweep_dir: Path, note_skipped: NoteSink | None = None) -> dict[str, dict[str, Any]]:
    """The last finished-or-diverged results.jsonl record of each done trial, by trial id; `note_skipped`:
    read_results'."""
    return {r["trial_id"]: r for r in read_results(sweep_dir, note_skipped) if r.get("status") in DONE_STATUSES}


def save_records(sweep_dir: Path, records_dir: Path, trial_ids: Iterable[str] | None = None) -> None:
    """Copy the sweep's state and results, and the record files of its done trials (those of ``trial_ids``, or
    all), into ``records_dir``; each file is written atomically, so a kill leaves every file whole. A ValueError
    names a ``sweep_dir`` that holds no sweep state: a records folder is a sweep's, and saving none of one would
    look like success (the runner saves only once its state is written)."""
    state = read_state(sweep_dir)
    if state is None:
        raise ValueError(f"{sweep_dir}: no sweep there ({SWEEP_STATE_FILE} is missing); nothing to save into "
                         f"{records_dir}")
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


def _gunzip(path: Path) -> bytes:
    """A record's gzipped metrics, unpacked; a ValueError names a file that is not gzip (a git-LFS pointer left by a
    clone without LFS, say) or is cut short."""
    try:
        return gzip.decompress(path.read_bytes())
    except (OSError, EOFError, zlib.error) as error:
        raise ValueError(f"{path}: not a readable gzip file ({error})") from None


def _damaged_record(source: Path, status: str, by_trainer: bool) -> str | None:
    """Why the record files in `source` of a trial done with `status` are no done trial's (None: they are). A
    finished trial's run_summary.json said so when it was recorded (the runner reads the outcome there); a trainer's
    trial also had its train_config.yaml and, finished, its metrics (its final evaluation logs a record)."""
    needed = ([SUMMARY_FILE] if status == "finished" or by_trainer else []) + ([CONFIG_FILE] if by_trainer else [])
    needed += [RECORD_METRICS] if by_trainer and status == "finished" else []
    for name in needed:
        if not (source / name).is_file():
            return f"{source / name} is missing" if not (source / name).exists() else f"{source / name} is no file"
    if SUMMARY_FILE in needed:
        recorded = read_summary(source).get("status")
        if recorded != status and (status == "finished" or recorded not in DONE_STATUSES):
            why = "cannot be read as a run summary" if not read_summary(source) else f"says {shown_value(recorded)}"
            return f"{source / SUMMARY_FILE} {why}, where results.jsonl says {status}"
    if CONFIG_FILE in needed:
        try:  # a run's record, as every reader of it reads it: not YAML or not a mapping is damaged too
            recorded_config(source)
        except ValueError as error:
            return str(error)
    return None


def restorable_records(records_dir: Path, sweep_dir: Path,
                       by_trainer: bool = False) -> dict[str, tuple[dict[str, Any], bytes | None]]:
    """The done trials of ``records_dir`` that ``sweep_dir`` has not done, by trial id: each one's results record
    and its unpacked metrics (None where it has none). Every one is checked and unpacked here, before anything is
    copied: a damaged one is a ValueError in one line (see restore_records), with nothing brought back. The dry run
    asks this too, so that it refuses what the real run would refuse."""
    have = done_records(sweep_dir)
    missing = {tid: r for tid, r in done_records(records_dir).items() if tid not in have}
    damaged = [why for tid, record in missing.items()
               if (why := _damaged_record(records_dir / trial_dir_name(tid), record["status"], by_trainer))]
    if damaged:
        more = f" ({len(damaged) - 1} more done trials' records are damaged too)" if len(damaged) > 1 else ""
        raise ValueError(f"--records_dir: {damaged[0]}{more}; nothing was brought back: restore the records' files "
                         f"(git checkout, git lfs pull, or a copy from the machine that ran the trial), or remove the "
                         f"trial's lines from {records_dir / RESULTS_FILE} to run it again")
    metrics = {tid: _gunzip(path) if (path := records_dir / trial_dir_name(tid) / RECORD_METRICS).is_file() else None
               for tid in missing}
    return {tid: (record, metrics[tid]) for tid, record in missing.items()}


def restore_records(records_dir: Path, sweep_dir: Path, by_trainer: bool = False) -> list[str]:
    """Bring the done trials of ``records_dir`` that ``sweep_dir`` has not done back into it (their record
    files, their results line, their place in the state); returns their ids. The caller checks first that both
    folders hold the sweep it runs (scripts/sweep_runner/recording.py's load_state, naming the flag). `by_trainer`:
    the sweep's program is one of this repo's trainers, whose done trials record all of RECORD_FILES.

    A done trial whose record files are damaged (missing, unreadable: a partial copy or commit, a clone without
    git-LFS) is refused in one line naming the file, with nothing brought back: its results line is the study's
    record of that run, which the files restore; running it again would replace that record with another run (on
    another machine, other numbers) without the user asking. To run it again, its lines in the records' results.jsonl
    are removed: a trial the records' state calls done without a results line is pending here."""
    records_state = read_state(records_dir)
    if records_state is None:
        return []
    state = read_state(sweep_dir)
    restorable = restorable_records(records_dir, sweep_dir, by_trainer)
    missing = {tid: record for tid, (record, _) in restorable.items()}
    recorded_done = done_records(records_dir)
    # Every place a file goes is checked before anything is copied: a folder where a trial's file goes (a `mkdir` in
    # its place: the copy's IsADirectoryError traceback) is refused with the sweep folder as it was.
    for tid in missing:
        for name in (*RECORD_FILES, METRICS_FILE):
            check_not_a_folder(sweep_dir / trial_dir_name(tid) / name)
    for tid, record in missing.items():
        source, target = records_dir / trial_dir_name(tid), sweep_dir / trial_dir_name(tid)
        for name in RECORD_FILES:
            if (source / name).is_file():
                _write_bytes(target / name, (source / name).read_bytes())
        if (metrics := restorable[tid][1]) is not None:
            _write_bytes(target / METRICS_FILE, metrics)
        append_result(sweep_dir, record)
    known = set() if state is None else {t["trial_id"] for t in state["trials"]}
    taken = [t for t in records_state["trials"] if t["trial_id"] not in known]
    for trial in taken:  # done in the state but without its results line (removed to run it again): pending
        if trial["status"] in DONE_STATUSES and trial["trial_id"] not in recorded_done:
            trial["status"], trial["metric"] = "pending", None
    if state is None:
        state = records_state
    else:
        state["trials"] += taken
    for trial in state["trials"]:
        if (record := missing.get(trial["trial_id"])) is not None:
            trial["status"], trial["metric"] = record["status"], record.get("metric")
    write_state(sweep_dir, state)
    return list(missing)
