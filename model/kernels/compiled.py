"""norm_impl="compile": the CPU fast path of (partial) RMSNorm.

Compiling `rms_norm_eager` under autograd is slow: Inductor must save rstd for the backward, which splits the
forward into three whole-tensor loops, and it computes dW as a strided column reduction over all rows. Instead an
autograd.Function calls two compiled kernels on an (M, N) view of the input:
  forward:  rms_norm_eager, one fused loop over the rows (rstd is not saved: only x and w are kept);
  backward: one fused loop over the rows recomputes rstd and, with g = dy * w, xhat = x * rstd,
            c = sum_j g_j * xhat_j / k, writes
            dx = rstd * (g - [i < k] * xhat * c)   (= r*g - [i<k]*r^3*x*(1/k)*sum_j g_j*x_j, docs/architecture.md);
            dW = sum over rows of dy * xhat is a second loop that sums blocks of _DW_BLOCK rows into an
            (M / _DW_BLOCK, N) partial buffer (a cache-sized working set, unlike a column reduction over all M
            rows), then one small sum over the partials.
Compute is fp32 (fp64 for fp64 inputs), y and dx are cast to the input dtype, dW to the weight's dtype. The row
count is marked dynamic, so a new M reuses the compiled code; a new N, k, eps or dtype compiles once more.
"""

from __future__ import annotations

import functools
import sysconfig
from pathlib import Path

import torch
import torch.nn.functional as F

from model.rmsnorm_math import rms_norm_eager, rms_norm_input_grad, rstd

_DW_BLOCK = 32  # rows per dW partial sum


def _rms_norm_bwd_kernel(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float,
                         k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dW) of the (partial) RMSNorm for (M, N) inputs, recomputing rstd from x."""
    compute = torch.promote_types(x.dtype, torch.float32)
    x32, dy32 = x.to(compute), dy.to(compute)
    m, n = x32.shape
    dx, xhat = rms_norm_input_grad(dy32, x32, weight.to(compute), rstd(x32, eps, k), k)
    # Zero-pad the rows to a multiple of the block (a no-op when M already is one) so that the partial sums are a
    # plain (M / B, B, N) reduction; the row count stays symbolic, so a new M does not recompile.
    partial = F.pad(dy32 * xhat, (0, 0, 0, (-m) % _DW_BLOCK)).reshape(-1, _DW_BLOCK, n).sum(dim=1)
    return dx.to(x.dtype), partial.sum(dim=0).to(weight.dtype)


@functools.cache
def cpu_compile_problem() -> str | None:
    """What keeps torch.compile from building CPU code on this machine, or None (checked once per process): Inductor
    builds C++ that includes Python's C headers, with its C++ compiler (g++ unless configured otherwise); without
    either, the first compiled call ended in an InductorError traceback. Minimal Debian and Ubuntu machines lack
    both (build-essential, python3-dev)."""
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        get_cpp_compiler()
    # InvalidCxxCompiler on Linux; on Windows a RuntimeError where cl is missing: either way nothing builds
    except Exception:
        return "Inductor finds no C++ compiler (g++; on Debian and Ubuntu: apt install g++)"
    header = Path(sysconfig.get_path("include")) / "Python.h"
    if not header.is_file():
        return f"Python's C headers are missing ({header}; on Debian and Ubuntu: apt install python3-dev)"
    return None


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
