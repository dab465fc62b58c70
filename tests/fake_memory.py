"""A machine of 1 MiB and an allocator that fails, for the tests of the memory refusals the trainer, the
benchmarks and the studies make before their work (each asks trainer/memory.py's past_memory, which reads
trainer/machine.py's device_memory_bytes) and of the one line an allocation failing during the work ends in."""

from __future__ import annotations

import pytest

from trainer import memory

FAKE_MEMORY = (2 ** 20, "a fake 1 MiB memory")  # (bytes, where), as device_memory_bytes gives them


def fake_memory(monkeypatch: pytest.MonkeyPatch, total: tuple[int, str] | None = FAKE_MEMORY) -> None:
    """Every device has `total` memory (None: unknown, so no check refuses), for every memory check."""
    monkeypatch.setattr(memory, "device_memory_bytes", lambda device: total)


# What out_of_memory keeps of torch's CPU allocator failure below: the part every one-line refusal quotes
ALLOCATOR_SAID = "DefaultCPUAllocator: can't allocate memory: you tried to allocate 4000 bytes"


def refuse_allocation(*args: object, **kwargs: object) -> None:
    """A stand-in for a tool's work that fails as torch's CPU allocator does when the memory runs out (its message as
    torch 2.13 raises it), for the tests of the one line such a failure ends in."""
    raise RuntimeError(f"[enforce fail at alloc_cpu.cpp:127] err == 0. {ALLOCATOR_SAID}. Error code 12 (Cannot "
                       f"allocate memory)")
