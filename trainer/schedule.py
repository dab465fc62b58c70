"""Learning-rate schedule: linear warmup, then cosine decay to a floor, stepped once per optimizer step."""

from __future__ import annotations

import math

import torch


def lr_multiplier(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Factor on the peak learning rate before optimizer step `step` (0-based)."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_cosine(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int,
                  min_ratio: float) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_multiplier(step, warmup_steps, total_steps, min_ratio))
