"""The fast implementations behind `norm_impl` (model/norms.py picks one; the reference formula and the p rules
are in model/rmsnorm_math.py, the math in docs/architecture.md, the kernel notes in docs/kernels.md):

  compiled.py        norm_impl="compile": an autograd.Function over two torch.compile'd kernels (the CPU path)
  fused.py           norm_impl="triton": rms_norm / add_rms_norm, the differentiable API of the Triton kernels
  rmsnorm_triton.py  the Triton kernels and their launch planning
  rmsnorm_ops.py     their torch.library custom ops (torch.compile-safe)
  cuda_build.py      compiles the real launches for sm_80 / sm_90 without a GPU (the resource report)
  dtypes.py          the short dtype names (fp32, bf16, fp16) the kernel tools take

`from model.kernels import rms_norm, add_rms_norm, MAX_N` loads fused.py (and so triton) on first use: importing
this package, or the compiled path, never needs triton.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MAX_N", "add_rms_norm", "rms_norm"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from model.kernels import fused
        return getattr(fused, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
