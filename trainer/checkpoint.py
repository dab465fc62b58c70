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
`probe_storage` finds out which at start-up. On resume the main process decides which checkpoint every process
loads (with --resume auto, the newest one that every process holds) and tells the others; every process then checks
that it can read each file it needs, its own RNG state included, and the job stops in one line naming the rank and
the path otherwise: a process never silently starts from another step, or from its seed, while the others resume.
"""

from __future__ import annotations

import json
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

from dataset.atomic_io import atomic_write_text
from trainer.args import TrainArgs, uses_lora
from trainer.run_dir import (CHECKPOINT_DIR, CONFIG_FILE, RUN_ID_KEY, STATE_FILE, checkpoint_name, checkpoint_step,
                             clear_previous_run, previous_run, recorded_run_id, refuse_previous_run)

# Flags that decide which samples the training set holds and in which order: a checkpoint's data position means
# nothing under other values, so resuming with a different one is refused. (--batch_size, --accumulation_steps and
# the number of processes only group the same sample order differently: the position, counted in samples, maps.)
DATA_ORDER_FLAGS = ("max_seq_len", "seed", "val_fraction")
# Flags that decide the shapes of a LoRA run's trainable tensors: the checkpoint's adapters fit no other value.
ADAPTER_FLAGS = ("lora", "lora_rank", "lora_targets")
FILES_KEY = "files"  # trainer_state.json: every file of the checkpoint, relative to it
_RNG_FILE = re.compile(rf"{RNG_STATE_NAME}_(\d+)\.pkl")
_STORAGE_HELP = "see docs/training.md, 'Several machines'"


class CheckpointUnreadable(FileNotFoundError):
    """A process cannot read a file of the checkpoint it must save or resume; the message names the rank and path."""


@dataclass(frozen=True)
class ResumePoint:
    path: Path              # this process's path to the checkpoint
    state: dict[str, Any]   # its trainer state, as the main process read it
    note: str = ""          # why it is not the main process's newest checkpoint, if it is not


def rng_state_file(rank: int) -> str:
    return f"{RNG_STATE_NAME}_{rank}.pkl"


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if checkpoint_step(p.name) is not None and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: checkpoint_step(p.name))


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


def probe_storage(accelerator: Accelerator, out_dir: Path, node_local_allowed: bool) -> bool:
    """Collective. True when every process sees the same `out_dir` (shared storage), False when each machine has
    its own (then each machine's local main process writes a whole checkpoint there). Every process writes a file
    named by a token the main process chose and reports whose files it sees. Raises ValueError when neither holds
    or when a machine-local directory cannot hold a whole checkpoint (`node_local_allowed` False: sharded weights
    or optimizer state, whose parts only the process that holds them writes)."""
    if accelerator.num_processes == 1:
        return True
    token = broadcast_object_list([uuid.uuid4().hex if accelerator.is_main_process else None])[0]
    out_dir.mkdir(parents=True, exist_ok=True)
    world, rank = accelerator.num_processes, accelerator.process_index
    probe = out_dir / f".storage_probe_{token}_{rank}"
    probe.write_text(str(rank))
    accelerator.wait_for_everyone()
    seen = [other for other in range(world) if (out_dir / f".storage_probe_{token}_{other}").is_file()]
    views = gather_object([(seen, accelerator.local_process_index, str(out_dir))])
    accelerator.wait_for_everyone()
    probe.unlink()
    return storage_is_shared(views, node_local_allowed)


def storage_is_shared(views: list[tuple[list[int], int, str]], node_local_allowed: bool) -> bool:
    """The probe's verdict from every process's (ranks whose files it sees, its local rank, its out_dir)."""
    world = len(views)
    if all(len(seen) == world for seen, _, _ in views):
        return True
    for rank, (seen, _, out_dir) in enumerate(views):
        writers = [other for other in seen if views[other][1] == 0]
        if rank not in seen or any(views[other][0] != seen for other in seen) or len(writers) != 1:
            raise ValueError(f"--out_dir {out_dir}: rank {rank} sees the files of ranks {seen} of {world} there; "
                             f"checkpoints need one directory that every process sees, or one per machine that "
                             f"all of that machine's processes see ({_STORAGE_HELP})")
    if not node_local_allowed:
        rank = next(rank for rank, (seen, _, _) in enumerate(views) if 0 not in seen)
        raise ValueError(f"--out_dir {views[rank][2]}: rank {rank} does not see rank 0's files there, and sharded "
                         f"checkpoints (FSDP, DeepSpeed) need an --out_dir on storage shared by every machine "
                         f"({_STORAGE_HELP})")
    return False


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
        shutil.rmtree(tmp, ignore_errors=True)
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
                                       f"storage that process can read ({_STORAGE_HELP})")
    if writer:
        atomic_write_text(tmp / STATE_FILE, json.dumps({**state, FILES_KEY: files}, indent=2))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in list_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def read_trainer_state(path: Path) -> dict[str, Any]:
    """The trainer state saved with a checkpoint (step, data position, config, data identity)."""
    state_file = path / STATE_FILE
    if not state_file.is_file():
        raise FileNotFoundError(f"--resume {path}: not a complete checkpoint (no {STATE_FILE})")
    return json.loads(state_file.read_text())


def saved_position(state: dict[str, Any]) -> tuple[int, int]:
    """(epoch, samples of that epoch's order already trained on, over all processes) of a trainer state."""
    if "samples_done_in_epoch" not in state:
        raise ValueError("the checkpoint was written by an older MiniNorm that counted its data position in "
                         "per-process batches; it cannot be resumed exactly, start a new run")
    return state["epoch"], state["samples_done_in_epoch"]


def check_resume_compatible(path: Path, state: dict[str, Any], args: TrainArgs, data: dict[str, Any]) -> None:
    """Refuse, in one line naming the flag with its old and new value, to resume where the data position would
    not map exactly (other data, another --max_seq_len, --seed or --val_fraction) or, for LoRA, where the saved
    adapters have another shape (--lora_rank, --lora_targets) or are absent (GRPO/PPO's --lora), or, for
    distillation, where --teacher names another directory."""
    saved = state.get("config", {})
    for flag in DATA_ORDER_FLAGS:
        old, new = saved.get(flag), getattr(args, flag)
        if old is not None and old != new:
            raise ValueError(f"--resume {path.name}: --{flag} was {old} there and is {new} now; the saved data "
                             f"position is only valid for the same samples in the same order (resume with "
                             f"--{flag} {old}, or start a new run)")
    for flag in ADAPTER_FLAGS:
        old, new = saved.get(flag), getattr(args, flag)
        if (uses_lora(args) or saved.get("lora")) and old is not None and old != new:
            raise ValueError(f"--resume {path.name}: --{flag} was {old} there and is {new} now; the saved adapters "
                             f"have that shape (resume with --{flag} {old}, or start a new run)")
    if args.task == "distill" and "teacher" in saved:
        from trainer.distillation import teacher_directory
        old, new = teacher_directory(saved["teacher"]), teacher_directory(args.teacher)
        if old != new:
            raise ValueError(f"--resume {path.name}: --teacher was {old} there and is {new} now; a run distils from "
                             f"one teacher (resume with --teacher {old}, or start a new run)")
    old_data = state.get("data")
    same = old_data is None or {k: v for k, v in old_data.items() if k != "path"} == {
        k: v for k, v in data.items() if k != "path"}
    if not same:
        raise ValueError(f"--resume {path.name}: --data_path was {_describe(old_data)} there and is "
                         f"{_describe(data)} now; the saved data position is only valid for the same training "
                         f"data (resume with the same file, or start a new run)")


def _describe(data: dict[str, Any]) -> str:
    return f"{data['path']} ({data['train_samples']} training samples, {data['tokens']} tokens)"


@dataclass(frozen=True)
class RunStart:
    """What every process starts: a run id (the resumed checkpoint's run, or a new one), the checkpoint to resume
    (None: start fresh) and whether a previous run's files in --out_dir are to go before this run writes there
    (`clear_previous_files`)."""

    run_id: str
    resume: ResumePoint | None
    clear: bool = False


def agree_on_start(accelerator: Accelerator, resume: str | None, out_dir: Path, path: Path | None,
                   overwrite: bool = False) -> RunStart:
    """Collective: which run every process starts, decided once by the main process and broadcast, then checked by
    every process. `resume`: None, "auto" (the newest checkpoint under out_dir/checkpoints, this process's, that
    every process holds) or a checkpoint directory, `path` (resolved on each machine). One directory holds one run:
    a fresh start where `out_dir` holds a finished model or checkpoints, or a resume of another run's checkpoint
    there (run ids differ), is refused unless `overwrite`, and then that run's files are to be removed
    (`RunStart.clear`; clear_previous_files removes them once the new run's inputs have all been checked). Nothing
    is written here. Raises, on every process with the same one line, ValueError for such a
    refusal, FileNotFoundError when there is no such checkpoint and CheckpointUnreadable naming the first rank and
    path that cannot be read."""
    root = out_dir / CHECKPOINT_DIR
    held = [p.name for p in list_checkpoints(root)] if resume == "auto" else []
    views = gather_object([(str(root), held)])
    decision: dict[str, Any] = {}
    if accelerator.is_main_process:
        decision = _decide(resume, views, path) if resume else {}
        if "error" not in decision:
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
    needed = files_needed_by(state.get(FILES_KEY, decision["files"]), accelerator.process_index,
                             state.get("processes", 1))
    unreadable = next((str(mine / name) for name in needed if not _readable(mine / name)), None)
    for rank, problem in enumerate(gather_object([unreadable])):
        if problem is not None:
            raise CheckpointUnreadable(f"--resume {resume}: rank {rank} cannot read {problem}; every process needs "
                                       f"the checkpoint's model, optimizer and scheduler state and its own RNG state "
                                       f"({_STORAGE_HELP})")
    return RunStart(decision["run_id"], ResumePoint(mine, state, decision["note"]), clear)


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
            return {"refused": refuse_previous_run(out_dir, held).args[0]}
        return {"run_id": uuid.uuid4().hex[:12], "clear": bool(held)}
    checkpoint = out_dir / CHECKPOINT_DIR / decision["name"] if resume == "auto" else path
    inside = checkpoint.resolve().parent == (out_dir / CHECKPOINT_DIR).resolve()
    theirs, ours = decision["state"].get(RUN_ID_KEY), recorded_run_id(out_dir)
    # A checkpoint continues the directory's run when the run ids agree; where either predates run ids, a
    # directory's own checkpoints are its run's (the data-order checks of check_resume_compatible still apply).
    same_run = theirs == ours if theirs and ours else inside
    run_id = theirs or uuid.uuid4().hex[:12]
    if same_run:
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
                             f"under {views[rank][0]} ({_STORAGE_HELP})"}
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
    except (FileNotFoundError, json.JSONDecodeError) as error:
        return {"error": str(error)}
    return {"name": chosen.name, "state": state, "files": _files_under(chosen), "note": note}


def load_checkpoint(accelerator: Accelerator, path: Path) -> None:
    """Restore model, optimizer, scheduler and RNG states (agree_on_start has checked every file is there)."""
    accelerator.load_state(str(path))
