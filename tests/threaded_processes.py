"""Processes of a step as threads, for unit tests of what a rollout's statistics all-reduce: `ThreadedProcesses(n)`
hands each of n threads an accelerator (`accelerator(rank)`) whose `reduce(tensor, "sum")` returns the sum over the n
threads' tensors of the same call, as accelerate's all-reduce does (every process calls it as often, with tensors of
one shape: a mismatch raises, where the real collective would fail or hang); `run(work)` calls work(rank, accelerator)
in every thread and returns their results by rank. `OneProcess` is the world of one: its reduce returns the tensor."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch


class OneProcess:
    """The accelerator of a step run as one process on the CPU: an all-reduce is the tensor itself."""

    device = torch.device("cpu")

    @staticmethod
    def reduce(tensor: torch.Tensor, reduction: str) -> torch.Tensor:
        return tensor


class ThreadedProcesses:
    def __init__(self, world: int) -> None:
        self.world = world
        self._barrier = threading.Barrier(world, timeout=60)
        self._slots: list[torch.Tensor | None] = [None] * world

    def accelerator(self, rank: int) -> Any:
        processes = self

        class _Accelerator:
            device = torch.device("cpu")
            process_index = rank
            num_processes = processes.world

            @staticmethod
            def reduce(tensor: torch.Tensor, reduction: str) -> torch.Tensor:
                assert reduction == "sum", reduction
                processes._slots[rank] = tensor.clone()
                processes._barrier.wait()  # every process's tensor of this call is in
                shapes = {slot.shape for slot in processes._slots}
                total = torch.stack(processes._slots).sum(dim=0) if len(shapes) == 1 else None
                processes._barrier.wait()  # every process has read them before the next call writes its own
                if total is None:
                    raise ValueError(f"all-reduce of tensors of other shapes: {sorted(shapes)}")
                return total

        return _Accelerator()

    def run(self, work: Callable[[int, Any], Any]) -> list[Any]:
        results: list[Any] = [None] * self.world
        errors: list[BaseException] = []

        def target(rank: int) -> None:
            try:
                results[rank] = work(rank, self.accelerator(rank))
            except BaseException as error:  # re-raised in the caller's thread
                errors.append(error)
                self._barrier.abort()  # the other threads stop waiting

        threads = [threading.Thread(target=target, args=(rank,)) for rank in range(self.world)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:  # the first that is not another thread's abort
            raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
        return results
