"""A machine of 1 MiB, for the tests of the memory refusals the trainer and the benchmarks make before their work
(trainer/machine.py's device_memory_bytes, as each module imported it)."""

from __future__ import annotations

from typing import Any

import pytest

FAKE_MEMORY = (2 ** 20, "a fake 1 MiB memory")  # (bytes, where), as device_memory_bytes gives them


def fake_memory(monkeypatch: pytest.MonkeyPatch, module: Any) -> None:
    """`module`'s device_memory_bytes says FAKE_MEMORY, whatever the device."""
    monkeypatch.setattr(module, "device_memory_bytes", lambda device: FAKE_MEMORY, raising=False)
