"""Benchmark (and, on CUDA, check) the RMSNorm implementations.

    python eval/bench_norm.py                      # CUDA if present, else CPU; markdown tables on stdout
    python eval/bench_norm.py --device cpu --n 512 768 --m 4096
    python eval/bench_norm.py --check              # CUDA: our kernels vs fp32 references at LLM shapes

CUDA: forward, backward and forward+backward medians (triton.testing.do_bench) and achieved GB/s for our Triton
kernel, eager PyTorch, `F.rms_norm` (same-dtype weight: its fused path), torch.compile and Liger-Kernel when
importable; plus the fused residual variant against add-then-norm. The ceiling is the measured device copy
bandwidth (`dst.copy_(src)`, read + write). Bytes moved per call (memory-bound, b bytes per element):
fwd 2*M*N*b, bwd 3*M*N*b (dy, x in; dx out), fwd+bwd 5*M*N*b; residual fwd 4*M*N*b (x, r in; y, h out),
bwd 5*M*N*b (dy, dh, h in; dx, dr out). Weights, rstd and dW partials are ignored (under 1% at M >= 4096).

CPU: eager, torch.compile, `F.rms_norm` and `nn.LayerNorm` with time.perf_counter medians. The interpreted Triton
kernel is ~1000x slower than anything else on CPU and is not a speed path; it is timed (and `--check` runs) on
CPU only when TRITON_INTERPRET=1 is set, to smoke-test this script without a GPU (use a small --m).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # run as a script from the repo root or from eval/
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.nn.functional as F

from model.norms import partial_size, rms_norm_eager, triton_can_run

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
EPS = 1e-6

# ------------------------------------------------------------------------------------------------ timing


def _cpu_median_ms(fn: Callable[[], object], min_time: float = 0.3, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 5 or (time.perf_counter() - start < min_time and len(times) < 200):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def _gpu_median_ms(fn: Callable[[], object]) -> float:
    from triton.testing import do_bench
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def median_ms(fn: Callable[[], object], device: torch.device) -> float:
    return _gpu_median_ms(fn) if device.type == "cuda" else _cpu_median_ms(fn)


def copy_bandwidth_gbs(device: torch.device) -> float:
    """Measured device copy bandwidth (read + write) on a buffer far larger than any cache."""
    numel = (1 << 28) if device.type == "cuda" else (1 << 25)  # 1 GiB / 128 MiB of fp32
    src = torch.empty(numel, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), device)
    return 2 * src.numel() * 4 / ms / 1e6


# ------------------------------------------------------------------------------------------------ methods


def _compiled(fn: Callable) -> Callable:
    return torch.compile(fn, dynamic=False)


def _liger_module(n: int, dtype: torch.dtype, device: torch.device):
    try:
        mod = importlib.import_module("liger_kernel.transformers.rms_norm")
    except ImportError:
        return None
    kwargs = {"eps": EPS}
    params = inspect.signature(mod.LigerRMSNorm).parameters
    if "in_place" in params:
        kwargs["in_place"] = False  # in-place would overwrite dy between timed backward calls
    if "casting_mode" in params:
        kwargs["casting_mode"] = "llama"
    return mod.LigerRMSNorm(n, **kwargs).to(device=device, dtype=dtype)


def norm_methods(n: int, p: float, dtype: torch.dtype, device: torch.device) -> dict[str, Callable]:
    """name -> f(x, w32, wx) for the plain norm: w32 is an fp32 (master) weight, wx the same weight in x's dtype.
    Each method uses the one it is fastest with; the other is unused."""
    k = partial_size(n, p)
    methods: dict[str, Callable] = {
        "eager": lambda x, w32, wx: rms_norm_eager(x, w32, EPS, k),
        "torch.compile": _compiled(lambda x, w32, wx: rms_norm_eager(x, w32, EPS, k)),
    }
    if k == n:  # F.rms_norm and the others have no partial variant
        # Same-dtype weight: otherwise F.rms_norm falls back to its composite (eager-like) path.
        methods["F.rms_norm"] = lambda x, w32, wx: F.rms_norm(x, (n,), wx, EPS)
    if triton_can_run(device):
        from model.kernels import rms_norm
        methods = {"ours (triton)": lambda x, w32, wx: rms_norm(x, w32, EPS, p), **methods}
    if device.type == "cuda":
        liger = _liger_module(n, dtype, device) if k == n else None
        if liger is not None:
            methods["liger"] = lambda x, w32, wx: liger(x)
    else:
        ln = torch.nn.LayerNorm(n, eps=EPS, device=device, dtype=dtype)
        methods["nn.LayerNorm"] = lambda x, w32, wx: ln(x)
    return methods


def residual_methods(n: int, p: float, device: torch.device) -> dict[str, Callable]:
    """name -> f(x, r, w32, wx) returning (y, h) with h = x + r, y = norm(h)."""
    k = partial_size(n, p)

    def unfused(x, r, w32, wx):
        h = x + r
        return rms_norm_eager(h, w32, EPS, k), h

    methods: dict[str, Callable] = {"eager add+norm": unfused, "torch.compile add+norm": _compiled(unfused)}
    if k == n:
        methods["add + F.rms_norm"] = lambda x, r, w32, wx: (F.rms_norm(x + r, (n,), wx, EPS), x + r)
    if triton_can_run(device):
        from model.kernels import add_rms_norm
        methods = {"ours fused (triton)": lambda x, r, w32, wx: add_rms_norm(x, r, w32, EPS, p), **methods}
    return methods


# ------------------------------------------------------------------------------------------------ benchmark


def _time_fwd_bwd(fn: Callable, inputs: list[torch.Tensor], grads: list[torch.Tensor], device: torch.device
                  ) -> tuple[float, float, float]:
    """(fwd, bwd, fwd+bwd) median ms; bwd replays autograd on one retained graph."""
    def fwd():
        with torch.no_grad():
            return fn(*inputs)

    def fwd_bwd():
        out = fn(*inputs)
        out = out if isinstance(out, tuple) else (out,)
        return torch.autograd.grad(out, inputs, grads[:len(out)], allow_unused=True)

    # The backward is replayed on a retained graph; compiled backwards donate buffers unless told not to.
    torch._functorch.config.donated_buffer = False
    fwd_bwd()  # compile/warm everything, including the backward graph
    out = fn(*inputs)
    out = out if isinstance(out, tuple) else (out,)
    t_fwd = median_ms(fwd, device)
    t_bwd = median_ms(lambda: torch.autograd.grad(out, inputs, grads[:len(out)], retain_graph=True,
                                                  allow_unused=True), device)
    t_all = median_ms(fwd_bwd, device)
    return t_fwd, t_bwd, t_all


def bench_shape(m: int, n: int, p: float, dtype: torch.dtype, device: torch.device, residual: bool
                ) -> list[dict]:
    b = torch.finfo(dtype).bits // 8
    x = torch.randn(m, n, dtype=dtype, device=device, requires_grad=True)
    w32 = torch.ones(n, dtype=torch.float32, device=device, requires_grad=True)
    wx = torch.ones(n, dtype=dtype, device=device, requires_grad=True)
    dy = torch.randn(m, n, dtype=dtype, device=device)
    if residual:
        r = torch.randn(m, n, dtype=dtype, device=device, requires_grad=True)
        methods, inputs, grads = residual_methods(n, p, device), [x, r, w32, wx], [dy, torch.randn_like(dy)]
        bytes_fwd, bytes_bwd = 4 * m * n * b, 5 * m * n * b
    else:
        methods, inputs, grads = norm_methods(n, p, dtype, device), [x, w32, wx], [dy]
        bytes_fwd, bytes_bwd = 2 * m * n * b, 3 * m * n * b
    rows = []
    for name, fn in methods.items():
        try:
            t_fwd, t_bwd, t_all = _time_fwd_bwd(fn, inputs, grads, device)
        except Exception as err:  # one broken baseline must not end the run
            print(f"  {name}: skipped ({type(err).__name__}: {err})", file=sys.stderr)
            continue
        rows.append(dict(method=name, M=m, N=n, fwd_ms=t_fwd, bwd_ms=t_bwd, all_ms=t_all,
                         fwd_gbs=bytes_fwd / t_fwd / 1e6, bwd_gbs=bytes_bwd / t_bwd / 1e6,
                         all_gbs=(bytes_fwd + bytes_bwd) / t_all / 1e6))
    return rows


def print_table(rows: list[dict], ceiling: float) -> None:
    print("| method | M | N | fwd ms | fwd GB/s (%copy) | bwd ms | bwd GB/s (%copy) | fwd+bwd ms | fwd+bwd GB/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['method']} | {r['M']} | {r['N']} | {r['fwd_ms']:.3g} | {r['fwd_gbs']:.3g} "
              f"({100 * r['fwd_gbs'] / ceiling:.0f}%) | {r['bwd_ms']:.3g} | {r['bwd_gbs']:.3g} "
              f"({100 * r['bwd_gbs'] / ceiling:.0f}%) | {r['all_ms']:.3g} | {r['all_gbs']:.3g} |")


# ------------------------------------------------------------------------------------------------ --check


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()


def _reference(h: torch.Tensor, w: torch.Tensor, k: int, dy: torch.Tensor):
    """fp32 autograd reference of y = h * rsqrt(mean(h[:, :k]^2) + eps) * w (h already rounded)."""
    hf = h.detach().float().requires_grad_()
    wf = w.detach().float().requires_grad_()
    y = hf * torch.rsqrt(hf[:, :k].pow(2).mean(-1, keepdim=True) + EPS) * wf
    y.backward(dy.float())
    return y.detach(), hf.grad, wf.grad


def check(shapes: list[tuple[int, int]], dtype: torch.dtype, tol: float, device: torch.device) -> bool:
    """Our kernels against fp32 references at LLM shapes; dW determinism; fused residual variant."""
    from model.kernels import add_rms_norm, rms_norm
    ok = True
    print("| M | N | p | variant | weight | y err | dx err | dw err | dw bit-identical | result |")
    print("|---:|---:|---:|---|---|---:|---:|---:|---|---|")
    for m, n in shapes:
        for p in (1.0, 0.0625):
            for residual in (False, True):
                for w_dtype in (dtype, torch.float32):
                    torch.manual_seed(m * 31 + n)
                    k = partial_size(n, p)
                    x = torch.randn(m, n, device=device, dtype=dtype) * 2
                    r = torch.randn(m, n, device=device, dtype=dtype) if residual else None
                    w = (torch.rand(n, device=device) + 0.5).to(w_dtype)
                    dy = torch.randn(m, n, device=device, dtype=dtype)
                    dws, dxs = [], []
                    for _ in range(2):
                        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
                        if residual:
                            y, h = add_rms_norm(xg, r, wg, EPS, p)
                        else:
                            y, h = rms_norm(xg, wg, EPS, p), x
                        y.backward(dy)
                        dws.append(wg.grad)
                        dxs.append(xg.grad)
                    y_ref, dx_ref, dw_ref = _reference(h, w, k, dy)
                    errs = (_rel_err(y, y_ref), _rel_err(dxs[0], dx_ref), _rel_err(dws[0], dw_ref))
                    same = torch.equal(dws[0], dws[1]) and torch.equal(dxs[0], dxs[1])
                    good = same and all(e <= tol for e in errs) and y.dtype == dtype and dws[0].dtype == w_dtype
                    ok &= good
                    print(f"| {m} | {n} | {p} | {'add+norm' if residual else 'norm'} | "
                          f"{str(w_dtype).removeprefix('torch.')} | {errs[0]:.2e} | {errs[1]:.2e} | {errs[2]:.2e} "
                          f"| {same} | {'PASS' if good else 'FAIL'} |", flush=True)
                    del x, r, w, dy, y, h, dws, dxs, y_ref, dx_ref, dw_ref
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return ok


# ------------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--dtype", choices=list(DTYPES), default=None, help="default: bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--m", type=int, default=None, help="rows (default: 32768 on CUDA, 1024 on CPU)")
    ap.add_argument("--n", type=int, nargs="+", default=None, help="row lengths")
    ap.add_argument("--p", type=float, default=1.0, help="partial RMSNorm fraction (1.0 = RMSNorm)")
    ap.add_argument("--no-residual", action="store_true", help="skip the fused residual-add table")
    ap.add_argument("--check", action="store_true", help="CUDA correctness at LLM shapes instead of timing")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (torch.set_num_threads)")
    args = ap.parse_args(argv)

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and cuda) else "cpu")
    if device.type == "cuda" and not cuda:
        ap.error("--device cuda: no CUDA device is available")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]

    if args.check:
        if not triton_can_run(device):  # CPU only as a smoke test of this script, under TRITON_INTERPRET=1
            ap.error("--check needs a CUDA device (the CPU interpreter path is covered by tests/test_kernels.py)")
        dtype = DTYPES[args.dtype or "bf16"]
        ns = args.n or [96, 512, 768, 1024, 2048, 4096, 8192, 16384]
        shapes = [(m, n) for n in ns for m in ([args.m] if args.m else [1, 1000, 32768])]
        # bf16 on the interpreter: fp32 -> bf16 casts truncate there (GPUs round), hence its looser bound.
        tol = {torch.float32: 1e-5, torch.float16: 2e-3,
               torch.bfloat16: 1e-2 if device.type == "cuda" else 2e-2}[dtype]
        ok = check(shapes, dtype, tol, device)
        print("ALL PASS" if ok else "SOME CHECKS FAILED")
        return 0 if ok else 1

    m = args.m or (32768 if device.type == "cuda" else 1024)
    ns = args.n or ([512, 768, 1024, 2048, 4096, 8192, 16384] if device.type == "cuda" else [256, 512, 768, 2048])
    ceiling = copy_bandwidth_gbs(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"# RMSNorm benchmark: {name}, {str(dtype).removeprefix('torch.')}, p={args.p}, "
          f"copy bandwidth {ceiling:.0f} GB/s, torch {torch.__version__}\n")
    print("## RMSNorm (y = norm(x))\n")
    print_table([row for n in ns for row in bench_shape(m, n, args.p, dtype, device, residual=False)], ceiling)
    if not args.no_residual:
        print("\n## Residual add + RMSNorm (h = x + r; y = norm(h))\n")
        print_table([row for n in ns for row in bench_shape(m, n, args.p, dtype, device, residual=True)], ceiling)
    return 0


if __name__ == "__main__":
    sys.exit(main())
