"""The fused RMSNorm kernels compile for NVIDIA GPUs, on this CPU-only machine, as our launcher would call them.

The interpreter tests (test_kernels.py) check what the kernels compute; they cannot show that the Triton compiler
accepts them for a GPU, since the interpreter runs programs the compiler rejects. Here triton's bundled NVPTX
backend and ptxas build the real cubins (model/kernels/cuda_build.py), for the row lengths of the issue's GPU
table, and ptxas's report holds the launch heuristics to their promise: no register spills except in the
backward at N = 16384 (documented in rmsnorm_triton.block_config and the README).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from triton.runtime.driver import driver  # noqa: E402

from model.kernels import cuda_build, rmsnorm_triton  # noqa: E402


@pytest.fixture(autouse=True)
def _compiled_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.mark.parametrize("n", [96, 512, 768, 1024, 2048, 4096, 8192, 16384])
@pytest.mark.parametrize("residual", [False, True], ids=["rmsnorm", "add_prmsnorm"])
def test_kernels_build_for_hopper(n: int, residual: bool) -> None:
    fwd, bwd = cuda_build.build(n, torch.bfloat16, residual=residual, p=0.5 if residual else 1.0, arch=90)
    h100 = rmsnorm_triton.LaunchTarget(sm_count=cuda_build.H100_SMS)
    assert (fwd.block_n, fwd.block_m, fwd.num_warps) == rmsnorm_triton.block_config(n, h100)
    assert (bwd.block_n, bwd.block_m, bwd.num_warps) == rmsnorm_triton.block_config(n, h100, backward=True)
    assert fwd.spill_store_bytes == 0 and fwd.spill_load_bytes == 0, fwd
    if n <= 8192:
        assert bwd.spill_store_bytes == 0 and bwd.spill_load_bytes == 0, bwd


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_other_dtypes_and_ampere_build(dtype: torch.dtype) -> None:
    for arch in (80, 90):
        fwd, bwd = cuda_build.build(1024, dtype, residual=True, p=1.0, weight_dtype=dtype, arch=arch)
        assert fwd.spill_store_bytes == 0 and bwd.spill_store_bytes == 0, (arch, fwd, bwd)


def test_compile_only_driver_is_restored() -> None:
    before = driver._active
    cuda_build.build(96)
    assert driver._active is before


def test_build_refuses_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        cuda_build.build(96)
