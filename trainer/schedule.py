"""Learning-rate schedules, stepped once per optimizer step: linear warmup, then either cosine decay to a floor
or warmup-stable-decay (WSD: the peak held, then a linear decay to the floor over the last `decay_fraction` of the
run). The factor multiplies every param group's own peak lr (AdamW's and Muon's alike)."""

from __future__ import annotations

import math
from collections.abc import Callable
from enum import StrEnum

import torch


class LRSchedule(StrEnum):
    COSINE = "cosine"
    WSD = "wsd"


def lr_multiplier(step: int, warmup_steps: int, total_steps: int, min_ratio: float, schedule: str,
                  decay_fraction: float) -> float:
    """Factor on the peak learning rate before optimizer step `step` (0-based). No defaults here: the trainer's
    flags own them (--lr_schedule, --decay_fraction; trainer/arg_fields.py)."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if LRSchedule(schedule) is LRSchedule.WSD:
        decay_steps = max(1, round(decay_fraction * total_steps))
        decay_start = max(warmup_steps, total_steps - decay_steps)
        if step < decay_start:
            return 1.0
        progress = min(1.0, (step - decay_start + 1) / max(1, total_steps - decay_start))
        return 1.0 - (1.0 - min_ratio) * progress
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_note(warmup_steps: int, total_steps: int) -> str | None:
    """The line a run prints when its --warmup_steps is not shorter than the run (build_scheduler cuts the warmup to
    the run, so the rate climbs all run, never reaching its peak nor decaying); None otherwise."""
    if warmup_steps < total_steps:
        return None
    return (f"note: --warmup_steps {warmup_steps} is not shorter than the run's {total_steps} optimizer steps: the "
            f"learning rate rises all run, to {total_steps}/{total_steps + 1} of its peak at the last step, and "
            f"never decays; a --warmup_steps below {total_steps} reaches the peak")


def build_scheduler(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int | Callable[[], int],
                    min_ratio: float, schedule: str, decay_fraction: float) -> torch.optim.lr_scheduler.LambdaLR:
    """`total_steps` may be a callable, read at every step: a run on a time budget plans its length after a few
    steps and re-plans it as its pace changes (trainer/budget.py). Warmup never runs past the end."""
    def total() -> int:
        return total_steps() if callable(total_steps) else total_steps

    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_multiplier(step, min(warmup_steps, total()), total(), min_ratio, schedule,
                                              decay_fraction))
