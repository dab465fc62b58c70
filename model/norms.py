"""Normalization layers selected by MiniNormConfig: RMSNorm, partial RMSNorm, LayerNorm, none.

Every norm computes in fp32 and casts back to the input dtype. Every norm also offers
`add_and_norm(x, residual) -> (norm(x + residual), x + residual)`, the step a pre-LN block takes between its
two sublayers; the Triton implementation fuses it into one kernel (one read of each input, one write of each
output), the others do it in two steps.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import torch.nn.functional as F
from torch import nn

from model.config import MiniNormConfig, NormImpl, NormType


def partial_size(dim: int, p: float) -> int:
    """Number of leading elements whose mean square estimates the RMS: ceil(dim * p), clamped to [1, dim]."""
    return min(dim, max(1, math.ceil(dim * p)))


def rms_norm_eager(x: torch.Tensor, weight: torch.Tensor, eps: float, k: int) -> torch.Tensor:
    """Reference (partial) RMSNorm: y = x * rsqrt(mean(x[..., :k]^2) + eps) * w, in fp32, cast back."""
    # At least fp32: half precision is upcast, fp64 stays fp64 (gradcheck and fp64 references need it).
    compute = torch.promote_types(x.dtype, torch.float32)
    x32 = x.to(compute)
    return (x32 * _rstd(x32, eps, k) * weight.to(compute)).to(x.dtype)


def _rstd(x32: torch.Tensor, eps: float, k: int) -> torch.Tensor:
    """rsqrt(mean(x[..., :k]^2) + eps), keeping the last dim (size 1) for broadcasting."""
    stats = x32 if k == x32.shape[-1] else x32[..., :k]
    return torch.rsqrt(stats.pow(2).mean(dim=-1, keepdim=True) + eps)


# ---------------------------------------------------------------------------------------------------------------
# norm_impl="compile": the CPU fast path.
#
# Compiling `rms_norm_eager` under autograd is slow: Inductor must save rstd for the backward, which splits the
# forward into three whole-tensor loops, and it computes dW as a strided column reduction over all rows. Instead an
# autograd.Function calls two compiled kernels on an (M, N) view of the input:
#   forward:  rms_norm_eager, one fused loop over the rows (rstd is not saved: only x and w are kept);
#   backward: one fused loop over the rows recomputes rstd and, with g = dy * w, xhat = x * rstd,
#             c = sum_j g_j * xhat_j / k, writes
#             dx = rstd * (g - [i < k] * xhat * c)   (= r*g - [i<k]*r^3*x*(1/k)*sum_j g_j*x_j, DESIGN.md);
#             dW = sum over rows of dy * xhat is a second loop that sums blocks of _DW_BLOCK rows into an
#             (M / _DW_BLOCK, N) partial buffer (a cache-sized working set, unlike a column reduction over all M
#             rows), then one small sum over the partials.
# Compute is fp32 (fp64 for fp64 inputs), y and dx are cast to the input dtype, dW to the weight's dtype. The row
# count is marked dynamic, so a new M reuses the compiled code; a new N, k, eps or dtype compiles once more.

_DW_BLOCK = 32  # rows per dW partial sum


def _rms_norm_bwd_kernel(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float,
                         k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dW) of the (partial) RMSNorm for (M, N) inputs, recomputing rstd from x."""
    compute = torch.promote_types(x.dtype, torch.float32)
    x32, dy32 = x.to(compute), dy.to(compute)
    m, n = x32.shape
    rstd = _rstd(x32, eps, k)
    xhat = x32 * rstd
    g = dy32 * weight.to(compute)
    c = (g * xhat).sum(dim=-1, keepdim=True) / k
    if k == n:
        dx = rstd * (g - xhat * c)
    else:
        in_stats = torch.arange(n, device=x.device) < k
        dx = rstd * (g - torch.where(in_stats, xhat * c, 0.0))
    # Zero-pad the rows to a multiple of the block (a no-op when M already is one) so that the partial sums are a
    # plain (M / B, B, N) reduction; the row count stays symbolic, so a new M does not recompile.
    partial = F.pad(dy32 * xhat, (0, 0, 0, (-m) % _DW_BLOCK)).reshape(-1, _DW_BLOCK, n).sum(dim=1)
    return dx.to(x.dtype), partial.sum(dim=0).to(weight.dtype)


@functools.cache
def _compiled_kernels():
    # Built on first use so importing the model never starts the compiler.
    # The forward is the reference formula itself; on an (M, N) view Inductor fuses it into one loop per row.
    return torch.compile(rms_norm_eager, dynamic=None), torch.compile(_rms_norm_bwd_kernel, dynamic=None)


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """(..., N) -> contiguous (M, N) with M marked dynamic, so that each new row count reuses the compiled code.
    Detached: the kernels never record autograd, and requires_grad is part of what a compiled kernel guards on."""
    rows = t.detach().reshape(-1, t.shape[-1]).contiguous()
    torch._dynamo.maybe_mark_dynamic(rows, 0)
    return rows


class _CompiledRMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, k: int) -> torch.Tensor:
        rows = _as_rows(x)
        weight = weight.detach()
        ctx.save_for_backward(rows, weight)
        ctx.eps, ctx.k = eps, k
        return _compiled_kernels()[0](rows, weight, eps, k).view(x.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy: torch.Tensor):
        rows, weight = ctx.saved_tensors
        dx, dw = _compiled_kernels()[1](_as_rows(dy), rows, weight, ctx.eps, ctx.k)
        return (dx.view(dy.shape) if ctx.needs_input_grad[0] else None,
                dw if ctx.needs_input_grad[1] else None, None, None)


def rms_norm_compiled(x: torch.Tensor, weight: torch.Tensor, eps: float, k: int) -> torch.Tensor:
    """`rms_norm_eager` computed by the compiled kernels above (same semantics, same dtypes)."""
    if torch.compiler.is_compiling():
        # Inside an outer torch.compile (e.g. of the whole model) the plain formula lets it fuse the norm with its
        # neighbours; nesting our compiled kernels there would only add graph breaks.
        return rms_norm_eager(x, weight, eps, k)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _CompiledRMSNormFn.apply(x, weight, eps, k)
    return _compiled_kernels()[0](_as_rows(x), weight.detach(), eps, k).view(x.shape)


def triton_can_run(device: torch.device) -> bool:
    """Triton kernels run on CUDA tensors, or on CPU tensors under the interpreter (TRITON_INTERPRET=1)."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_norm_impl(impl: str, device: torch.device) -> NormImpl:
    """Turn `auto` into a concrete implementation for tensors on `device`; refuse `triton` where it cannot run."""
    impl = NormImpl(impl)
    if impl == NormImpl.AUTO:
        if device.type == "cuda" and triton_can_run(device):
            return NormImpl.TRITON
        return NormImpl.COMPILE if device.type == "cpu" else NormImpl.EAGER
    if impl == NormImpl.TRITON and not triton_can_run(device):
        raise RuntimeError(
            f"norm_impl='triton' cannot run on {device.type} tensors: it needs a CUDA device with triton installed "
            "(or TRITON_INTERPRET=1 for the slow CPU interpreter); use norm_impl='auto', 'compile' or 'eager'")
    return impl


class RMSNorm(nn.Module):
    """RMSNorm (p = 1) or partial RMSNorm (p < 1: the RMS comes from the first ceil(n*p) elements,
    and all n elements are scaled)."""

    def __init__(self, dim: int, eps: float = 1e-6, p: float = 1.0, impl: str = "eager") -> None:
        super().__init__()
        if not 0.0 < p <= 1.0:
            raise ValueError(f"p={p!r} is not allowed; it must be in (0, 1]")
        self.dim, self.eps, self.p = dim, eps, p
        self.k = partial_size(dim, p)
        self.impl = NormImpl(impl)
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        impl = resolve_norm_impl(self.impl, x.device)
        if impl == NormImpl.TRITON:
            from model.kernels import rms_norm
            return rms_norm(x, self.weight, self.eps, self.p)
        if impl == NormImpl.COMPILE:
            return rms_norm_compiled(x, self.weight, self.eps, self.k)
        return rms_norm_eager(x, self.weight, self.eps, self.k)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if resolve_norm_impl(self.impl, x.device) == NormImpl.TRITON:
            from model.kernels import add_rms_norm
            return add_rms_norm(x, residual, self.weight, self.eps, self.p)
        summed = x + residual
        return self(summed), summed

    def extra_repr(self) -> str:
        partial = f", p={self.p}, k={self.k}" if self.k < self.dim else ""
        return f"{self.dim}, eps={self.eps}{partial}, impl={self.impl.value}"


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm (gain and bias) computed in fp32 and cast back to the input dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        compute = torch.promote_types(x.dtype, torch.float32)  # upcast half precision, keep fp64
        bias = None if self.bias is None else self.bias.to(compute)
        return F.layer_norm(x.to(compute), self.normalized_shape, self.weight.to(compute), bias,
                            self.eps).to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        summed = x + residual
        return self(summed), summed


class NoNorm(nn.Identity):
    """The no-normalization ablation: identity."""

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        summed = x + residual
        return summed, summed


def build_norm(config: MiniNormConfig, dim: int) -> nn.Module:
    """The norm the config asks for, over the last dimension of size `dim`."""
    norm_type = NormType(config.norm_type)
    if norm_type == NormType.RMSNORM:
        return RMSNorm(dim, config.norm_eps, 1.0, config.norm_impl)
    if norm_type == NormType.PRMSNORM:
        return RMSNorm(dim, config.norm_eps, config.prms_p, config.norm_impl)
    if norm_type == NormType.LAYERNORM:
        return LayerNorm(dim, eps=config.norm_eps)
    return NoNorm()
