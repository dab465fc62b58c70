"""Normalization layers selected by MiniNormConfig: RMSNorm, partial RMSNorm, LayerNorm, Dynamic Tanh, none.

Every norm computes in fp32 and casts back to the input dtype. With `affine=False` (the config's norm_affine) a
norm has no gain and no bias (DyT keeps its alpha). Every norm also offers
`add_and_norm(x, residual) -> (norm(x + residual), x + residual)`, the step a pre-LN block takes between its
two sublayers; the Triton implementation fuses it into one kernel (one read of each input, one write of each
output), the others do it in two steps. The formula itself and pRMSNorm's rules for p are in
model/rmsnorm_math.py, the fast implementations that `norm_impl` selects in model/kernels/, the math in
docs/architecture.md.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from model.config import MiniNormConfig, NormImpl, NormType
from model.kernels.compiled import cpu_compile_problem, rms_norm_compiled
from model.rmsnorm_math import check_p, partial_size, rms_norm_eager

# partial_size and rms_norm_eager are defined in model/rmsnorm_math.py and re-exported here, where users find them.
__all__ = ["DyT", "LayerNorm", "NoNorm", "RMSNorm", "build_norm", "partial_size", "resolve_norm_impl",
           "rms_norm_eager", "triton_can_run"]


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
    """Turn `auto` into a concrete implementation for tensors on `device` (triton on CUDA, compile on a CPU that can
    build it, else eager); refuse `triton` where it cannot run."""
    impl = NormImpl(impl)
    if impl == NormImpl.AUTO:
        if device.type == "cuda" and triton_can_run(device):
            return NormImpl.TRITON
        if device.type != "cpu":
            return NormImpl.EAGER
        # Inside an outer torch.compile its build tools are there (and compile is the plain formula there): the
        # check is not traced. Otherwise a CPU without them (cpu_compile_problem) runs the eager formula.
        return NormImpl.COMPILE if torch.compiler.is_compiling() or cpu_compile_problem() is None else NormImpl.EAGER
    if impl == NormImpl.TRITON and not triton_can_run(device):
        raise RuntimeError(
            f"norm_impl='triton' cannot run on {device.type} tensors: it needs a CUDA device with triton installed "
            "(or TRITON_INTERPRET=1 for the slow CPU interpreter); use norm_impl='auto', 'compile' or 'eager'")
    return impl


class RMSNorm(nn.Module):
    """RMSNorm (p = 1) or partial RMSNorm (p < 1: the RMS comes from the first ceil(n*p) elements,
    and all n elements are scaled)."""

    def __init__(self, dim: int, eps: float = 1e-6, p: float = 1.0, impl: str = "eager", affine: bool = True) -> None:
        super().__init__()
        check_p(p)
        self.dim, self.eps, self.p = dim, eps, p
        self.k = partial_size(dim, p)
        self.impl = NormImpl(impl)
        if affine:
            self.weight = nn.Parameter(torch.ones(dim))
        else:
            self.register_parameter("weight", None)

    def _gain(self, x: torch.Tensor) -> torch.Tensor:
        # Parameter-free: a gain of exact ones (x * 1.0 == x), so every implementation below serves both variants.
        # Made per call, not kept as a buffer: from_pretrained would leave a non-persistent buffer uninitialised.
        return self.weight if self.weight is not None else torch.ones(self.dim, device=x.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        impl = resolve_norm_impl(self.impl, x.device)
        if impl == NormImpl.TRITON:
            from model.kernels import rms_norm
            return rms_norm(x, self._gain(x), self.eps, self.p)
        if impl == NormImpl.COMPILE:
            return rms_norm_compiled(x, self._gain(x), self.eps, self.k)
        return rms_norm_eager(x, self._gain(x), self.eps, self.k)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if resolve_norm_impl(self.impl, x.device) == NormImpl.TRITON:
            from model.kernels import add_rms_norm
            return add_rms_norm(x, residual, self._gain(x), self.eps, self.p)
        summed = x + residual
        return self(summed), summed

    def extra_repr(self) -> str:
        partial = f", p={self.p}, k={self.k}" if self.k < self.dim else ""
        affine = ", affine=False" if self.weight is None else ""
        return f"{self.dim}, eps={self.eps}{partial}{affine}, impl={self.impl.value}"


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm (gain and bias, or neither with elementwise_affine=False) computed in fp32 and cast back to the
    input dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        compute = torch.promote_types(x.dtype, torch.float32)  # upcast half precision, keep fp64
        weight = None if self.weight is None else self.weight.to(compute)
        bias = None if self.bias is None else self.bias.to(compute)
        return F.layer_norm(x.to(compute), self.normalized_shape, weight, bias, self.eps).to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        summed = x + residual
        return self(summed), summed


class DyT(nn.Module):
    """Dynamic Tanh (Zhu et al., CVPR 2025): y = w * tanh(alpha * x) + b, alpha a learnable scalar.

    alpha starts at `alpha_init`, w at ones and b at zeros; with affine=False only alpha remains. Computed in fp32
    (fp64 stays fp64) and cast back, like the norms. An elementwise map, so every norm_impl runs this one eager
    formula: there is no reduction for a fused kernel to save.
    """

    def __init__(self, dim: int, alpha_init: float = 0.5, affine: bool = True) -> None:
        super().__init__()
        self.dim, self.alpha_init = dim, alpha_init
        self.alpha = nn.Parameter(torch.full((1,), float(alpha_init)))
        if affine:
            self.weight = nn.Parameter(torch.ones(dim))
            self.bias = nn.Parameter(torch.zeros(dim))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        compute = torch.promote_types(x.dtype, torch.float32)
        y = torch.tanh(self.alpha.to(compute) * x.to(compute))
        if self.weight is not None:
            y = y * self.weight.to(compute) + self.bias.to(compute)
        return y.to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        summed = x + residual
        return self(summed), summed

    def extra_repr(self) -> str:
        return f"{self.dim}, alpha_init={self.alpha_init}" + (", affine=False" if self.weight is None else "")


class NoNorm(nn.Identity):
    """The no-normalization ablation: identity."""

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        summed = x + residual
        return summed, summed


def build_norm(config: MiniNormConfig, dim: int) -> nn.Module:
    """The norm the config asks for, over the last dimension of size `dim`."""
    norm_type = NormType(config.norm_type)
    affine = config.norm_affine
    if norm_type == NormType.RMSNORM:
        return RMSNorm(dim, config.norm_eps, 1.0, config.norm_impl, affine)
    if norm_type == NormType.PRMSNORM:
        return RMSNorm(dim, config.norm_eps, config.prms_p, config.norm_impl, affine)
    if norm_type == NormType.LAYERNORM:
        return LayerNorm(dim, eps=config.norm_eps, elementwise_affine=affine)
    if norm_type == NormType.DYT:
        return DyT(dim, config.dyt_alpha_init, affine)
    return NoNorm()
