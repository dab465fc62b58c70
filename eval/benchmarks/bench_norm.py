"""Benchmark (and, on CUDA, check) the RMSNorm implementations.

    python eval/benchmarks/bench_norm.py                      # CUDA if present, else CPU; markdown tables on stdout
    python eval/benchmarks/bench_norm.py --device cpu --n 512 768 --m 4096
    python eval/benchmarks/bench_norm.py --check              # CUDA: our kernels vs fp32 references at LLM shapes
    python eval/benchmarks/bench_norm.py --sweep              # CUDA: our kernels under each launch configuration
    python eval/benchmarks/bench_norm.py --profile_once 4096  # CUDA: one forward + backward of ours, for `ncu`
    python eval/benchmarks/bench_norm.py --profile_host 512   # CUDA: where each method's wall-clock time goes
    python eval/benchmarks/bench_norm.py --lab --threads 2    # CPU: every norm type, with and without affine
                                                              # parameters, and the default model's step with each

CUDA: forward, backward and forward+backward medians (triton.testing.do_bench, wall-clock including the Python
dispatch) and, beside them, kernel-only times (the CUDA kernels' own durations from the profiler, median over
calls: at M = 32768, N <= 1024 the Python side is as long as the GPU work) with achieved GB/s, for our Triton
kernel, eager PyTorch, `F.rms_norm`, torch.compile and Liger-Kernel (when importable; its defaults:
`in_place=True` for RMSNorm, so its backward writes dX over dY and the timed replays keep overwriting one
buffer). Every method gets the very same weight tensor (`--weight_dtype`, default the activations' dtype).
The ceiling is the measured device copy bandwidth (`dst.copy_(src)`, read + write). Bytes moved per call
(memory-bound, b bytes per element): fwd 2*M*N*b, bwd 3*M*N*b (dy, x in; dx out), fwd+bwd 5*M*N*b; residual
fwd 4*M*N*b (x, r in; y, h out), bwd 4*M*N*b (dy, dh, h in; one dx out, shared by x and r when their dtypes
match). Weights, rstd and dW partials are ignored (under 1% at M >= 4096).

CPU: eager, torch.compile, `F.rms_norm` and `nn.LayerNorm` with time.perf_counter medians. The interpreted Triton
kernel is ~1000x slower than anything else on CPU and is not a speed path; it is timed (and `--check` runs) on
CPU only when TRITON_INTERPRET=1 is set, to smoke-test this script without a GPU (use a small --m).

--lab (CPU): the norm laboratory's table (docs/benchmarks.md): RMSNorm, LayerNorm, DyT and their parameter-free
variants, as the model builds them, each timed forward+backward at the default run's activation shape and inside a
full training step of the default pretraining model, interleaved round by round (eval/benchmarks/rmsnorm/lab.py).

The timing is here; the compared implementations, the correctness checks (--check, --check_model) and the
laboratory's variants are in this command's own package, eval/benchmarks/rmsnorm/.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # run as a script from the repo root or from eval/
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trainer.cli import quiet_ctrl_c_while_loading  # noqa: E402

quiet_ctrl_c_while_loading(__name__)  # a Ctrl-C while the imports below load: one line, exit 130

import torch  # noqa: E402

from dataset.atomic_io import atomic_write_text, check_folder_path  # noqa: E402
from dataset.json_text import strict_json  # noqa: E402
from eval.benchmarks.rmsnorm.checks import check_kernels, check_model  # noqa: E402
from eval.benchmarks.rmsnorm.lab import DEFAULT_LAB_NORMS, LAB_VARIANTS, lab_table, run_lab  # noqa: E402
from eval.benchmarks.rmsnorm.methods import EPS, norm_methods, residual_methods  # noqa: E402
from model.kernels.dtypes import DTYPES  # noqa: E402
from model.norms import triton_can_run  # noqa: E402
from model.rmsnorm_math import P_RANGE  # noqa: E402
from trainer.cli import (MAX_COUNT, RawDescriptionDefaultsHelpFormatter, ToolParser, benchmark_threads, float_within,  # noqa: E402
                         int_within, output_file, run_main)
from trainer.machine import machine_line  # noqa: E402
from trainer.memory import allocation_failure_line, past_memory  # noqa: E402
from trainer.run_dir import report_error  # noqa: E402

GPU_ROW_LENGTHS = [512, 768, 1024, 2048, 4096, 8192, 16384]
CPU_ROW_LENGTHS = [256, 512, 768, 2048]
SHAPE_TENSORS = 4  # (M, N) tensors a timed call holds at once, at the least: x, dy, the output and dx


def shape_too_large(m: int, ns: list[int], dtype: torch.dtype, device: torch.device) -> str | None:
    """Why the widest (--m, --n) shape cannot be held on `device` (None: it may be): its tensors alone are more than
    all of its memory (trainer/memory.py's past_memory, as the trainer checks its logits), which was the
    allocator's traceback after the copy-bandwidth probe and the narrower shapes."""
    needed = SHAPE_TENSORS * m * max(ns) * dtype.itemsize
    return past_memory(needed, f"--m {m} x --n {max(ns)}: the {SHAPE_TENSORS} {str(dtype).removeprefix('torch.')} "
                               f"tensors of that shape (x, dy, the output, dx)", device, "lower --m or --n")

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


def kernel_only_ms(fn: Callable[[], object], calls: int = 20) -> float:
    """Median over `calls` of the summed durations of the CUDA kernels (and memsets/copies) one call launches,
    read from the profiler: the GPU's work without the host-side dispatch between launches."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    durations = [e.time_range.elapsed_us() for e in kernels]
    per_call, leftover = divmod(len(durations), calls)
    if per_call == 0 or leftover:  # calls launched different kernel counts: fall back to the mean
        return sum(durations) / calls / 1e3
    return statistics.median(sum(durations[i * per_call:(i + 1) * per_call]) for i in range(calls)) / 1e3


def copy_bandwidth_gbs(device: torch.device) -> float:
    """Measured device copy bandwidth (read + write) on a buffer far larger than any cache."""
    numel = (1 << 28) if device.type == "cuda" else (1 << 25)  # 1 GiB / 128 MiB of fp32
    src = torch.empty(numel, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), device)
    return 2 * src.numel() * 4 / ms / 1e6


# ------------------------------------------------------------------------------------------------ benchmark


def _time_fwd_bwd(fn: Callable, inputs: list[torch.Tensor], grads: list[torch.Tensor], device: torch.device
                  ) -> dict[str, float]:
    """fwd, bwd and fwd+bwd median ms (wall-clock), plus kernel-only ms on CUDA; bwd replays autograd on one
    retained graph."""
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

    def bwd():
        return torch.autograd.grad(out, inputs, grads[:len(out)], retain_graph=True, allow_unused=True)

    times = {"fwd_ms": median_ms(fwd, device), "bwd_ms": median_ms(bwd, device), "all_ms": median_ms(fwd_bwd, device)}
    if device.type == "cuda":
        times.update(fwd_kernel_ms=kernel_only_ms(fwd), bwd_kernel_ms=kernel_only_ms(bwd),
                     all_kernel_ms=kernel_only_ms(fwd_bwd))
    return times


def bench_shape(m: int, n: int, p: float, dtype: torch.dtype, weight_dtype: torch.dtype, device: torch.device,
                residual: bool, only: list[str] | None = None) -> list[dict]:
    b = torch.finfo(dtype).bits // 8
    # Every shape's compiled methods are new lambdas of the same code: without a reset, Dynamo's per-code cache
    # hits its recompile limit (8) by the 7th shape and silently runs the method eagerly (seen on the H200).
    torch._dynamo.reset()
    x = torch.randn(m, n, dtype=dtype, device=device, requires_grad=True)
    w = (torch.rand(n, device=device) + 0.5).to(weight_dtype).requires_grad_()
    dy = torch.randn(m, n, dtype=dtype, device=device)
    if residual:
        r = torch.randn(m, n, dtype=dtype, device=device, requires_grad=True)
        methods, inputs, grads = residual_methods(n, p, device), [x, r, w], [dy, torch.randn_like(dy)]
        bytes_fwd, bytes_bwd = 4 * m * n * b, 4 * m * n * b
    else:
        methods, inputs, grads = norm_methods(n, p, device), [x, w], [dy]
        bytes_fwd, bytes_bwd = 2 * m * n * b, 3 * m * n * b
    rows = []
    for name, fn in methods.items():
        if only and not any(word in name for word in only):
            continue
        try:
            times = _time_fwd_bwd(fn, inputs, grads, device)
        except Exception as err:  # noqa: BLE001  (one broken baseline must not end the run)
            print(f"  {name}: skipped ({type(err).__name__}: {err})", file=sys.stderr)
            continue
        row = {"method": name, "M": m, "N": n, "bytes_fwd": bytes_fwd, "bytes_bwd": bytes_bwd, **times}
        for part, nbytes in (("fwd", bytes_fwd), ("bwd", bytes_bwd), ("all", bytes_fwd + bytes_bwd)):
            row[f"{part}_gbs"] = nbytes / row[f"{part}_ms"] / 1e6
            if f"{part}_kernel_ms" in row:
                row[f"{part}_kernel_gbs"] = nbytes / row[f"{part}_kernel_ms"] / 1e6
        rows.append(row)
    return rows


def print_table(rows: list[dict], ceiling: float) -> None:
    kernel = any("fwd_kernel_ms" in r for r in rows)
    head = "| method | M | N | fwd ms | fwd GB/s (%copy) |"
    head += " fwd kernel-only GB/s (%copy) |" if kernel else ""
    head += " bwd ms | bwd GB/s (%copy) |" + (" bwd kernel-only GB/s (%copy) |" if kernel else "")
    head += " fwd+bwd ms | fwd+bwd GB/s |" + (" fwd+bwd kernel-only GB/s (%copy) |" if kernel else "")
    print(head)
    print("|---|---:|---:|" + "---:|" * (head.count("|") - 4))

    def pct(gbs: float) -> str:
        return f"{gbs:.4g} ({100 * gbs / ceiling:.0f}%)"

    for r in rows:
        line = f"| {r['method']} | {r['M']} | {r['N']} | {r['fwd_ms']:.3g} | {pct(r['fwd_gbs'])} |"
        line += f" {pct(r['fwd_kernel_gbs'])} |" if kernel else ""
        line += f" {r['bwd_ms']:.3g} | {pct(r['bwd_gbs'])} |" + (f" {pct(r['bwd_kernel_gbs'])} |" if kernel else "")
        line += f" {r['all_ms']:.3g} | {r['all_gbs']:.4g} |" + (f" {pct(r['all_kernel_gbs'])} |" if kernel else "")
        print(line)


# ------------------------------------------------------------------------------------------------ --sweep


def sweep_configs() -> list:
    """The launch configurations the GPU run compares: the heuristic's, then forward warps, backward warps,
    backward programs per SM and pipeline stages varied one at a time and the latter two jointly."""
    from model.kernels.rmsnorm_triton import LaunchTuning
    configs = [LaunchTuning()]
    configs += [LaunchTuning(fwd_warps=w) for w in (4, 8, 16, 32)]
    configs += [LaunchTuning(bwd_warps=w) for w in (8, 16, 32)]
    configs += [LaunchTuning(bwd_programs_per_sm=g, bwd_stages=s) for g, s in itertools.product((1, 2, 4), (1, 2, 3))]
    return list(dict.fromkeys(configs))  # keep order, drop repeats


def sweep(m: int, ns: list[int], dtype: torch.dtype, weight_dtype: torch.dtype, device: torch.device) -> list[dict]:
    """Our launchers (no autograd, no custom-op dispatch) timed per launch configuration: kernel-only medians."""
    from model.kernels import rmsnorm_triton as kern
    rows = []
    for n in ns:
        b = torch.finfo(dtype).bits // 8
        x = torch.randn(m, n, dtype=dtype, device=device)
        w = (torch.rand(n, device=device) + 0.5).to(weight_dtype)
        dy = torch.randn(m, n, dtype=dtype, device=device)
        for tuning in sweep_configs():
            try:
                _, _, rstd = kern.rms_norm_fwd(x, None, w, EPS, n, tuning=tuning)
                fwd_ms = kernel_only_ms(lambda: kern.rms_norm_fwd(x, None, w, EPS, n, tuning=tuning))  # noqa: B023
                bwd_ms = kernel_only_ms(lambda: kern.rms_norm_bwd(dy, x, w, rstd, n, tuning=tuning))  # noqa: B023
            except Exception as err:  # noqa: BLE001  (out of shared memory or registers: report, go on)
                print(f"  N={n} {tuning}: failed ({type(err).__name__}: {str(err)[:120]})", file=sys.stderr)
                continue
            rows.append({"N": n, "M": m, "tuning": {k: v for k, v in vars(tuning).items()},
                         "fwd_kernel_ms": fwd_ms, "bwd_kernel_ms": bwd_ms,
                         "fwd_kernel_gbs": 2 * m * n * b / fwd_ms / 1e6,
                         "bwd_kernel_gbs": 3 * m * n * b / bwd_ms / 1e6})
    return rows


def print_sweep(rows: list[dict], ceiling: float) -> None:
    print("| N | fwd warps | bwd warps | bwd programs/SM | bwd stages | fwd kernel GB/s (%copy) "
          "| bwd kernel GB/s (%copy) |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        t = r["tuning"]
        print(f"| {r['N']} | {t['fwd_warps'] or 'auto'} | {t['bwd_warps'] or 'auto'} | {t['bwd_programs_per_sm']} "
              f"| {t['bwd_stages'] or 'auto'} | {r['fwd_kernel_gbs']:.4g} ({100 * r['fwd_kernel_gbs'] / ceiling:.0f}%) "
              f"| {r['bwd_kernel_gbs']:.4g} ({100 * r['bwd_kernel_gbs'] / ceiling:.0f}%) |")


# ------------------------------------------------------------------------------------------------ --profile_host


def profile_host(m: int, n: int, dtype: torch.dtype, weight_dtype: torch.dtype, device: torch.device,
                 only: list[str] | None, calls: int = 20) -> None:
    """Forward+backward of each method under torch.profiler with the host's side recorded: the wall-clock time per
    call (synchronized) and the operators that take the CPU's time. On the H200 our fwd+bwd took 0.8-1.1 ms of
    wall clock at M = 32768, N <= 8192 while its kernels took 0.07-0.8 ms; this shows where the rest goes."""
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(m, n, dtype=dtype, device=device, requires_grad=True)
    w = (torch.rand(n, device=device) + 0.5).to(weight_dtype).requires_grad_()
    dy = torch.randn(m, n, dtype=dtype, device=device)
    for name, fn in norm_methods(n, 1.0, device).items():
        if only and not any(word in name for word in only):
            continue

        def fwd_bwd(fn=fn) -> None:
            torch.autograd.grad(fn(x, w), (x, w), dy)

        for _ in range(5):
            fwd_bwd()
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(calls):
            fwd_bwd()
            torch.cuda.synchronize()
        wall_ms = 1e3 * (time.perf_counter() - started) / calls
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fwd_bwd()
            torch.cuda.synchronize()
        print(f"## {name}: M={m} N={n}, {wall_ms:.3f} ms per synchronized forward+backward (mean of {calls})\n")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15), flush=True)


# ------------------------------------------------------------------------------------------------ main


def build_parser() -> ToolParser:
    """The command's flags: the timed shapes and methods, the CUDA-only modes and the --lab group."""
    ap = ToolParser(description=__doc__, formatter_class=RawDescriptionDefaultsHelpFormatter)
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: CUDA when there is one")
    ap.add_argument("--dtype", choices=list(DTYPES), default=None, help="default: bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--weight_dtype", choices=["same", *DTYPES], default="same",
                    help="the one weight every method gets (same: the activations' dtype)")
    ap.add_argument("--m", type=int_within(1), default=None, help="rows (default: 32768 on CUDA, 1024 on CPU)")
    ap.add_argument("--n", type=int_within(1), nargs="+", default=None, help="row lengths")
    ap.add_argument("--p", type=float_within(*P_RANGE, above_low=True), default=1.0,
                    help="partial RMSNorm fraction (1.0 = RMSNorm)")
    ap.add_argument("--no-residual", action="store_true", help="skip the fused residual-add table")
    ap.add_argument("--methods", nargs="+", default=None,
                    help="time only the methods whose names contain one of these words (e.g. ours liger)")
    ap.add_argument("--check", action="store_true", help="CUDA correctness at LLM shapes instead of timing")
    ap.add_argument("--no-big", action="store_true", help="--check: skip the case of more than 2^31 elements")
    ap.add_argument("--check_model", action="store_true",
                    help="CUDA: the minimind-26m model with norm_impl=triton vs eager, and under torch.compile")
    ap.add_argument("--sweep", action="store_true", help="CUDA: our kernels under each launch configuration")
    ap.add_argument("--profile_once", type=int_within(1), metavar="N", default=None,
                    help="CUDA: run our forward and backward once at (--m, N) and exit (for ncu)")
    ap.add_argument("--profile_host", type=int_within(1), metavar="N", default=None,
                    help="CUDA: each method's forward+backward at (--m, N) under torch.profiler, host side included")
    ap.add_argument("--out", type=output_file, default=None, help="also write the raw rows as JSON here")
    ap.add_argument("--threads", type=benchmark_threads(), default=None, help="CPU threads (torch.set_num_threads)")
    lab = ap.add_argument_group("--lab: the norm laboratory's table (CPU)")
    lab.add_argument("--lab", action="store_true", help="every norm type and the default model's step with each")
    lab.add_argument("--lab_norms", nargs="+", default=list(DEFAULT_LAB_NORMS), choices=list(LAB_VARIANTS),
                     help="the variants, in table order (the first is the reference)")
    lab.add_argument("--rounds", type=int_within(1, MAX_COUNT), default=7, help="interleaved rounds")
    lab.add_argument("--norm_repeats", type=int_within(1, MAX_COUNT), default=50,
                     help="norm forward+backward calls per variant per round")
    lab.add_argument("--lab_steps", type=int_within(1, MAX_COUNT), default=3,
                     help="training steps per variant per round")
    lab.add_argument("--lab_warmup", type=int_within(0, MAX_COUNT), default=3,
                     help="untimed calls and steps per variant first (compiles)")
    return ap


def chosen_device(ap: ToolParser, args: argparse.Namespace) -> torch.device:
    """--device: CUDA when asked for, or under auto when there is one; asking for a missing one is the parser's
    error."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and cuda) else "cpu")
    if device.type == "cuda" and not cuda:
        ap.error("--device cuda: no CUDA device is available")
    return device


def refuse_modes_the_device_lacks(ap: ToolParser, args: argparse.Namespace, device: torch.device) -> None:
    """The CUDA-only modes on a CPU are the parser's error (--check runs on CPU only under TRITON_INTERPRET=1)."""
    if args.check and not triton_can_run(device):  # CPU only as a smoke test, under TRITON_INTERPRET=1
        ap.error("--check needs a CUDA device (the CPU interpreter path is covered by tests/unit/test_kernels.py)")
    if (args.sweep or args.profile_once or args.profile_host or args.check_model) and device.type != "cuda":
        ap.error("--sweep, --profile_once, --profile_host and --check_model need a CUDA device")


def passed(ok: bool) -> int:
    """A correctness mode's last line and exit code."""
    print("ALL PASS" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


def profile_once(m: int, n: int, dtype: torch.dtype, weight_dtype: torch.dtype, device: torch.device) -> None:
    """--profile_once: our forward and backward launched once at (m, n), for ncu."""
    from model.kernels import rmsnorm_triton as kern
    x = torch.randn(m, n, dtype=dtype, device=device)
    w = (torch.rand(n, device=device) + 0.5).to(weight_dtype)
    _, _, rstd = kern.rms_norm_fwd(x, None, w, EPS, n)
    kern.rms_norm_bwd(torch.randn_like(x), x, w, rstd, n)
    torch.cuda.synchronize()


def timed_machine(device: torch.device) -> str:
    """The machine line of the tables' header; on CUDA with Triton's version."""
    machine = machine_line()
    if device.type == "cuda":
        import triton
        machine += f", triton {triton.__version__}"
    return machine


def time_methods(args: argparse.Namespace, m: int, dtype: torch.dtype, weight_dtype: torch.dtype,
                 device: torch.device) -> None:
    """The timing run: the header, then --sweep's table or the RMSNorm and residual tables (and --out's JSON)."""
    ns = args.n or (GPU_ROW_LENGTHS if device.type == "cuda" else CPU_ROW_LENGTHS)
    ceiling = copy_bandwidth_gbs(device)
    machine = timed_machine(device)
    print(f"# RMSNorm benchmark: {machine}; {str(dtype).removeprefix('torch.')} activations, "
          f"{str(weight_dtype).removeprefix('torch.')} weight, p={args.p}, copy bandwidth {ceiling:.0f} GB/s\n")
    results: dict = {"machine": machine, "copy_gbs": ceiling, "dtype": str(dtype),
                     "weight_dtype": str(weight_dtype), "M": m}
    if args.sweep:
        print("## Our kernels per launch configuration (kernel-only, plain RMSNorm)\n")
        results["sweep"] = sweep(m, ns, dtype, weight_dtype, device)
        print_sweep(results["sweep"], ceiling)
    else:
        print("## RMSNorm (y = norm(x))\n")
        results["norm"] = [row for n in ns for row in bench_shape(m, n, args.p, dtype, weight_dtype, device,
                                                                  residual=False, only=args.methods)]
        print_table(results["norm"], ceiling)
        if not args.no_residual:
            print("\n## Residual add + RMSNorm (h = x + r; y = norm(h))\n")
            results["residual"] = [row for n in ns for row in bench_shape(m, n, args.p, dtype, weight_dtype, device,
                                                                          residual=True, only=args.methods)]
            print_table(results["residual"], ceiling)
    if args.out:
        atomic_write_text(args.out, strict_json(results, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.out is not None:
        try:  # a folder there, or a file in the way of its folder: refused now, not after the timing
            check_folder_path(Path(args.out), "--out", itself=False)
        except ValueError as error:
            ap.error(str(error))
    device = chosen_device(ap, args)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    weight_dtype = dtype if args.weight_dtype == "same" else DTYPES[args.weight_dtype]
    refuse_modes_the_device_lacks(ap, args, device)
    m = args.m or (32768 if device.type == "cuda" else 1024)

    if args.lab:
        return lab_main(args, dtype)
    if args.check_model:
        return passed(check_model(device))
    if args.profile_once:
        profile_once(m, args.profile_once, dtype, weight_dtype, device)
        return 0
    if args.profile_host:
        profile_host(m, args.profile_host, dtype, weight_dtype, device, args.methods)
        return 0
    if args.check:
        return passed(check_kernels(args.n, args.m, dtype, device, big=not args.no_big))
    too_large = shape_too_large(m, args.n or (GPU_ROW_LENGTHS if device.type == "cuda" else CPU_ROW_LENGTHS),
                                dtype, device)
    if too_large is not None:
        ap.error(too_large)  # before the copy-bandwidth probe and the narrower shapes' timing
    try:
        time_methods(args, m, dtype, weight_dtype, device)
    except (MemoryError, RuntimeError) as error:  # a shape that fits alone, not with a method's own buffers
        line = allocation_failure_line(error, "lower --m or --n")
        if line is None:
            raise
        return report_error(line)
    return 0


def lab_main(args: argparse.Namespace, dtype: torch.dtype) -> int:
    """--lab: run the interleaved laboratory and print its markdown table (and --out JSON)."""
    import os

    if torch.cuda.is_available() and args.device != "cpu":
        print("--lab times the CPU paths: run it with --device cpu", file=sys.stderr)
        return 2
    threads = torch.get_num_threads()
    start_load = os.getloadavg()[0]
    variants, setup = run_lab(args.lab_norms, args.rounds, args.norm_repeats, args.lab_steps, args.lab_warmup, dtype,
                              log=lambda line: print(line, file=sys.stderr, flush=True))
    header = (f"{machine_line()}; {threads} threads; load average {start_load:.2f} at start, "
              f"{os.getloadavg()[0]:.2f} at the end; norm: {setup['norm_dtype']} input {setup['batch_size']} x "
              f"{setup['seq_len']} x {setup['hidden_size']}, norm_impl {setup['norm_impl']}, median of "
              f"{args.norm_repeats} calls; step: {setup['preset']} model, batch {setup['batch_size']} x "
              f"{setup['seq_len']}, {setup['optimizer']}, {setup['step_dtype']}, eager, median of {args.lab_steps} "
              f"steps; {args.rounds} interleaved rounds, median over rounds")
    print(f"# Norm laboratory: {header}\n")
    print(lab_table(variants))
    if args.out:
        rows = [{"norm": v.name, "norm_ms": v.norm_ms, "step_ms": v.step_ms} for v in variants]
        atomic_write_text(args.out, strict_json({"header": header, "setup": setup, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    run_main(main)
