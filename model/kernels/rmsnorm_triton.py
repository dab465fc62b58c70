"""Triton kernels for (partial) RMSNorm, optionally fused with the residual add, and their launchers.

Math (docs/architecture.md, "The norms, exactly"): for a row x of n elements, k = ceil(n*p) leading elements give the
statistic r = rsqrt(mean(x[:k]^2) + eps) (fp32); y = x * r * w, computed in fp32 and cast to the output dtype
(fp64 inputs compute in fp64, like the eager reference, so gradcheck applies).
Backward, g = dy * w:  dx_i = r*g_i - [i<k] * r^3 * x_i * (1/k) * sum_j g_j*x_j  and  dw = sum_rows dy*x*r.

Layout: each launcher sees a 2-D view [M, N] whose last dim is contiguous (rows may be strided). A program owns
BLOCK_M whole rows (BLOCK_N = next_power_of_2(N) >= N, tail masked), so every row is read once and written once.
The backward runs a fixed grid of programs over contiguous row chunks; each one writes its fp32 partial dW row to
a [programs, N] buffer that torch sums afterwards: no atomics, so dW is bit-identical run to run.

The kernel bodies are plain functions handed to `triton.jit` on first use, not at import: `triton.jit` picks the
compiled or the interpreted (TRITON_INTERPRET=1) backend when it decorates, so decorating lazily lets the same
process import this module first and switch the interpreter on later (the CPU tests do exactly that).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import triton
import triton.language as tl

from model.rmsnorm_math import rms_norm_input_grad, rstd as rstd_of

if TYPE_CHECKING:
    from triton.runtime.jit import KernelInterface

# The kernels hold a whole row in one program's registers. Up to 16384 elements that compiles without spills (the
# backward's few at 16384 aside); wider rows spilled hundreds of bytes per thread on sm_90 (612 B forward and
# 1960 B backward at 65536), so they take the PyTorch formula instead (`_rows_fwd_torch`, `_rows_bwd_torch`).
MAX_N = 16384
# Multiply-adds contract to FMAs (one rounding instead of two). Passed explicitly: triton 3.9 warns that its
# default changes to off in 3.10. The interpreter ignores the option.
FP_FUSION = True

# The kernels use only builtins of triton.language, never its @jit helpers (tl.sum, tl.zeros): those were
# decorated when triton was imported, for the backend in force then, and raise if the interpreter is switched on
# later. Sums go through tl.reduce with triton's own add combiner, which the interpreter also maps to numpy's sum.
_add = getattr(tl.standard, "_sum_combine", None)
if _add is None:  # a future triton without it: our own combiner (the interpreter then loops in Python)
    @triton.jit
    def _add(a, b):
        return a + b


def _rms_norm_fwd_kernel(
    X, R, W, Y, H, RSTD,
    M, N, K,
    stride_x, stride_r, stride_y, stride_h,
    eps, inv_k,
    HAS_RESIDUAL: tl.constexpr, PARTIAL: tl.constexpr, ACC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Every index is 2-D ([BLOCK_M, 1] rows, [1, BLOCK_N] columns), the weight included: a 1-D weight would be
    # laid out differently from the x tile and re-staged through shared memory on every program.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]
    cols = tl.arange(0, BLOCK_N)[None, :]
    row_ok = rows < M
    col_ok = cols < N
    mask = row_ok & col_ok
    rows64 = rows.to(tl.int64)  # M * stride can pass 2^31 at LLM shapes

    x = tl.load(X + rows64 * stride_x + cols, mask=mask, other=0.0).to(ACC)
    if HAS_RESIDUAL:
        res = tl.load(R + rows64 * stride_r + cols, mask=mask, other=0.0).to(ACC)
        h = (x + res).to(H.dtype.element_ty)
        tl.store(H + rows64 * stride_h + cols, h, mask=mask)
        # Normalize the rounded sum, exactly what the unfused `norm(x + residual)` sees.
        x = h.to(ACC)

    if PARTIAL:
        xs = tl.where(cols < K, x, 0.0)
        mean_sq = tl.reduce(xs * xs, 1, _add, keep_dims=True) * inv_k
    else:
        mean_sq = tl.reduce(x * x, 1, _add, keep_dims=True) * inv_k
    if ACC == tl.float64:
        rstd = 1.0 / tl.sqrt(mean_sq + eps)  # fp64 (gradcheck): sqrt is exact-rounded on every backend
    else:
        rstd = tl.rsqrt(mean_sq + eps)
    tl.store(RSTD + rows, rstd, mask=row_ok)

    # The weight is loaded through a pointer tile of x's shape (each row reads the same N values, L1 hits), so it
    # arrives in x's register layout: a [1, BLOCK_N] or 1-D load is laid out differently whenever BLOCK_M > 1
    # and would be re-staged through shared memory, with barriers, in every program.
    w = tl.load(W + (rows - rows) + cols, mask=mask, other=0.0).to(ACC)
    y = x * rstd * w
    tl.store(Y + rows64 * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


def _rms_norm_bwd_kernel(
    DY, X, W, RSTD, DH, DX, DR, DW_PARTIAL,
    M, N, K, rows_per_program,
    stride_dy, stride_x, stride_dh, stride_dx, stride_dr,
    inv_k,
    HAS_DH: tl.constexpr, HAS_DR: tl.constexpr, PARTIAL: tl.constexpr, ACC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    pid = tl.program_id(0)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    cols = tl.arange(0, BLOCK_N)[None, :]
    col_ok = cols < N
    w = tl.load(W + tl.arange(0, BLOCK_N), mask=tl.arange(0, BLOCK_N) < N, other=0.0).to(ACC)[None, :]
    dw_acc = tl.full([BLOCK_M, BLOCK_N], 0.0, ACC)

    # NUM_STAGES > 1 software-pipelines the loop: the next rows' x and dy are in flight (cp.async) while these
    # rows are computed.
    for first in tl.range(row_start, row_end, BLOCK_M, num_stages=NUM_STAGES):
        rows = first + tl.arange(0, BLOCK_M)[:, None]
        row_ok = rows < row_end
        mask = row_ok & col_ok
        rows64 = rows.to(tl.int64)
        x = tl.load(X + rows64 * stride_x + cols, mask=mask, other=0.0).to(ACC)
        dy = tl.load(DY + rows64 * stride_dy + cols, mask=mask, other=0.0).to(ACC)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)

        # In terms of xhat = x*r the formula reads  dx = r * (g - [i<k] * xhat * (1/k) * sum_j g_j*xhat_j):
        # the same value as r*g - r^3*x*mean(g*x), but r^3 (1e-51 for rows of 1e17) never underflows.
        xhat = x * rstd
        g = dy * w
        # The sum runs over all n (every element is scaled by r); only the first k elements feed r.
        c = tl.reduce(g * xhat, 1, _add, keep_dims=True) * inv_k
        corr = xhat * c
        if PARTIAL:
            corr = tl.where(cols < K, corr, 0.0)
        dx = (g - corr) * rstd
        if HAS_DH:  # the residual variant: the returned sum h also received a gradient
            dx += tl.load(DH + rows64 * stride_dh + cols, mask=mask, other=0.0).to(ACC)
        tl.store(DX + rows64 * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
        if HAS_DR:  # the residual's gradient in another dtype than x's (same values, second store)
            tl.store(DR + rows64 * stride_dr + cols, dx.to(DR.dtype.element_ty), mask=mask)
        dw_acc += dy * xhat

    tl.store(DW_PARTIAL + pid * N + cols, tl.reduce(dw_acc, 0, _add, keep_dims=True), mask=col_ok)


# The row count and the rows per program change with every batch shape; specializing on them (triton does for
# values of 1 and multiples of 16) would compile the kernels again for each new M.
_DO_NOT_SPECIALIZE = {
    _rms_norm_fwd_kernel: ["M"],
    _rms_norm_bwd_kernel: ["M", "rows_per_program"],
}


def jit(body: Callable[..., Any]) -> KernelInterface[Any]:
    """`body` (one of the two kernel functions) decorated for the backend in force, with its JIT options."""
    return triton.jit(body, do_not_specialize=_DO_NOT_SPECIALIZE[body])


@functools.cache
def _jitted(interpret: bool) -> tuple:
    """The kernels decorated for the backend in force (`interpret` is only the cache key)."""
    return jit(_rms_norm_fwd_kernel), jit(_rms_norm_bwd_kernel)


def _interpreting() -> bool:
    knobs = getattr(triton, "knobs", None)  # triton >= 3.4; older versions read the variable directly
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _kernels() -> tuple:
    return _jitted(_interpreting())


# ---------------------------------------------------------------------------------------------------------------
# Launch configuration
# ---------------------------------------------------------------------------------------------------------------

@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@dataclass(frozen=True)
class LaunchTarget:
    """What the launch heuristics need to know about where the kernels run.

    `sm_count` is the GPU's number of streaming multiprocessors; None means the interpreter (CPU tensors under
    TRITON_INTERPRET=1), which runs programs one after another and wants few, large ones.
    """

    sm_count: int | None = None

    @property
    def gpu(self) -> bool:
        return self.sm_count is not None

    @staticmethod
    def of(device: torch.device) -> LaunchTarget:
        if device.type != "cuda":
            return LaunchTarget()
        return LaunchTarget(_sm_count(device.index if device.index is not None else torch.cuda.current_device()))


@dataclass(frozen=True)
class LaunchTuning:
    """The launch parameters a GPU run sweeps (`eval/benchmarks/bench_norm.py --sweep`); None keeps the
    heuristic's choice.

    fwd_warps / bwd_warps: warps per program. bwd_programs_per_sm: the backward grid (programs per SM; each one
    also adds one fp32 partial-dW row to sum). bwd_stages: software-pipeline depth of the backward's row loop
    (1 = not pipelined; None = 2, except 1 for the residual variant with two gradient dtypes, where the pipeline's
    buffers of fp32 tiles cost 83-116 registers per thread or spills on sm_90; `eval/benchmarks/kernel_build.py`).
    """

    fwd_warps: int | None = None
    bwd_warps: int | None = None
    bwd_programs_per_sm: int = 2
    bwd_stages: int | None = None


DEFAULT_TUNING = LaunchTuning()


def block_config(n: int, target: LaunchTarget, backward: bool = False,
                 tuning: LaunchTuning = DEFAULT_TUNING) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_M, num_warps) for rows of n elements.

    On GPU a program should move a few KB: short rows (512-768) are packed several per program, so the kernel is
    not bound by per-program overhead. The forward's warps grow with the block (~16 fp32 values per thread) up
    to 16 warps: at n = 16384 that is 32 values per thread and two programs per SM, where 32 warps allowed only
    one (1024 threads x 49 registers). The backward keeps about six row tiles live (x, dy, w, x*r, dy*w, the dW
    accumulator) where the forward keeps two or three, so it takes twice the warps (~8 values per thread, at
    most 32): compiled for sm_90 that is <= 64 registers per thread and no spills up to n = 8192
    (`eval/benchmarks/kernel_build.py` prints the table).
    The interpreter runs programs one after another in numpy, so there a program takes many rows at once.
    """
    if n > MAX_N:
        raise ValueError(f"RMSNorm row length {n} exceeds the Triton kernel's maximum of {MAX_N} (wider rows take "
                         "the PyTorch path of rms_norm_fwd / rms_norm_bwd)")
    block_n = triton.next_power_of_2(n)
    if not target.gpu:
        return block_n, max(1, min(64, 16384 // block_n)), 4
    block_m = max(1, min(16, 4096 // block_n))
    if backward:
        num_warps = tuning.bwd_warps or min(32, max(2, block_m * block_n // (32 * 8)))
    else:
        num_warps = tuning.fwd_warps or min(16, max(2, block_m * block_n // (32 * 16)))
    return block_n, block_m, num_warps


def bwd_programs(m: int, block_m: int, target: LaunchTarget, tuning: LaunchTuning = DEFAULT_TUNING
                 ) -> tuple[int, int]:
    """(programs, rows per program) for the backward grid.

    Enough programs to fill the GPU (`tuning.bwd_programs_per_sm` per SM), each on a contiguous chunk of rows
    that is a multiple of BLOCK_M; the partial-dW buffer has one row per program. Few under the interpreter,
    where programs run sequentially. The grid depends only on (m, target, tuning), so dW is deterministic for
    given inputs.
    """
    wanted = tuning.bwd_programs_per_sm * target.sm_count if target.gpu else 4
    rows = math.ceil(m / wanted)
    rows = block_m * math.ceil(rows / block_m)
    return math.ceil(m / rows), rows


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The statistics/accumulation dtype: fp32, or fp64 for fp64 inputs (gradcheck, references)."""
    return torch.promote_types(dtype, torch.float32)


def _tl_acc(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """A [M, N] view with unit stride along N (copies only when no such view exists)."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t.reshape(-1, t.shape[-1])


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() < 1 or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"RMSNorm weight of shape {tuple(weight.shape)} does not match input {tuple(x.shape)}")
    if x.device != weight.device:
        raise ValueError(f"RMSNorm input on {x.device} but weight on {weight.device}")


def _device_guard(device: torch.device) -> contextlib.AbstractContextManager:
    """Triton launches on the current CUDA device; a tensor on another one (cuda:1 under DDP with the current
    device still 0) must make its own device current for the launch."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


@dataclass(frozen=True)
class KernelLaunch:
    """One kernel call exactly as a launcher makes it: `kernel[grid](*args, **options)` on `device`.

    Planning is separate from launching so that `model.kernels.cuda_build` can compile the very same call for a
    GPU on a machine without one.
    """

    grid: tuple[int, ...]
    args: tuple
    options: dict[str, Any]
    device: torch.device

    def run(self, kernel: KernelInterface[Any]) -> None:
        with _device_guard(self.device):
            kernel[self.grid](*self.args, **self.options)


# ---------------------------------------------------------------------------------------------------------------
# Rows wider than MAX_N: the same computation in PyTorch, a block of rows at a time (bounded fp32 temporaries)
# ---------------------------------------------------------------------------------------------------------------

_TORCH_BLOCK_ELEMENTS = 1 << 24  # rows per block: about 16M elements, 64 MB of fp32 per temporary


def _row_blocks(m: int, n: int) -> range:
    return range(0, m, max(1, _TORCH_BLOCK_ELEMENTS // n))


def _rows_fwd_torch(x2: torch.Tensor, r2: torch.Tensor | None, weight: torch.Tensor, eps: float, k: int,
                    y2: torch.Tensor, h2: torch.Tensor | None, rstd: torch.Tensor) -> None:
    acc = acc_dtype(y2.dtype)
    w = weight.to(acc)
    step = _row_blocks(*x2.shape).step
    for start in _row_blocks(*x2.shape):
        rows = slice(start, start + step)
        x = x2[rows].to(acc)
        if r2 is not None:
            h2[rows] = x + r2[rows].to(acc)
            x = h2[rows].to(acc)  # normalize the rounded sum, as the kernel does
        r = rstd_of(x, eps, k)
        rstd[rows] = r.squeeze(-1)
        y2[rows] = x * r * w


def _rows_bwd_torch(dy2: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, k: int,
                    dh2: torch.Tensor | None, dx2: torch.Tensor, dr2: torch.Tensor | None) -> torch.Tensor:
    acc = acc_dtype(x2.dtype)
    w = weight.to(acc)
    dw = torch.zeros(weight.shape, dtype=acc, device=weight.device)
    step = _row_blocks(*x2.shape).step
    for start in _row_blocks(*x2.shape):  # a fixed order of blocks: dW is deterministic
        rows = slice(start, start + step)
        dy = dy2[rows].to(acc)
        dx, xhat = rms_norm_input_grad(dy, x2[rows].to(acc), w, rstd[rows].unsqueeze(-1), k)
        if dh2 is not None:
            dx += dh2[rows].to(acc)
        dx2[rows] = dx
        if dr2 is not None:
            dr2[rows] = dx
        dw += (dy * xhat).sum(dim=0)
    return dw


# ---------------------------------------------------------------------------------------------------------------
# Launchers (plain tensors in, plain tensors out; the custom ops in rmsnorm_ops.py wrap these)
# ---------------------------------------------------------------------------------------------------------------

def _fwd_outputs(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Check the forward's inputs and allocate (y, h or None, rstd)."""
    _check(x, weight)
    if residual is not None:
        if residual.shape != x.shape or residual.device != x.device:
            raise ValueError(f"residual {tuple(residual.shape)} on {residual.device} does not match input "
                             f"{tuple(x.shape)} on {x.device}")
        out_dtype = torch.promote_types(x.dtype, residual.dtype)
    else:
        out_dtype = x.dtype
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    h = torch.empty(x.shape, dtype=out_dtype, device=x.device) if residual is not None else None
    return y, h, torch.empty(x.shape[:-1], dtype=acc_dtype(out_dtype), device=x.device)


def _bwd_outputs(x: torch.Tensor, weight: torch.Tensor, dx_dtype: torch.dtype | None,
                 dr_dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Check the backward's inputs and allocate (dx, dr or None)."""
    _check(x, weight)
    dx = torch.empty(x.shape, dtype=dx_dtype or x.dtype, device=x.device)
    return dx, torch.empty(x.shape, dtype=dr_dtype, device=x.device) if dr_dtype is not None else None


def plan_fwd(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, k: int,
             target: LaunchTarget | None = None, tuning: LaunchTuning = DEFAULT_TUNING
             ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, KernelLaunch | None]:
    """Allocate the forward's outputs and plan its launch (None when there is nothing to compute)."""
    y, h, rstd = _fwd_outputs(x, residual, weight)
    n = x.shape[-1]
    block_n, block_m, num_warps = block_config(n, target or LaunchTarget.of(x.device), tuning=tuning)
    x2 = _as_rows(x)
    m = x2.shape[0]
    if m == 0 or n == 0:
        return y, h, rstd, None
    r2 = _as_rows(residual) if residual is not None else x2
    h2 = h.view(-1, n) if h is not None else y.view(-1, n)
    launch = KernelLaunch(
        grid=(triton.cdiv(m, block_m),),
        args=(x2, r2, weight.contiguous(), y.view(-1, n), h2, rstd,  # any weight layout: N elements, copied
              m, n, k,
              x2.stride(0), r2.stride(0), n, n,
              float(eps), 1.0 / k),
        options=dict(HAS_RESIDUAL=residual is not None, PARTIAL=k < n, ACC=_tl_acc(rstd.dtype),
                     BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, enable_fp_fusion=FP_FUSION),
        device=x.device)
    return y, h, rstd, launch


def rms_norm_fwd(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, k: int,
                 target: LaunchTarget | None = None, tuning: LaunchTuning = DEFAULT_TUNING
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """y = rmsnorm(x [+ residual]) over the last dim. Returns (y, h or None, rstd of shape x.shape[:-1]).

    rstd is fp32 (fp64 for fp64 inputs), 4 bytes per row saved for the backward.

    With a residual, h = x + residual (fp32 add, stored in the promoted dtype) and y = norm(h) in h's dtype.
    `target` overrides the launch heuristics' view of the device (tests run GPU configurations interpreted);
    `tuning` overrides their choices (the GPU sweep). Rows wider than MAX_N take the PyTorch path.
    """
    n = x.shape[-1]
    if n > MAX_N:
        y, h, rstd = _fwd_outputs(x, residual, weight)
        _rows_fwd_torch(_as_rows(x), _as_rows(residual) if residual is not None else None, weight, eps, k,
                        y.view(-1, n), h.view(-1, n) if h is not None else None, rstd.view(-1))
        return y, h, rstd
    y, h, rstd, launch = plan_fwd(x, residual, weight, eps, k, target, tuning)
    if launch is not None:
        launch.run(_kernels()[0])
    return y, h, rstd


def plan_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, k: int,
             dh: torch.Tensor | None = None, dx_dtype: torch.dtype | None = None,
             dr_dtype: torch.dtype | None = None, target: LaunchTarget | None = None,
             tuning: LaunchTuning = DEFAULT_TUNING
             ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, KernelLaunch | None]:
    """Allocate the backward's outputs (dx, dr, fp32 partial-dW buffer) and plan its launch."""
    dx, dr = _bwd_outputs(x, weight, dx_dtype, dr_dtype)
    n = x.shape[-1]
    target = target or LaunchTarget.of(x.device)
    block_n, block_m, num_warps = block_config(n, target, backward=True, tuning=tuning)
    x2, dy2 = _as_rows(x), _as_rows(dy)
    dh2 = _as_rows(dh) if dh is not None else None
    m = x2.shape[0]
    if m == 0 or n == 0:
        return dx, dr, None, None
    programs, rows_per_program = bwd_programs(m, block_m, target, tuning)
    stages = (tuning.bwd_stages or (1 if dr is not None else 2)) if target.gpu else 1
    dw_partial = torch.empty((programs, n), dtype=acc_dtype(x.dtype), device=x.device)
    dx2 = dx.view(-1, n)
    dr2 = dr.view(-1, n) if dr is not None else dx2
    launch = KernelLaunch(
        grid=(programs,),
        args=(dy2, x2, weight.contiguous(), rstd.reshape(-1), dh2 if dh2 is not None else dy2, dx2, dr2,
              dw_partial,
              m, n, k, rows_per_program,
              dy2.stride(0), x2.stride(0), dh2.stride(0) if dh2 is not None else 0, n, n,
              1.0 / k),
        options=dict(HAS_DH=dh is not None, HAS_DR=dr is not None, PARTIAL=k < n, ACC=_tl_acc(acc_dtype(x.dtype)),
                     BLOCK_M=block_m, BLOCK_N=block_n, NUM_STAGES=stages,
                     num_warps=num_warps, enable_fp_fusion=FP_FUSION),
        device=x.device)
    return dx, dr, dw_partial, launch


def rms_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, k: int,
                 dh: torch.Tensor | None = None, dx_dtype: torch.dtype | None = None,
                 dr_dtype: torch.dtype | None = None, target: LaunchTarget | None = None,
                 tuning: LaunchTuning = DEFAULT_TUNING
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Gradients of y = rmsnorm(x) given dy (x is the normalized input: h for the residual variant).

    dh, if given, is added to dx (the gradient of the returned sum h). dr_dtype, if given, requests a second
    copy of dx in that dtype (the residual's gradient when its dtype differs from x's; with equal dtypes the
    caller hands the one dx to both inputs). Returns (dx, dr or None, dw in weight.dtype). Rows wider than MAX_N
    take the PyTorch path.
    """
    n = x.shape[-1]
    if n > MAX_N:
        dx, dr = _bwd_outputs(x, weight, dx_dtype, dr_dtype)
        dw = _rows_bwd_torch(_as_rows(dy), _as_rows(x), weight, rstd.reshape(-1), k,
                             _as_rows(dh) if dh is not None else None, dx.view(-1, n),
                             dr.view(-1, n) if dr is not None else None)
        return dx, dr, dw.to(weight.dtype)
    dx, dr, dw_partial, launch = plan_bwd(dy, x, weight, rstd, k, dh, dx_dtype, dr_dtype, target, tuning)
    if launch is None:
        dx.zero_()
        if dr is not None:
            dr.zero_()
        return dx, dr, torch.zeros_like(weight)
    launch.run(_kernels()[1])
    return dx, dr, dw_partial.sum(dim=0).to(weight.dtype)  # fixed-order reduction: deterministic
