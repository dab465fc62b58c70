"""(Partial) RMSNorm as plain functions: the allowed range of p, the partial size k, and the reference formula.
Also the exact fraction of a count that a decimal gives (`floor_fraction`: Mix-LN's number of post-LN blocks),
which shares partial_size's exact decimal arithmetic.

One owner for these facts: the config's validation (model/config.py), the norm modules (model/norms.py), the
compiled path (model/kernels/compiled.py) and the Triton kernels' API (model/kernels/fused.py) all use them.
The math, forward and backward, is in docs/architecture.md ("The norms, exactly").
"""

from __future__ import annotations

import numbers

import torch

from dataset.shown_value import shown_value


# p's range, (P_RANGE[0], P_RANGE[1]]: a share of the row, the whole of it at most, and more than none (a flag of a
# tool that times the norm takes the same range: trainer/cli.py's float_within(*P_RANGE, above_low=True)).
P_RANGE = (0.0, 1.0)


def check_p(p: float, field: str = "p") -> float:
    """`p` as a float; a ValueError naming `field` unless it is a number in P_RANGE, (0, 1] (a bool is not one:
    `true` in a config.json would otherwise read as p = 1)."""
    low, high = P_RANGE
    if not isinstance(p, numbers.Real) or isinstance(p, bool) or not low < float(p) <= high:
        raise ValueError(f"{field}={shown_value(p)} is not allowed; it must be a float in ({low:g}, {high:g}]")
    return float(p)


def _decimal_fraction(p: float) -> tuple[int, int]:
    """(numerator, denominator) of p's shortest decimal form, e.g. 0.07 -> (7, 100), 1e-05 -> (1, 100000).
    Plain string and integer operations, so torch.compile traces it (it cannot trace `decimal`)."""
    mantissa, _, exponent = repr(float(p)).partition("e")
    whole, _, fraction = mantissa.partition(".")
    digits = int(whole + fraction)
    scale = len(fraction) - int(exponent or 0)
    return (digits, 10**scale) if scale >= 0 else (digits * 10**-scale, 1)


def partial_size(dim: int, p: float) -> int:
    """How many leading elements estimate the RMS: k = ceil(dim * p), clamped to [1, dim].

    p is taken as the decimal it is written as and the product is exact integer arithmetic, so
    partial_size(100, 0.07) is 7 (the float product 7.000000000000001 would round up to 8)."""
    numerator, denominator = _decimal_fraction(p)
    return min(dim, max(1, -(-dim * numerator // denominator)))


def floor_fraction(count: int, fraction: float) -> int:
    """floor(count * fraction) with `fraction` taken as the decimal it is written as (exact integer arithmetic), so
    floor_fraction(100, 0.29) is 29 (the float product 28.999999999999996 would floor to 28)."""
    numerator, denominator = _decimal_fraction(fraction)
    return count * numerator // denominator


def rstd(x32: torch.Tensor, eps: float, k: int) -> torch.Tensor:
    """rsqrt(mean(x[..., :k]^2) + eps), keeping the last dim (size 1) for broadcasting."""
    stats = x32 if k == x32.shape[-1] else x32[..., :k]
    return torch.rsqrt(stats.pow(2).mean(dim=-1, keepdim=True) + eps)


def rms_norm_eager(x: torch.Tensor, weight: torch.Tensor, eps: float, k: int) -> torch.Tensor:
    """Reference (partial) RMSNorm: y = x * rsqrt(mean(x[..., :k]^2) + eps) * w, in fp32, cast back."""
    # At least fp32: half precision is upcast, fp64 stays fp64 (gradcheck and fp64 references need it).
    compute = torch.promote_types(x.dtype, torch.float32)
    x32 = x.to(compute)
    return (x32 * rstd(x32, eps, k) * weight.to(compute)).to(x.dtype)


def rms_norm_input_grad(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, r: torch.Tensor,
                        k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward of y = x * r * w with respect to x, in the dtype of its (fp32 or fp64) arguments.

    With xhat = x * r, g = dy * w and c = sum_j g_j * xhat_j / k:  dx = r * (g - [i < k] * xhat * c)
    (docs/architecture.md). `r` is rstd with its last dim kept. Returns (dx, xhat); the weight's gradient is the sum
    over rows of dy * xhat, which each caller reduces in its own order.
    """
    xhat = x * r
    g = dy * weight
    c = (g * xhat).sum(dim=-1, keepdim=True) / k
    n = x.shape[-1]
    if k == n:
        return r * (g - xhat * c), xhat
    in_stats = torch.arange(n, device=x.device) < k
    return r * (g - torch.where(in_stats, xhat * c, 0.0)), xhat
