"""A checkpoint's `trainer_state.json`: the keys it holds beyond the run's counters, its one reader and validator
(`read_trainer_state`), and the size and sha256 of each file it records (`file_digests` on save, `verify_digests` on
resume).

The state records the step, the data position, the counters, the run's flags (`config`), the training data's identity
(`data`), the list of the checkpoint's files and their digests. `read_trainer_state` is the one place that reads it:
a state no save writes (not JSON, a missing or out-of-range field, a step other than the folder's name) is refused in
one line naming the file and the field (CheckpointDamaged), before a resume goes on from a position that is not the
checkpoint's. The digests are written by the process that holds the files, once every process has written its part
(trainer/checkpoint.py), so that a resume names a file copied in from another checkpoint, truncated or replaced.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dataset.atomic_io import file_digest, read_text_file
from dataset.shown_value import shown_value
from trainer.run_dir import RUN_ID_KEY, STATE_FILE, checkpoint_name, checkpoint_step, is_count
from trainer.step import RunPosition
from trainer.threads import MAX_THREADS, THREADS_KEY

FILES_KEY = "files"  # trainer_state.json: every file of the checkpoint, relative to it
# trainer_state.json: {file: {"bytes", "sha256"}} of every file its writer holds (verify_digests)
DIGESTS_KEY = "digests"
# trainer_state.json: what the objective carries from step to step, {name: number} (DPO's bco_pair: its running
# mean of the rewards); absent where it carries nothing
OBJECTIVE_STATE_KEY = "objective_state"
_SHA256 = re.compile(r"[0-9a-f]{64}")
DATA_KEYS = {"path", "train_samples", "tokens"}  # trainer_state.json's "data" (trainer/data.py data_identity)


class CheckpointDamaged(ValueError):
    """A file of the checkpoint to resume cannot be read or holds what no save writes; the message names it."""


def read_trainer_state(path: Path) -> dict[str, Any]:
    """The trainer state saved with a checkpoint (step, data position, config, data identity), validated here, the
    one place that reads it: CheckpointDamaged names the file and the field that is wrong, FileNotFoundError says
    there is none (naming the checkpoint, not the flag: the caller says which --resume and which rank)."""
    state_file = path / STATE_FILE
    if not state_file.is_file():
        raise FileNotFoundError(f"{path}: not a complete checkpoint (no {STATE_FILE})")
    try:
        state = json.loads(read_text_file(state_file))
    except json.JSONDecodeError as error:
        raise CheckpointDamaged(f"{state_file}: is not valid JSON ({error}); the checkpoint is damaged") from None
    except ValueError as error:  # read_text_file's: not UTF-8, or the file cannot be read
        raise CheckpointDamaged(f"{error}; the checkpoint is damaged") from None
    _check_state(state_file, state, checkpoint_step(path.name))
    return state


def _check_state(state_file: Path, state: Any, named_step: int | None) -> None:
    """Raise CheckpointDamaged for a trainer state that no save writes: a resume would fail on it with a traceback
    or, worse, go on from a position that is not the checkpoint's (a negative step re-saves over older
    checkpoints; an epoch past the run's steps "finishes" it without a step, over the finished model). The checks
    run in a fixed order (the first that fails is named): the shape, the fields every save writes, the position's
    counts (_POSITION_FIELDS), the step and epoch against each other, the other plain fields (_PLAIN_FIELDS), then
    the structured entries (_first_bad_entry)."""
    def bad(field: str, allowed: str) -> CheckpointDamaged:
        shown = "missing" if field not in state else "null" if state[field] is None else shown_value(state[field])
        return CheckpointDamaged(f"{state_file}: '{field}' must be {allowed}, not {shown}; the checkpoint is damaged")

    if not isinstance(state, dict):
        kind = {type(None): "null", list: "a list", str: "a string", bool: "true or false"}.get(type(state), "a number")
        raise CheckpointDamaged(f"{state_file}: is not a JSON object ({kind}); the checkpoint is damaged")
    if "samples_done_in_epoch" not in state:
        raise CheckpointDamaged(f"{state_file}: the checkpoint was written by an older MiniNorm that counted its data "
                                f"position in per-process batches; it cannot be resumed exactly, start a new run")
    for field in ("step", "epoch", "tokens_seen"):
        if field not in state:
            raise CheckpointDamaged(f"{state_file}: '{field}' is missing; the checkpoint is damaged")
    if (wrong := _first_bad_field(state, _POSITION_FIELDS)) is not None:
        raise bad(*wrong)
    if named_step is not None and state["step"] != named_step:
        raise CheckpointDamaged(f"{state_file}: 'step' is {state['step']}, but the checkpoint is "
                                f"{checkpoint_name(named_step)}; the checkpoint is damaged")
    # Every epoch a run finished took at least one optimizer step (a run needs one step's samples per epoch).
    if state["epoch"] > state["step"]:
        raise CheckpointDamaged(f"{state_file}: 'epoch' is {state['epoch']}, more than its {state['step']} optimizer "
                                f"steps; the checkpoint is damaged")
    if (wrong := _first_bad_field(state, _PLAIN_FIELDS) or _first_bad_entry(state)) is not None:
        raise bad(*wrong)


def _is_number_at_least_0(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0


# A plain field of the trainer state: its name, what it must be (in the message's words), the test of its value, and
# whether a null is the field left unset (True) or a value that must pass the test too (False). An absent field
# passes: a checkpoint written before the field existed (the fields every save writes are checked present first).
_FieldRule = tuple[str, str, Callable[[Any], bool], bool]
# The data position's counts, checked before the step and epoch are compared.
_POSITION_FIELDS: tuple[_FieldRule, ...] = (
    *((field, "an integer >= 0", is_count, False)
      for field in ("step", "epoch", "samples_done_in_epoch", "tokens_seen", "total_steps")),
    # Every save since each field exists writes an integer (a checkpoint from before has none, and loads): a null is
    # no save's, and a null "processes" would end the resume's file check with a TypeError.
    ("processes", "an integer >= 1", lambda value: is_count(value, least=1), False),
    # A resumed run sets this count (ThreadPolicy.keep_runs): no save writes more than MAX_THREADS (--threads is
    # bounded by the cores), and a hand-edited 10**9 aborted inside libgomp.
    (THREADS_KEY, f"an integer in 1 .. {MAX_THREADS}", lambda value: is_count(value, least=1) and value <= MAX_THREADS,
     False),
)
_PLAIN_FIELDS: tuple[_FieldRule, ...] = (
    ("train_time_s", "a number >= 0", _is_number_at_least_0, False),
    (RUN_ID_KEY, "a string", lambda value: isinstance(value, str), True),
    ("wandb_run_id", "a string", lambda value: isinstance(value, str), True),
    ("budget_fixed", "true or false", lambda value: isinstance(value, bool), False),
    ("config", "a JSON object of the run's flags", lambda value: isinstance(value, dict), False),
)


def _first_bad_field(state: dict[str, Any], rules: tuple[_FieldRule, ...]) -> tuple[str, str] | None:
    """(name, what it must be) of the first field of `rules` whose value in `state` fails its test, or None."""
    for field, allowed, holds, null_is_unset in rules:
        if field in state and not (null_is_unset and state[field] is None) and not holds(state[field]):
            return field, allowed
    return None


def _first_bad_entry(state: dict[str, Any]) -> tuple[str, str] | None:
    """(name, what it must be) of the first structured entry of `state` (its data identity, its file list, the
    objective's state, the digests; each null or absent where the run had none) that does not hold what a save
    writes, or None."""
    data = state.get("data")
    if data is not None and not (isinstance(data, dict) and DATA_KEYS <= set(data)):
        return "data", f"a JSON object with {', '.join(sorted(DATA_KEYS))}"
    files = state.get(FILES_KEY)
    if files is not None and not (isinstance(files, list) and all(_inside(name) for name in files)):
        return FILES_KEY, "a list of file names inside the checkpoint"
    objective_state = state.get(OBJECTIVE_STATE_KEY)
    if objective_state is not None and not (isinstance(objective_state, dict) and all(
            isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            for value in objective_state.values())):
        return OBJECTIVE_STATE_KEY, "a JSON object of finite numbers"
    digests = state.get(DIGESTS_KEY)
    if digests is not None and not (isinstance(digests, dict) and all(
            _inside(name) and isinstance(entry, dict) and is_count(entry.get("bytes"))
            and isinstance(entry.get("sha256"), str) and _SHA256.fullmatch(entry["sha256"])
            for name, entry in digests.items())):
        return DIGESTS_KEY, ('a JSON object of file names inside the checkpoint, each {"bytes": an integer >= 0, '
                             '"sha256": 64 hex digits}')
    return None


def _inside(name: Any) -> bool:
    """A file name of trainer_state.json's lists: relative, inside the checkpoint."""
    return isinstance(name, str) and bool(name) and not Path(name).is_absolute() and ".." not in Path(name).parts


def file_digests(folder: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """{name: file_digest} of the files `names` under `folder`, hashed side by side on the machine's cores (hashlib
    lets go of the GIL): a checkpoint is a few large files, and the run waits for its save."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, min(len(names), os.cpu_count() or 1))) as pool:
        return dict(zip(names, pool.map(lambda name: file_digest(folder / name), names)))


def verify_digests(path: Path, digests: dict[str, dict[str, Any]]) -> str | None:
    """The first file of the checkpoint `path` that is not the one its save recorded in `digests` (missing, another
    size, other bytes), in words, or None. Sizes first: a truncated file is named without reading any file."""
    for name, recorded in sorted(digests.items()):
        file = path / name
        if not file.is_file():
            return f"{file} is missing"
        if (size := file.stat().st_size) != recorded["bytes"]:
            return f"{file} holds {size} bytes, where {STATE_FILE} records {recorded['bytes']}"
    names = sorted(digests)
    found = file_digests(path, names)
    for name in names:
        if found[name]["sha256"] != digests[name]["sha256"]:
            return f"{path / name} has another sha256 than {STATE_FILE} records"
    return None


def saved_position(state: dict[str, Any]) -> tuple[int, int]:
    """(epoch, samples of that epoch's order already trained on, over all processes) of a trainer state
    (read_trainer_state has checked both)."""
    return state["epoch"], state["samples_done_in_epoch"]


def trainer_state(position: RunPosition, *, total_steps: int, processes: int, run_id: str,
                  data: dict[str, Any], wandb_run_id: str | None, config: dict[str, Any], train_time_s: float,
                  budget_fixed: bool, threads: int, objective_state: dict[str, float]) -> dict[str, Any]:
    """What a checkpoint records beside the weights and optimizer (its trainer_state.json, less the files and
    digests the save adds): the position, the run's identity, the training time spent, whether a time budget
    planned the length, and the objective's own state if it keeps one (bco_pair's running mean)."""
    state = {"step": position.step, "epoch": position.epoch, "samples_done_in_epoch": position.samples_done,
             "tokens_seen": position.tokens_seen, "total_steps": total_steps, "processes": processes,
             RUN_ID_KEY: run_id, "data": data, "wandb_run_id": wandb_run_id, "config": config,
             "train_time_s": train_time_s, "budget_fixed": budget_fixed, THREADS_KEY: threads}
    if objective_state:
        state[OBJECTIVE_STATE_KEY] = objective_state
    return state
