"""What an objective logs for one optimizer step, as the training core computes it: each micro-batch's statistic
sums (the second value of `objective.loss`), summed over the step and divided by the step's units (count_items
summed), keyed by the objective's stat_names."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def logged_step_stats(objective: Any, model: torch.nn.Module, micro_batches: Sequence[dict]) -> dict[str, float]:
    """The step's logged statistics over `micro_batches` (one process's share of the step)."""
    units = sum(objective.count_items(batch) for batch in micro_batches)
    sums = sum(objective.loss(model, batch, units)[1] for batch in micro_batches)
    return dict(zip(objective.stat_names, (sums / units).tolist()))
