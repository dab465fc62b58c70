"""The machine: what it is and what it runs fast.

`machine_line()` names the machine a measurement ran on (CPU model and the flags that decide its speed: AVX2,
AVX512, AVX512-BF16, AMX; the GPU if any, torch's version and threads, the date); benchmarks and studies print it
with every table. The trainer's hardware-dependent defaults live here too: the precision `--dtype auto` stands for
and whether `--compile auto` compiles; and how much memory it has (`device_memory_bytes`: the GPU's, else the
smallest of MemTotal, RLIMIT_AS and a cgroup's limit), which trainer/memory.py compares a run's largest tensor
with."""

from __future__ import annotations

import datetime
import os
import platform
from pathlib import Path
from typing import Any

import torch

from trainer.cgroups import CGROUP_ROOT, SELF_CGROUP, V2, own_group_files, read_limit_text

CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def machine_line() -> str:
    cpuinfo = _cpuinfo()
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")),
                 platform.processor() or platform.machine())
    words = set(cpuinfo.split())
    flags = ", ".join(f"{flag} {'yes' if flag in words else 'no'}" for flag in CPU_FLAGS)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"{os.cpu_count()} CPUs"
    return (f"{model} ({device}; {flags}), torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
            f"{datetime.date.today().isoformat()}")


def cpu_has_fast_bf16() -> bool:
    """bf16 matmuls are fast only with AMX or AVX512-BF16; on AVX2-only CPUs bf16 autocast runs ~30x slower
    than fp32 (measured on our AMD EPYC development machine)."""
    flags = set(_cpuinfo().split())
    return "amx_bf16" in flags or "avx512_bf16" in flags


def resolve_dtype(dtype: str) -> str:
    """The training precision `--dtype auto` stands for on this machine: bf16 on a CUDA GPU that supports it,
    else fp16 (with loss scaling) on CUDA; on CPU bf16 where it is fast (AMX/AVX512-BF16), else fp32."""
    if dtype != "auto":
        return dtype
    if torch.cuda.is_available():
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return "bfloat16" if cpu_has_fast_bf16() else "float32"


# Whole-model compile costs a one-time 25-55 s on our 2-core CPUs and saves 10-50% of every step after it
# (docs/benchmarks.md): it pays once a run is long enough, and short runs (smoke tests, tests) stay eager.
COMPILE_AUTO_MIN_STEPS = 1000
COMPILE_AUTO_MIN_BUDGET_S = 600  # the same rule for a run on --time_budget_s


def compile_options(device: torch.device, gradient_checkpointing: bool) -> dict[str, Any]:
    """Inductor's options for the trainer's whole-model compile. On CPU its C++ wrapper: each graph's kernels and
    the code that calls them build as one C++ module, where the Python wrapper builds one per kernel (a 2-layer
    model: 13 modules built against 40): a 60-step compiled run's command took a quarter less CPU time and its steps
    ~4% less (docs/benchmarks.md, "The C++ wrapper on CPU"). Not with gradient checkpointing: torch 2.13's C++
    wrapper has no call for the recomputation's RNG-state op (an InductorError at the first step). On a GPU,
    Inductor's defaults (the C++ wrapper has not been measured there)."""
    if device.type != "cpu" or gradient_checkpointing:
        return {}
    return {"cpp_wrapper": True}


def compile_problem(device: torch.device) -> str | None:
    """What keeps torch.compile from building the model on `device`, or None: on CPU, a missing C++ compiler or
    Python's C headers (model/kernels/compiled.py, cpu_compile_problem); on a GPU, None (Triton's needs are not
    checked)."""
    from model.kernels.compiled import cpu_compile_problem

    return cpu_compile_problem() if device.type == "cpu" else None


def compile_enabled(mode: str, total_steps: int, time_budget_s: float = 0.0) -> bool:
    """Whether `--compile auto|on|off` compiles the model for a run of `total_steps` optimizer steps (or, on a
    time budget, of `time_budget_s` seconds). auto: on from COMPILE_AUTO_MIN_STEPS steps or
    COMPILE_AUTO_MIN_BUDGET_S seconds, on any device."""
    if mode != "auto":
        return mode == "on"
    if time_budget_s > 0:
        return time_budget_s >= COMPILE_AUTO_MIN_BUDGET_S
    return total_steps >= COMPILE_AUTO_MIN_STEPS


MEMINFO = Path("/proc/meminfo")
# A control group's memory limit file: cgroup v2's memory.max ("max": none), v1's memory/memory.limit_in_bytes (no
# limit reads as a number past any machine's memory)
CGROUP_MEMORY_FILES = ((V2, "memory.max"), ("memory", "memory.limit_in_bytes"))


def cgroup_memory_limit_files(self_cgroup: Path = SELF_CGROUP, root: Path = CGROUP_ROOT) -> tuple[Path, ...]:
    """The memory limit files of this process's control group and of each group above it, v2's and v1's
    (trainer/cgroups.py says which groups)."""
    return own_group_files(CGROUP_MEMORY_FILES, self_cgroup, root)


def physical_memory_bytes(meminfo: Path = MEMINFO) -> int | None:
    """This machine's physical memory in bytes: /proc/meminfo's MemTotal (Linux), else the pages the C library
    counts; None where neither says."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024  # the kernel writes it in kB (KiB)
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return None


def _cgroup_limit(path: Path) -> int | None:
    """The memory limit a cgroup file holds in bytes; None where it sets none ("max", absent, unreadable)."""
    text = read_limit_text(path)
    return int(text) if text is not None and text.isdigit() and int(text) > 0 else None


def process_memory_bytes(meminfo: Path = MEMINFO,
                         cgroup_limits: tuple[Path, ...] | None = None) -> tuple[int, str] | None:
    """All the memory this process can hold, and what says so: the smallest of the machine's physical memory
    (MemTotal), the process's address-space limit (RLIMIT_AS, `ulimit -v`) and its control group's memory limit
    (a container's, a batch job's: `cgroup_limits`, else its group's and those above it, cgroup_memory_limit_files),
    each where set; None where none is known. Past the smallest, an allocation fails or the kernel kills the
    process, whatever the others allow."""
    limits = []
    physical = physical_memory_bytes(meminfo)
    if physical is not None:
        limits.append((physical, "this machine's physical memory (MemTotal)"))
    try:
        import resource
    except ImportError:  # not POSIX: no rlimits
        resource = None
    if resource is not None:
        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft != resource.RLIM_INFINITY:
            limits.append((soft, "this process's address-space limit (RLIMIT_AS)"))
    for path in cgroup_memory_limit_files() if cgroup_limits is None else cgroup_limits:
        limit = _cgroup_limit(path)
        if limit is not None:
            limits.append((limit, f"this process's cgroup memory limit ({path})"))
    return min(limits, key=lambda limit: limit[0]) if limits else None  # on a tie, the first: MemTotal


def device_memory_bytes(device: torch.device) -> tuple[int, str] | None:
    """All the memory a tensor on `device` can live in, and where that was read: a CUDA GPU's total memory (not what
    is free now: other processes' use changes), else what this process can hold (process_memory_bytes); None where
    unknown."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory, f"{device}'s total memory"
    return process_memory_bytes()
