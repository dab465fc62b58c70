"""A machine of 1 MiB, for the tests of the memory refusals the trainer, the benchmarks and the studies make before
their work: each asks trainer/memory.py's past_memory, which reads trainer/machine.py's device_memory_bytes."""

from __future__ import annotations

import pytest

from trainer import memory

FAKE_MEMORY = (2 ** 20, "a fake 1 MiB memory")  # (bytes, where), as device_memory_bytes gives them


def fake_memory(monkeypatch: pytest.MonkeyPatch, total: tuple[int, str] | None = FAKE_MEMORY) -> None:
    """Every device has `total` memory (None: unknown, so no check refuses), for every memory check."""
    monkeypatch.setattr(memory, "device_memory_bytes", lambda device: total)
