"""The Triton RMSNorm kernels as `torch.library.custom_op`s, with fake (meta) implementations and autograd.

Registering them as custom ops keeps them opaque to torch.compile: Dynamo/AOTAutograd trace the fake
implementations (shapes and dtypes only) and call the real kernels at run time, so `torch.compile(fullgraph=True)`
of a model using them works, and a Triton upgrade cannot break the traced graph (torchtitan's lesson,
docs/architecture.md).

Ops (namespace `mininorm`):
  rms_norm_fwd(x, weight, eps, k) -> (y, rstd)
  rms_norm_bwd(dy, x, weight, rstd, k) -> (dx, dw)
  add_rms_norm_fwd(x, residual, weight, eps, k) -> (y, h, rstd)          h = x + residual, y = norm(h)
  add_rms_norm_bwd(dy, dh, h, weight, rstd, k, grad_dtype) -> (dsum, dw)  one gradient for x and residual
  add_rms_norm_bwd_split(dy, dh, h, weight, rstd, k, x_dtype, residual_dtype) -> (dx, dresidual, dw)

Custom ops have no autocast rule, so under torch.autocast they receive their inputs unchanged: y takes x's dtype
(h's for the residual variant), dw the weight's dtype (fp32 master weights with bf16 activations work).
Every output is a fresh tensor; no gradient the caller holds is overwritten.

The residual variant's x and residual receive the same gradient, dL/dh. When both have one dtype the backward
writes it once and hands the one tensor to both inputs, exactly as autograd's own `x + residual` does (autograd
never accumulates into a gradient it did not create, so sharing is safe); `_split` writes a second copy only
when the dtypes differ (a bf16 sublayer output on an fp32 residual stream under autocast). Gradients of unused
outputs arrive as None (materialize_grads off): an unused h costs no M x N zero tensor.
"""

from __future__ import annotations

import torch
from torch import Tensor

from model.kernels import rmsnorm_triton as kern

# --------------------------------------------------------------------------------------------- plain RMSNorm


@torch.library.custom_op("mininorm::rms_norm_fwd", mutates_args=())
def rms_norm_fwd(x: Tensor, weight: Tensor, eps: float, k: int) -> tuple[Tensor, Tensor]:
    y, _, rstd = kern.rms_norm_fwd(x, None, weight, eps, k)
    return y, rstd


@rms_norm_fwd.register_fake
def _(x: Tensor, weight: Tensor, eps: float, k: int) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape), x.new_empty(x.shape[:-1], dtype=kern.acc_dtype(x.dtype))


@torch.library.custom_op("mininorm::rms_norm_bwd", mutates_args=())
def rms_norm_bwd(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor, k: int) -> tuple[Tensor, Tensor]:
    dx, _, dw = kern.rms_norm_bwd(dy, x, weight, rstd, k)
    return dx, dw


@rms_norm_bwd.register_fake
def _(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor, k: int) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _rms_norm_setup(ctx, inputs, output) -> None:
    x, weight, _eps, k = inputs
    _y, rstd = output
    ctx.save_for_backward(x, weight, rstd)
    ctx.k = k
    ctx.mark_non_differentiable(rstd)
    ctx.set_materialize_grads(False)


def _rms_norm_backward(ctx, dy: Tensor | None, _drstd: Tensor | None):
    if dy is None:
        return None, None, None, None
    x, weight, rstd = ctx.saved_tensors
    dx, dw = torch.ops.mininorm.rms_norm_bwd(dy, x, weight, rstd, ctx.k)
    return dx, dw, None, None


rms_norm_fwd.register_autograd(_rms_norm_backward, setup_context=_rms_norm_setup)

# --------------------------------------------------------------------------------- residual add + RMSNorm


@torch.library.custom_op("mininorm::add_rms_norm_fwd", mutates_args=())
def add_rms_norm_fwd(x: Tensor, residual: Tensor, weight: Tensor, eps: float, k: int
                     ) -> tuple[Tensor, Tensor, Tensor]:
    y, h, rstd = kern.rms_norm_fwd(x, residual, weight, eps, k)
    return y, h, rstd


@add_rms_norm_fwd.register_fake
def _(x: Tensor, residual: Tensor, weight: Tensor, eps: float, k: int) -> tuple[Tensor, Tensor, Tensor]:
    dtype = torch.promote_types(x.dtype, residual.dtype)
    return (x.new_empty(x.shape, dtype=dtype), x.new_empty(x.shape, dtype=dtype),
            x.new_empty(x.shape[:-1], dtype=kern.acc_dtype(dtype)))


@torch.library.custom_op("mininorm::add_rms_norm_bwd", mutates_args=())
def add_rms_norm_bwd(dy: Tensor, dh: Tensor | None, h: Tensor, weight: Tensor, rstd: Tensor, k: int,
                     grad_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    dsum, _, dw = kern.rms_norm_bwd(dy, h, weight, rstd, k, dh=dh, dx_dtype=grad_dtype)
    return dsum, dw


@add_rms_norm_bwd.register_fake
def _(dy: Tensor, dh: Tensor | None, h: Tensor, weight: Tensor, rstd: Tensor, k: int,
      grad_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    return h.new_empty(h.shape, dtype=grad_dtype), weight.new_empty(weight.shape)


@torch.library.custom_op("mininorm::add_rms_norm_bwd_split", mutates_args=())
def add_rms_norm_bwd_split(dy: Tensor, dh: Tensor | None, h: Tensor, weight: Tensor, rstd: Tensor, k: int,
                           x_dtype: torch.dtype, residual_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    dx, dr, dw = kern.rms_norm_bwd(dy, h, weight, rstd, k, dh=dh, dx_dtype=x_dtype, dr_dtype=residual_dtype)
    return dx, dr, dw


@add_rms_norm_bwd_split.register_fake
def _(dy: Tensor, dh: Tensor | None, h: Tensor, weight: Tensor, rstd: Tensor, k: int,
      x_dtype: torch.dtype, residual_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    return (h.new_empty(h.shape, dtype=x_dtype), h.new_empty(h.shape, dtype=residual_dtype),
            weight.new_empty(weight.shape))


def _add_rms_norm_setup(ctx, inputs, output) -> None:
    x, residual, weight, _eps, k = inputs
    _y, h, rstd = output
    ctx.save_for_backward(h, weight, rstd)
    ctx.k = k
    ctx.dtypes = (x.dtype, residual.dtype)
    ctx.mark_non_differentiable(rstd)
    ctx.set_materialize_grads(False)


def _add_rms_norm_backward(ctx, dy: Tensor | None, dh: Tensor | None, _drstd: Tensor | None):
    # dL/dh_total = (norm backward of dy) + dh; it flows unchanged to both x and residual.
    x_dtype, residual_dtype = ctx.dtypes
    need_x, need_residual = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if dy is None:  # only h was used: the sum's gradient passes straight through, the weight gets none
        if dh is None:
            return None, None, None, None, None
        return ((dh.to(x_dtype) if need_x else None), (dh.to(residual_dtype) if need_residual else None),
                None, None, None)
    h, weight, rstd = ctx.saved_tensors
    if x_dtype == residual_dtype or not (need_x and need_residual):
        dsum, dw = torch.ops.mininorm.add_rms_norm_bwd(dy, dh, h, weight, rstd, ctx.k,
                                                       x_dtype if need_x else residual_dtype)
        return (dsum if need_x else None), (dsum if need_residual else None), dw, None, None
    dx, dr, dw = torch.ops.mininorm.add_rms_norm_bwd_split(dy, dh, h, weight, rstd, ctx.k, x_dtype, residual_dtype)
    return dx, dr, dw, None, None


add_rms_norm_fwd.register_autograd(_add_rms_norm_backward, setup_context=_add_rms_norm_setup)
