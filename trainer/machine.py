"""One line naming the machine a measurement ran on: CPU model and the flags that decide its speed (AVX2,
AVX512, AVX512-BF16, AMX), the GPU if any, torch's version and threads, the date. Benchmarks and studies print it
with every table."""

from __future__ import annotations

import datetime
import os
import platform
from pathlib import Path

import torch

CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def machine_line() -> str:
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")),
                 platform.processor() or platform.machine())
    words = set(cpuinfo.split())
    flags = ", ".join(f"{flag} {'yes' if flag in words else 'no'}" for flag in CPU_FLAGS)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"{os.cpu_count()} CPUs"
    return (f"{model} ({device}; {flags}), torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
            f"{datetime.date.today().isoformat()}")
