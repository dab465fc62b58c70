"""One timed optimizer step of a `Trainer`: what the benchmarks interleave (eval/benchmarks/bench_train.py,
bench_norm_variants.py) to compare variants side by side in one process."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch


def timed_step(trainer: Any) -> Callable[[], float]:
    """A function that runs one `trainer.train_step` on the next training batch (starting the loader over when it
    runs out) and returns the step's seconds, the device synchronized on CUDA. Loading the batch is not timed."""
    batches = iter(trainer.train_loader)

    def step() -> float:
        nonlocal batches
        try:
            batch = next(batches)
        except StopIteration:
            batches = iter(trainer.train_loader)
            batch = next(batches)
        started = time.perf_counter()
        trainer.train_step([batch])
        if trainer.accelerator.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - started

    return step
