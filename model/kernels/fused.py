"""Fused RMSNorm / partial RMSNorm Triton kernels (forward + backward), optionally fused with the residual add.

Public API (differentiable with respect to every tensor input; torch.compile-friendly custom ops):
  rms_norm(x, weight, eps, p=1.0) -> y
  add_rms_norm(x, residual, weight, eps, p=1.0) -> (y, h)     h = x + residual, y = rmsnorm(h)

The kernels run on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1 (slow; for tests). Importing this
module imports triton; `model.norms` imports it only when `norm_impl` resolves to "triton".
"""

from __future__ import annotations

import torch

from model.kernels import rmsnorm_ops  # noqa: F401  (registers the torch.ops.mininorm.* custom ops)
from model.kernels.rmsnorm_triton import MAX_N
from model.rmsnorm_math import check_p, partial_size

__all__ = ["MAX_N", "add_rms_norm", "rms_norm"]


def _k(n: int, p: float) -> int:
    return partial_size(n, check_p(p))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, p: float = 1.0) -> torch.Tensor:
    """(Partial) RMSNorm over the last dim: y = x * rsqrt(mean(x[..., :k]^2) + eps) * w, k = ceil(n*p).

    Statistics in fp32; y has x's dtype; weight may have another dtype (its gradient keeps it)."""
    y, _rstd = torch.ops.mininorm.rms_norm_fwd(x, weight, float(eps), _k(x.shape[-1], p))
    return y


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, p: float = 1.0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + residual; y = rms_norm(h). Returns (y, h), both in the promoted dtype of x and residual,
    from one read of each input and one write of each output; y equals rms_norm(h) exactly."""
    y, h, _rstd = torch.ops.mininorm.add_rms_norm_fwd(x, residual, weight, float(eps), _k(x.shape[-1], p))
    return y, h
