"""Resumable training state, written atomically, and the agreement of every process on what to resume.

A checkpoint is a directory `step_XXXXXXXX/` holding Accelerate's state (fp32 model weights, optimizer,
scheduler, every process's RNG states) plus `trainer_state.json` (step, data position, counters, the list of the
checkpoint's files; the names are trainer/run_dir.py's). It is written under a temporary name and renamed into
place only when complete, so a save killed midway leaves the previous checkpoint intact; `trainer_state.json` is
written last and marks a checkpoint complete. Complete means every process's part is in place where the processes
that need it can read it: the save checks that before it writes `trainer_state.json`.

Several machines: `--out_dir` is either one directory every process sees (shared storage: the main process writes
the checkpoint) or one directory per machine (each machine's first process writes a whole copy there, its
processes their own RNG states; possible when every process holds the whole model and optimizer, as under DDP).
`probe_storage` (trainer/storage_probe.py) finds out which at start-up. On resume the main process decides which
checkpoint every process loads (with --resume auto, the newest one that every process holds) and tells the others;
every process then checks that it can read each file it needs, its own RNG state included, and the job stops in one
line naming the rank and the path otherwise: a process never silently starts from another step, or from its seed,
while the others resume.
A resume reads its trainer state through `read_trainer_state` (trainer/checkpoint_state.py, the one place that
validates it) and loads every file (`load_checkpoint`, which names a damaged one) before --overwrite removes the
directory's previous run. `trainer_state.json` also records the size and sha256 of every file its writer holds (the
writer hashes them once every process has written its part), and a resume checks them before it loads anything
(agree_on_start): a file copied in from another checkpoint, truncated or replaced is refused in one line naming it.
A checkpoint written before digests were recorded resumes unverified, with a note saying so. What the run's
flags may change against the checkpoint's is trainer/resume_checks.py's to say.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from accelerate.utils import RNG_STATE_NAME, broadcast_object_list, gather_object
from tqdm.auto import tqdm

from dataset.atomic_io import atomic_write_text, first_line, give_open_modes
from dataset.json_text import strict_json
from trainer.checkpoint_state import (DIGESTS_KEY, FILES_KEY, CheckpointDamaged, file_digests, read_trainer_state,
                                      verify_digests)
from trainer.run_dir import (CHECKPOINT_DIR, CONFIG_FILE, RUN_ID_KEY, STATE_FILE, SUMMARY_FILE, checkpoint_name,
                             checkpoint_step, clear_previous_run, list_checkpoints, previous_run, recorded_run_id,
                             refuse_previous_run)
from trainer.metrics_log import unreadable_metrics
from trainer.storage_probe import STORAGE_HELP

_RNG_FILE = re.compile(rf"{RNG_STATE_NAME}_(\d+)\.pkl")


class CheckpointUnreadable(FileNotFoundError):
    """A process cannot read a file of the checkpoint it must save or resume; the message names the rank and path."""


@dataclass(frozen=True)
class ResumePoint:
    path: Path              # this process's path to the checkpoint
    state: dict[str, Any]   # its trainer state, as the main process read it
    note: str = ""          # why it is not the main process's newest checkpoint, if it is not


def rng_state_file(rank: int) -> str:
    return f"{RNG_STATE_NAME}_{rank}.pkl"


def files_needed_by(files: list[str], rank: int, saved_processes: int) -> list[str]:
    """The files of a checkpoint that process `rank` reads to resume from it: all but the other processes' RNG
    states, its own included when the checkpoint has one for it (a checkpoint of fewer processes has none for the
    extra ones: they start from the seed, as the docs say), and trainer_state.json."""
    needed = [name for name in files if (match := _RNG_FILE.fullmatch(name)) is None or int(match[1]) == rank]
    if rank < saved_processes and rng_state_file(rank) not in needed:
        needed.append(rng_state_file(rank))
    return [STATE_FILE, *needed] if STATE_FILE not in needed else needed


def _files_under(path: Path) -> list[str]:
    return sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()) if path.is_dir() else []


def _readable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.R_OK)


class _TiedHeadNotice(logging.Filter):
    """Drops Accelerate's "Removed shared tensor {...lm_head.weight} while saving" notice: safetensors stores a tied
    tensor once, and the LM head tied to the embedding is restored from it on load. Other names still show."""

    _NOTICE = re.compile(r"Removed shared tensor \{(.*)\} while saving")

    def filter(self, record: logging.LogRecord) -> bool:
        match = self._NOTICE.search(record.getMessage())
        return match is None or not all(name.strip().strip("'").endswith("lm_head.weight")
                                        for name in match[1].split(","))


@contextmanager
def _tied_head_notice_silenced():
    logger, notice = logging.getLogger("accelerate.utils.other"), _TiedHeadNotice()
    logger.addFilter(notice)
    try:
        yield
    finally:
        logger.removeFilter(notice)


def save_checkpoint(accelerator: Accelerator, root: Path, step: int, state: dict[str, Any], keep: int,
                    shared_storage: bool = True) -> Path:
    """Collective: every process calls it. Returns the checkpoint directory. With `shared_storage` False each
    machine's local main process writes a whole copy under its own `root`. Raises CheckpointUnreadable, on every
    process, when a process cannot read a part it would need to resume (nothing is marked complete then)."""
    final = root / checkpoint_name(step)
    tmp = root / f".tmp_{checkpoint_name(step)}"
    writer = accelerator.is_main_process if shared_storage else accelerator.is_local_main_process
    if writer:
        _remove_leftovers(root)  # this save's own temp folder among them
        root.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    accelerator.project_configuration.save_on_each_node = not shared_storage
    with _tied_head_notice_silenced():
        accelerator.save_state(str(tmp), safe_serialization=True)
    accelerator.wait_for_everyone()
    views = gather_object([(str(tmp), _files_under(tmp))])
    files = sorted(set().union(*(set(view) for _, view in views)))
    for rank, (path, view) in enumerate(views):
        missing = [name for name in files_needed_by(files, rank, len(views)) if name != STATE_FILE and name not in view]
        if missing:
            raise CheckpointUnreadable(f"checkpoint {final.name} is incomplete: rank {rank} cannot read "
                                       f"{Path(path) / missing[0]}, which another process wrote; --out_dir must be "
                                       f"storage that process can read ({STORAGE_HELP})")
    if writer:
        give_open_modes(tmp)
        # The writer's digest of each file it holds (on shared storage, every process's; on one directory per
        # machine, that machine's copy), read back once all are written: Accelerate writes them, each its own way.
        digests = file_digests(tmp, views[accelerator.process_index][1])
        atomic_write_text(tmp / STATE_FILE, strict_json({**state, FILES_KEY: files, DIGESTS_KEY: digests}, indent=2))
        if final.exists():
            _remove_checkpoint(final)
        os.replace(tmp, final)
        for old in list_checkpoints(root)[:-keep]:
            _remove_checkpoint(old)
    accelerator.wait_for_everyone()
    return final


def _remove_leftovers(root: Path) -> None:
    """Remove what a kill left under `root` (a run's CHECKPOINT_DIR), which no resume reads and nothing else removed:
    the temp folder of a save cut short (".tmp_step_N", removed only by a later save of the same step) and a
    checkpoint folder whose removal was cut short (no trainer_state.json). One run writes its folder at a time."""
    if not root.is_dir():
        return
    for path in root.iterdir():
        name = path.name.removeprefix(".tmp_")
        complete = name == path.name and (path / STATE_FILE).is_file()
        if path.is_dir() and not path.is_symlink() and checkpoint_step(name) is not None and not complete:
            shutil.rmtree(path, ignore_errors=True)


def _remove_checkpoint(path: Path) -> None:
    """Remove a checkpoint directory, its trainer_state.json first: a removal cut short (a kill) leaves no
    checkpoint that is listed as complete without all of its files."""
    (path / STATE_FILE).unlink(missing_ok=True)
    shutil.rmtree(path, ignore_errors=True)


def drop_later_checkpoints(accelerator: Accelerator, root: Path, resumed: Path, writer: bool) -> list[str]:
    """Collective. A run resumed from one of its own checkpoints (`resumed`, under `root`, its CHECKPOINT_DIR)
    replaces what followed it, as its metrics.jsonl drops the later records: the `writer` processes remove its later
    checkpoints, which would stay the newest (a `--resume auto` would go on from them, over the new steps, whose
    records it would keep) and push the new ones out under --keep_checkpoints. Returns the names removed."""
    step = checkpoint_step(resumed.name)
    later = []
    if writer and step is not None and resumed.resolve().parent == root.resolve():
        later = [path for path in list_checkpoints(root) if checkpoint_step(path.name) > step]
        for path in later:
            _remove_checkpoint(path)
    accelerator.wait_for_everyone()
    return [path.name for path in later]


@dataclass(frozen=True)
class RunStart:
    """What every process starts: a run id (the resumed checkpoint's run, or a new one), the checkpoint to resume
    (None: start fresh) and whether a previous run's files in --out_dir are to go before this run writes there
    (`clear_previous_files`)."""

    run_id: str
    resume: ResumePoint | None
    clear: bool = False


def agree_on_start(accelerator: Accelerator, resume: str | None, out_dir: Path, path: Path | None,
                   overwrite: bool = False, shared_storage: bool = True) -> RunStart:
    """Collective: which run every process starts, decided once by the main process and broadcast, then checked by
    every process. `resume`: None, "auto" (the newest checkpoint under out_dir/checkpoints, this process's, that
    every process holds) or a checkpoint directory, `path` (resolved on each machine). One directory holds one run:
    a fresh start where `out_dir` holds a finished model or checkpoints, or a resume of another run's checkpoint
    there (run ids differ), is refused unless `overwrite`, and then that run's files are to be removed
    (`RunStart.clear`; clear_previous_files removes them once the new run's inputs have all been checked). Nothing
    is written here. The processes that wrote the checkpoint (`shared_storage`: the main one; else each machine's
    first) check each file of theirs against the digests their save recorded, before anything is loaded. Raises, on
    every process with the same one line, ValueError for such a refusal, FileNotFoundError when there is no such
    checkpoint, CheckpointUnreadable naming the first rank and path that cannot be read and CheckpointDamaged naming
    the first file that is not the one saved."""
    root = out_dir / CHECKPOINT_DIR
    held = [p.name for p in list_checkpoints(root)] if resume == "auto" else []
    views = gather_object([(str(root), held)])
    decision: dict[str, Any] = {}
    if accelerator.is_main_process:
        decision = _decide(resume, views, path) if resume else {}
        if "error" not in decision and "refused" not in decision:
            decision.update(_one_run_per_directory(decision, resume, out_dir, path, overwrite))
    decision = broadcast_object_list([decision])[0]
    if "error" in decision:
        raise FileNotFoundError(decision["error"])
    if "refused" in decision:
        raise ValueError(decision["refused"])
    clear = bool(decision.get("clear"))
    if "name" not in decision:
        return RunStart(decision["run_id"], None, clear)
    mine = root / decision["name"] if resume == "auto" else path
    state = decision["state"]
    _check_every_process_reads(accelerator, resume, mine, state, decision["files"])
    _check_writers_copies(accelerator, resume, mine, state, shared_storage)
    unverified = (f"its {STATE_FILE} records no digests of its files (written before MiniNorm recorded them): they "
                  f"were not verified") if state.get(DIGESTS_KEY) is None else ""
    note = "; ".join(part for part in (decision["note"], unverified) if part)
    return RunStart(decision["run_id"], ResumePoint(mine, state, note), clear)


def _check_every_process_reads(accelerator: Accelerator, resume: str, mine: Path, state: dict[str, Any],
                               listing: list[str]) -> None:
    """Collective, agree_on_start's first check: each process tries each file of the checkpoint (`mine`, its path to
    it; `state`, the main process's trainer state; `listing`, the main process's listing of it, for a checkpoint
    whose state lists no files) that it needs, and every process raises CheckpointUnreadable naming the first rank
    and path that cannot be read."""
    needed = files_needed_by(state.get(FILES_KEY, listing), accelerator.process_index, state.get("processes", 1))
    unreadable = next((str(mine / name) for name in needed if not _readable(mine / name)), None)
    problems = gather_object([unreadable])
    if len(problems) == 1 and unreadable is not None:  # one process: no other storage to blame
        raise CheckpointUnreadable(f"--resume {resume}: {unreadable} is missing or cannot be read; the checkpoint is "
                                   f"incomplete: {_way_on(mine)}")
    for rank, problem in enumerate(problems):
        if problem is not None:
            raise CheckpointUnreadable(f"--resume {resume}: rank {rank} cannot read {problem}; every process needs "
                                       f"the checkpoint's model, optimizer and scheduler state and its own RNG state "
                                       f"({STORAGE_HELP})")


def _check_writers_copies(accelerator: Accelerator, resume: str, mine: Path, state: dict[str, Any],
                          shared_storage: bool) -> None:
    """Collective, agree_on_start's second check: the processes that wrote the checkpoint (`shared_storage`: the
    main one; else each machine's first) check their copy of it against the digests their save recorded
    (_check_digests), and every process raises CheckpointDamaged naming the first file that is not the one saved
    (and the rank, with several processes)."""
    writer = accelerator.is_main_process if shared_storage else accelerator.is_local_main_process
    mismatch = _check_digests(mine, state, accelerator.is_main_process) if writer else None
    mismatches = gather_object([mismatch])
    for rank, mismatch in enumerate(mismatches):
        if mismatch is not None:
            where = f"rank {rank}: " if len(mismatches) > 1 else ""
            raise CheckpointDamaged(f"--resume {resume}: {where}{mismatch}; {_way_on(mine)}")


def _check_digests(path: Path, state: dict[str, Any], main: bool) -> str | None:
    """A writer's check of its copy of the checkpoint `path` (`state`: the main process's trainer state; another
    machine's first process reads its own, which records its own copy's files): the first file that is not the one
    saved, in words, or None (a checkpoint written before digests were recorded is not checked)."""
    if not main:
        try:
            state = read_trainer_state(path)
        except (FileNotFoundError, CheckpointDamaged) as error:
            return str(error)
    digests = state.get(DIGESTS_KEY)
    try:
        mismatch = verify_digests(path, digests) if digests is not None else None
    except OSError as error:  # a file that cannot be read: every process must still hear of it, not wait
        return f"{error.filename or path} cannot be read ({error.strerror or error})"
    if mismatch is None:
        return None
    return f"{mismatch}: not the file this checkpoint saved (replaced, truncated or damaged since)"


def clear_previous_files(accelerator: Accelerator, out_dir: Path, start: RunStart, writer: bool) -> tuple[str, ...]:
    """Collective where `start.clear` (agree_on_start's decision, the same on every process): the `writer` processes
    remove the previous run's files from `out_dir`. Called once every input of the new run has been checked and
    before it writes there, so that a run refused for a bad flag leaves the previous one whole. Returns the names
    this process removed."""
    cleared: tuple[str, ...] = ()
    if start.clear:
        if writer:
            cleared = tuple(clear_previous_run(out_dir))
        accelerator.wait_for_everyone()
    return cleared


def _one_run_per_directory(decision: dict[str, Any], resume: str | None, out_dir: Path, path: Path | None,
                           overwrite: bool) -> dict[str, Any]:
    """The main process's check that the run starting in `out_dir` (`decision`: _decide's) mixes with no other:
    {"run_id"} and, where --overwrite removes the previous run's files first, {"clear": True}; or {"refused"}."""
    held = previous_run(out_dir)
    if "name" not in decision:  # a new run
        if held and not overwrite:
            return {"refused": refuse_previous_run(out_dir, held, resuming=resume == "auto").args[0]}
        return {"run_id": uuid.uuid4().hex[:12], "clear": bool(held)}
    checkpoint = out_dir / CHECKPOINT_DIR / decision["name"] if resume == "auto" else path
    inside = checkpoint.resolve().parent == (out_dir / CHECKPOINT_DIR).resolve()
    theirs, ours = decision["state"].get(RUN_ID_KEY), recorded_run_id(out_dir)
    # A checkpoint continues the directory's run when the run ids agree; where either predates run ids, a
    # directory's own checkpoints are its run's (the data-order checks of trainer/resume_checks.py's
    # check_resume_compatible still apply).
    same_run = theirs == ours if theirs and ours else inside
    run_id = theirs or uuid.uuid4().hex[:12]
    if same_run:
        # the resumed run continues the directory's metrics.jsonl (keeping the records up to its step): one it
        # cannot read is refused now, with the directory as it was
        if (problem := unreadable_metrics(out_dir)) is not None:
            return {"refused": f"--resume {resume}: {problem}; the resumed run continues that file: repair it (or "
                               f"move it away) and resume again"}
        return {"run_id": run_id}
    if inside:
        return {"refused": f"--resume {resume}: {checkpoint} is a checkpoint of run {theirs}, but "
                           f"{out_dir / CONFIG_FILE} records run {ours}: the directory mixes two runs; resume into "
                           f"another --out_dir"}
    if held and not overwrite:
        source = f"run {theirs}" if theirs else "another run"
        refusal = refuse_previous_run(out_dir, held, f" (run {ours})" if ours else "")
        return {"refused": f"--resume {checkpoint}: that checkpoint is of {source}, and {refusal.args[0]}"}
    # Another run's checkpoint into a directory that holds no finished run: the directory continues that run, and a
    # cut-short run's leftovers (metrics.jsonl) must not join its curve.
    return {"run_id": run_id, "clear": True}


def _decide(resume: str, views: list[tuple[str, list[str]]], path: Path | None) -> dict[str, Any]:
    """The main process's choice of a checkpoint for agree_on_start: {} (start fresh), {"error"} or {"name", "state",
    "files" (its listing, for checkpoints written before trainer_state.json listed them), "note"}."""
    note = ""
    if resume == "auto":
        ours = views[0][1]
        common = [name for name in ours if all(name in held for _, held in views)]
        if not ours:
            return {}
        if not common:
            rank = next(rank for rank, (_, held) in enumerate(views) if ours[-1] not in held)
            return {"error": f"--resume auto: rank {rank} holds none of rank 0's checkpoints ({', '.join(ours)}) "
                             f"under {views[rank][0]} ({STORAGE_HELP})"}
        if common[-1] != ours[-1]:
            rank = next(rank for rank, (_, held) in enumerate(views) if ours[-1] not in held)
            note = f"rank {rank} does not hold {ours[-1]}; {common[-1]} is the newest checkpoint every process holds"
        chosen = Path(views[0][0]) / common[-1]
    else:
        chosen = path
        if not chosen.is_dir():
            return {"error": f"--resume {chosen}: no such checkpoint directory"}
    try:
        state = read_trainer_state(chosen)
    except FileNotFoundError as error:  # "--resume auto: PATH: ..." or "--resume PATH: ...", the path once
        return {"error": f"--resume auto: {error}" if resume == "auto" else f"--resume {error}"}
    except CheckpointDamaged as error:
        return {"refused": f"--resume {resume}: {error}; {_way_on(chosen)}"}
    return {"name": chosen.name, "state": state, "files": _files_under(chosen), "note": note}


def load_checkpoint(accelerator: Accelerator, path: Path, resume: str) -> None:
    """Collective: restore model, optimizer, scheduler and RNG states (agree_on_start has checked every file is
    there). A file that cannot be read raises CheckpointDamaged naming it (and the rank, with several processes) on
    every process. The trainer calls this before --overwrite removes anything: a refused resume leaves the
    directory's previous run whole."""
    problem = None
    try:
        _restore_rng_state(path / rng_state_file(accelerator.process_index))
        accelerator.load_state(str(path))
    except CheckpointDamaged as error:
        problem = str(error)
    except Exception as error:  # noqa: BLE001 -- torch, safetensors and pickle raise any kind on a damaged file
        problem = _damage_report(path, error)
    problems = gather_object([problem])
    for rank, problem in enumerate(problems):
        if problem is not None:
            where = f"rank {rank}: " if len(problems) > 1 else ""
            raise CheckpointDamaged(f"--resume {resume}: {where}{problem}; {_way_on(path)}")


def _way_on(path: Path) -> str:
    """What to do about the damaged or incomplete checkpoint `path` (which `--resume auto` would pick again): resume
    from the complete one before it, where its folder holds one, else start anew."""
    step = checkpoint_step(path.name)
    earlier = [p for p in list_checkpoints(path.parent) if step is not None and checkpoint_step(p.name) < step]
    return (f"resume from the checkpoint before it with --resume {earlier[-1]}" if earlier
            else "there is no earlier checkpoint to resume from: start the run anew (--overwrite)")


# What Accelerate restores from a process's random_states_N.pkl on every device (and a save always writes).
_RNG_KEYS = ("random_state", "numpy_random_seed", "torch_manual_seed")


def _restore_rng_state(file: Path) -> None:
    """Set the Python, NumPy and torch generators from `file` (its absence is no error: a checkpoint of fewer
    processes has none for the extra ones, which start from the seed). Accelerate's load_state sets them too but
    only logs, at info level, when it cannot: the resume would go on from the seed's state, inexactly, unseen."""
    if not file.is_file():
        return
    import random

    import numpy as np
    import torch
    from accelerate.utils import load

    try:
        states = load(file)
        if not isinstance(states, dict) or not all(key in states for key in _RNG_KEYS):
            raise ValueError(f"no {', '.join(_RNG_KEYS)} in it")
        random.setstate(states["random_state"])
        np.random.set_state(states["numpy_random_seed"])
        torch.set_rng_state(states["torch_manual_seed"])
    except Exception as error:  # noqa: BLE001 -- unpickling and the generators raise any kind on bad values
        raise CheckpointDamaged(f"{file} is damaged ({first_line(error, named=True)}); the random states cannot be "
                                f"restored, and the resume would not be exact") from None


def _damage_report(path: Path, error: BaseException) -> str:
    """Which file of the checkpoint `path` made its load fail with `error`: each file is read again on its own (only
    after a failure), in the order Accelerate reads them."""
    from accelerate.utils import load
    from safetensors import safe_open

    order = ("model", "optimizer", "scheduler")
    files = sorted((p for p in path.rglob("*") if p.is_file() and p.name != STATE_FILE),
                   key=lambda p: (next((i for i, name in enumerate(order) if p.name.startswith(name)), len(order)),
                                  str(p)))
    for file in files:
        try:
            if file.suffix == ".safetensors":
                with safe_open(str(file), framework="pt") as tensors:
                    for key in tensors.keys():
                        tensors.get_tensor(key)
            elif file.suffix in (".bin", ".pt", ".pkl"):
                load(file, map_location="cpu")  # as Accelerate reads them: weights only, no code run
        except Exception as damage:  # noqa: BLE001 -- as above
            return f"{file} is damaged ({first_line(damage, named=True)})"
    return f"{path} cannot be loaded into this run's model or optimizer ({first_line(error, named=True)})"


def restore_and_clear(accelerator: Accelerator, start: RunStart, out_dir: Path, resume: str | None, overwrite: bool,
                      shared_storage: bool) -> None:
    """Load the checkpoint a resume goes on from (`start.resume`; `resume`: the --resume flag), then (every input
    checked by now, so a refused run leaves the previous one whole) remove the previous run's files that
    --overwrite or this resume replaces, saying so. Collective."""
    resume_from = start.resume.path if start.resume is not None else None
    is_main = accelerator.is_main_process
    if resume_from is not None:
        # Read before anything is removed: a damaged checkpoint is refused with the previous run still whole.
        load_checkpoint(accelerator, resume_from, resume)
        # Accelerate restores its micro-batch counter, which decides on which micro-batch the gradients sync
        # and the optimizer steps; counted under another --accumulation_steps it would put the update in the
        # middle of a group. A resumed run always starts on a group boundary.
        accelerator.step = 0
    writer = is_main if shared_storage else accelerator.is_local_main_process
    cleared = clear_previous_files(accelerator, out_dir, start, writer=writer)
    if cleared and is_main:
        reason = "--overwrite: " if overwrite else "another run resumed here: "
        tqdm.write(f"{reason}removed the previous run's {', '.join(cleared)} from {out_dir}")
    if resume_from is not None:
        dropped = drop_later_checkpoints(accelerator, out_dir / CHECKPOINT_DIR, resume_from, writer)
        if dropped and is_main:
            tqdm.write(f"resumed from {resume_from.name}: removed the later checkpoints of the continuation "
                       f"it replaces ({', '.join(dropped)})")
        if is_main:
            # The run trains on: the summary of where it had ended (finished or diverged) no longer describes
            # it, and with this session's config in train_config.yaml, a session stopped before its end would
            # pass for that finished run (finished_run_asked_again). This session's end writes a new one.
            (out_dir / SUMMARY_FILE).unlink(missing_ok=True)
