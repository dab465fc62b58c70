"""Build the Triton kernels for an NVIDIA GPU on a machine without one, and read their resource usage.

The triton wheel carries its whole CUDA toolchain (LLVM's NVPTX backend and NVIDIA's ptxas), so a CPU-only
machine can produce the exact cubin a GPU would load: the same kernel source, the same arguments from the same
launch planner (`rmsnorm_triton.plan_fwd` / `plan_bwd`), the same specialization. This proves, without a GPU,
that the kernels compile for the architecture (the interpreter that runs them in CI accepts programs the
compiler rejects), and it reports each launch configuration's registers per thread and spills to local memory.
It says nothing about speed: that needs the GPU (`eval/benchmarks/bench_norm.py`).
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver

from model.kernels import rmsnorm_triton as kern
from model.norms import partial_size

if TYPE_CHECKING:
    from triton.compiler import CompiledKernel

H100_SMS = 132  # streaming multiprocessors of an H100 SXM; only the backward grid depends on it


@dataclass(frozen=True)
class KernelResources:
    """One compiled kernel configuration, as ptxas reports it (per thread)."""

    kernel: str  # "forward" or "backward"
    n: int
    block_n: int
    block_m: int
    num_warps: int
    stages: int  # software-pipeline stages of the backward's row loop (1 for the forward, which has no loop)
    registers: int
    spill_store_bytes: int
    spill_load_bytes: int
    shared_bytes: int  # static + dynamic shared memory per program
    barriers: int  # bar.sync instructions in the PTX (each a whole-program wait)
    async_copies: int  # cp.async instructions in the PTX (a software-pipelined loop issues them)


class _CompileOnlyDriver:
    """The part of triton's driver interface that `JITFunction.warmup` uses: a target, a device and a stream.

    Warmup compiles (and caches) the kernel for the target without loading it, so no GPU or CUDA driver is needed.
    """

    def __init__(self, arch: int) -> None:
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


@contextlib.contextmanager
def _compile_only(arch: int) -> Iterator[None]:
    previous = driver._active  # None until something asked for the real driver; restored as it was
    driver.set_active(_CompileOnlyDriver(arch))
    try:
        yield
    finally:
        driver.set_active(previous)


def compile_launch(kernel_body: Callable[..., Any], launch: kern.KernelLaunch, arch: int) -> CompiledKernel:
    """Compile `kernel_body` (an undecorated kernel function) for sm_<arch> exactly as `launch` would run it."""
    if kern._interpreting():
        raise RuntimeError("TRITON_INTERPRET=1 is set: the interpreter compiles nothing; unset it to build for CUDA")
    jitted = kern.jit(kernel_body)  # a fresh JITFunction: its compile cache is keyed by the fake device 0
    with _compile_only(arch):
        return jitted.warmup(*launch.args, grid=launch.grid, **launch.options)


def compiled_variants(kernel_body: Callable[..., Any], launches: list[kern.KernelLaunch], arch: int = 90) -> int:
    """How many distinct binaries one JIT function compiles for `launches` (1 when they differ only in what it
    does not specialize on, such as the row count)."""
    if kern._interpreting():
        raise RuntimeError("TRITON_INTERPRET=1 is set: the interpreter compiles nothing; unset it to build for CUDA")
    jitted = kern.jit(kernel_body)
    with _compile_only(arch):
        for launch in launches:
            jitted.warmup(*launch.args, grid=launch.grid, **launch.options)
        return len(jitted.device_caches[0][0])


def _ptx_counts(ptx: str) -> dict[str, int]:
    return {"barriers": len(re.findall(r"\b(?:bar|barrier)\.sync\b", ptx)),
            "async_copies": len(re.findall(r"\bcp\.async\.(?:ca|cg)\b", ptx))}


def _ptxas_report(ptx: str, arch: int) -> dict[str, int]:
    from triton.backends.nvidia.compiler import get_ptxas  # the ptxas triton itself uses for this arch

    gpu_name = re.search(r"^\.target\s+(sm_\w+)", ptx, re.MULTILINE).group(1)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        out = subprocess.run([get_ptxas(arch).path, "-v", "--gpu-name", gpu_name, str(src), "-o", str(src) + ".o"],
                             capture_output=True, text=True, check=True).stderr
    stores, loads = map(int, re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out).groups())
    registers = int(re.search(r"Used (\d+) registers", out).group(1))
    return {"registers": registers, "spill_store_bytes": stores, "spill_load_bytes": loads}


def build(n: int, dtype: torch.dtype = torch.bfloat16, *, residual_dtype: torch.dtype | None = None,
          p: float = 1.0, weight_dtype: torch.dtype = torch.float32, arch: int = 90, sm_count: int = H100_SMS,
          rows: int = 2048, tuning: kern.LaunchTuning = kern.DEFAULT_TUNING
          ) -> tuple[KernelResources, KernelResources]:
    """Compile the forward and backward launches for rows of n elements and return their resources.

    `residual_dtype` builds the fused residual variant: forward x + residual; backward with dh, and a second
    gradient store when the residual's dtype differs from x's (a bf16 sublayer output on an fp32 residual stream,
    the autocast case: h, y and the norm's input are then fp32). Tensors are allocated on the CPU but never read:
    only their dtypes, strides and alignment reach the compiler. `rows` only has to be large enough for a
    realistic backward grid (several rows per program). `tuning` overrides the launch heuristics as the GPU
    sweep does.
    """
    target = kern.LaunchTarget(sm_count=sm_count)
    k = partial_size(n, p)
    x = torch.empty(rows, n, dtype=dtype)
    weight = torch.empty(n, dtype=weight_dtype)
    residual = torch.empty(rows, n, dtype=residual_dtype) if residual_dtype is not None else None
    _, h, rstd, fwd_launch = kern.plan_fwd(x, residual, weight, 1e-6, k, target, tuning)
    normed = x if h is None else h
    split = residual_dtype is not None and residual_dtype != dtype
    _, _, _, bwd_launch = kern.plan_bwd(torch.empty_like(normed), normed, weight, rstd, k,
                                        dh=torch.empty_like(normed) if residual is not None else None,
                                        dx_dtype=dtype, dr_dtype=residual_dtype if split else None,
                                        target=target, tuning=tuning)
    results = []
    for name, body, launch in (("forward", kern._rms_norm_fwd_kernel, fwd_launch),
                               ("backward", kern._rms_norm_bwd_kernel, bwd_launch)):
        compiled = compile_launch(body, launch, arch)
        results.append(KernelResources(
            kernel=name, n=n, block_n=launch.options["BLOCK_N"], block_m=launch.options["BLOCK_M"],
            num_warps=launch.options["num_warps"], stages=launch.options.get("NUM_STAGES", 1),
            shared_bytes=compiled.metadata.shared,
            **_ptxas_report(compiled.asm["ptx"], arch), **_ptx_counts(compiled.asm["ptx"])))
    return results[0], results[1]
