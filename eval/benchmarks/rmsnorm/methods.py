"""The RMSNorm implementations the benchmark compares: ours (Triton), eager, torch.compile, `F.rms_norm`, and
Liger-Kernel when importable (nn.LayerNorm on CPU, for scale). Every method receives the same weight tensor."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from model.norms import partial_size, rms_norm_eager, triton_can_run

EPS = 1e-6  # every method, launch and check uses it


def _compiled(fn: Callable) -> Callable:
    return torch.compile(fn, dynamic=False)


def _liger_ops():
    """Liger-Kernel's autograd functions (RMSNorm, fused add + RMSNorm), or None when it is not installed."""
    try:
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except ImportError:
        return None
    return LigerRMSNormFunction, LigerFusedAddRMSNormFunction


def norm_methods(n: int, p: float, device: torch.device) -> dict[str, Callable]:
    """name -> f(x, w) for the plain norm. Every method receives the same weight tensor."""
    k = partial_size(n, p)
    methods: dict[str, Callable] = {
        "eager": lambda x, w: rms_norm_eager(x, w, EPS, k),
        "torch.compile": _compiled(lambda x, w: rms_norm_eager(x, w, EPS, k)),
    }
    if k == n:  # F.rms_norm and the others have no partial variant
        methods["F.rms_norm"] = lambda x, w: F.rms_norm(x, (n,), w, EPS)
    if triton_can_run(device):
        from model.kernels import rms_norm
        methods = {"ours (triton)": lambda x, w: rms_norm(x, w, EPS, p), **methods}
    if device.type == "cuda":
        liger = _liger_ops() if k == n else None
        if liger is not None:  # its defaults: offset 0, casting "llama", in_place=True
            methods["liger"] = lambda x, w: liger[0].apply(x, w, EPS, 0.0, "llama", True)
    else:
        ln = torch.nn.LayerNorm(n, eps=EPS, device=device)
        methods["nn.LayerNorm"] = lambda x, w: ln(x)
    return methods


def residual_methods(n: int, p: float, device: torch.device) -> dict[str, Callable]:
    """name -> f(x, r, w) returning (y, h) with h = x + r, y = norm(h)."""
    k = partial_size(n, p)

    def unfused(x, r, w):
        h = x + r
        return rms_norm_eager(h, w, EPS, k), h

    methods: dict[str, Callable] = {"eager add+norm": unfused, "torch.compile add+norm": _compiled(unfused)}
    if k == n:
        methods["add + F.rms_norm"] = lambda x, r, w: (F.rms_norm(x + r, (n,), w, EPS), x + r)
    if triton_can_run(device):
        from model.kernels import add_rms_norm
        methods = {"ours fused (triton)": lambda x, r, w: add_rms_norm(x, r, w, EPS, p), **methods}
    if device.type == "cuda":
        liger = _liger_ops() if k == n else None
        if liger is not None:  # its defaults: offset 0, casting "llama", in_place=False
            methods["liger fused add"] = lambda x, r, w: liger[1].apply(x, r, w, EPS, 0.0, "llama", False)
    return methods
