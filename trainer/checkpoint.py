"""Resumable training state, written atomically.

A checkpoint is a directory `step_XXXXXXXX/` holding Accelerate's state (fp32 model weights, optimizer,
scheduler, every process's RNG states) plus `trainer_state.json` (step, data position, counters; the names are
trainer/run_dir.py's). It is written under a temporary name and renamed into place only when complete, so a save
killed midway leaves the previous checkpoint intact; `trainer_state.json` is written last and marks a checkpoint
complete.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from accelerate import Accelerator

from dataset.atomic_io import atomic_write_text
from trainer.args import TrainArgs
from trainer.run_dir import STATE_FILE, checkpoint_name, checkpoint_step

# Flags that decide which samples the training set holds and in which order: a checkpoint's data position means
# nothing under other values, so resuming with a different one is refused. (--batch_size, --accumulation_steps and
# the number of processes only group the same sample order differently: the position, counted in samples, maps.)
DATA_ORDER_FLAGS = ("max_seq_len", "seed", "val_fraction")
# Flags that decide the shapes of a LoRA run's trainable tensors: the checkpoint's adapters fit no other value.
ADAPTER_FLAGS = ("lora_rank", "lora_targets")


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if checkpoint_step(p.name) is not None and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: checkpoint_step(p.name))


def latest_checkpoint(root: Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def save_checkpoint(accelerator: Accelerator, root: Path, step: int, state: dict[str, Any], keep: int) -> Path:
    """Collective: every process calls it. Returns the checkpoint directory."""
    final = root / checkpoint_name(step)
    tmp = root / f".tmp_{checkpoint_name(step)}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        root.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp), safe_serialization=True)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        atomic_write_text(tmp / STATE_FILE, json.dumps(state, indent=2))
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
    adapters have another shape (--lora_rank, --lora_targets)."""
    saved = state.get("config", {})
    for flag in DATA_ORDER_FLAGS:
        old, new = saved.get(flag), getattr(args, flag)
        if old is not None and old != new:
            raise ValueError(f"--resume {path.name}: --{flag} was {old} there and is {new} now; the saved data "
                             f"position is only valid for the same samples in the same order (resume with "
                             f"--{flag} {old}, or start a new run)")
    for flag in ADAPTER_FLAGS:
        old, new = saved.get(flag), getattr(args, flag)
        if args.task == "lora" and old is not None and old != new:
            raise ValueError(f"--resume {path.name}: --{flag} was {old} there and is {new} now; the saved adapters "
                             f"have that shape (resume with --{flag} {old}, or start a new run)")
    old_data = state.get("data")
    same = old_data is None or {k: v for k, v in old_data.items() if k != "path"} == {
        k: v for k, v in data.items() if k != "path"}
    if not same:
        raise ValueError(f"--resume {path.name}: --data_path was {_describe(old_data)} there and is "
                         f"{_describe(data)} now; the saved data position is only valid for the same training "
                         f"data (resume with the same file, or start a new run)")


def _describe(data: dict[str, Any]) -> str:
    return f"{data['path']} ({data['train_samples']} training samples, {data['tokens']} tokens)"


def load_checkpoint(accelerator: Accelerator, path: Path) -> dict[str, Any]:
    """Restore model, optimizer, scheduler and RNG states; return the trainer state saved with them."""
    state = read_trainer_state(path)
    accelerator.load_state(str(path))
    return state
