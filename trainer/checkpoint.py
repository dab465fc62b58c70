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
from trainer.run_dir import STATE_FILE, checkpoint_name, checkpoint_step


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


def load_checkpoint(accelerator: Accelerator, path: Path) -> dict[str, Any]:
    """Restore model, optimizer, scheduler and RNG states; return the trainer state saved with them."""
    state_file = path / STATE_FILE
    if not state_file.is_file():
        raise FileNotFoundError(f"--resume {path}: not a complete checkpoint (no {STATE_FILE})")
    accelerator.load_state(str(path))
    return json.loads(state_file.read_text())
