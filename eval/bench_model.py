"""Training throughput of MiniNorm vs transformers' LlamaForCausalLM of identical shape, and per-norm timings.

    python eval/bench_model.py                      # cpu-default and minimind-26m, fp32 and bf16 autocast
    python eval/bench_model.py --presets cpu-default --steps 20 --seq_len 512 --batch_size 4

Both models run in one process, side by side: each repetition times one training step (forward + backward +
AdamW) of ours, then one of Llama, so a noisy neighbour slows both alike; the table reports medians. Our model
uses norm_impl="compile" (what "auto" picks on CPU); Llama uses its default SDPA attention. The second table
times forward + backward of each norm on a (rows, dim) input, again interleaved, median over repetitions.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from any directory

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

from model.config import MiniNormConfig  # noqa: E402
from model.llama_compat import to_llama_config, to_llama_state_dict  # noqa: E402
from model.model import MiniNormForCausalLM  # noqa: E402
from model.norms import RMSNorm, rms_norm_eager  # noqa: E402
from trainer.args import cpu_has_fast_bf16  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="cpu-default,minimind-26m", help="comma-separated config presets")
    parser.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: fp32, bf16 (autocast)")
    parser.add_argument("--steps", type=int, default=12, help="timed training steps per model and setting")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation, allocator)")
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--norm_rows", type=int, default=4096)
    parser.add_argument("--norm_dim", type=int, default=512)
    parser.add_argument("--norm_reps", type=int, default=50)
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--force_bf16", action="store_true",
                        help="time bf16 even where the CPU has no fast bf16 GEMM (can take minutes per step)")
    parser.add_argument("--skip_models", action="store_true", help="only the norm table")
    parser.add_argument("--skip_norms", action="store_true", help="only the model table")
    return parser.parse_args(argv)


def autocast(dtype: str) -> contextlib.AbstractContextManager:
    if dtype == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def gemm_gflops(dtype: torch.dtype, m: int = 1024, k: int = 512, n: int = 1408, reps: int = 5) -> float:
    """Median GFLOP/s of one (m, k) @ (k, n) product: shows whether this CPU has a fast bf16 GEMM (AMX,
    AVX512-BF16) or emulates it (AVX2 only: bf16 is then ~30x slower than fp32)."""
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    a @ b
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * m * k * n / statistics.median(times) / 1e9


def build_pair(preset: str) -> tuple[MiniNormForCausalLM, LlamaForCausalLM]:
    """Our model (compiled norms) and a Llama with the same shape and the same initial weights."""
    torch.manual_seed(0)
    ours = MiniNormForCausalLM(MiniNormConfig.from_preset(preset, norm_impl="compile"))
    llama_config = to_llama_config(ours.config)
    llama_config._attn_implementation = "sdpa"
    llama = LlamaForCausalLM(llama_config)
    llama.load_state_dict({k: v.clone() for k, v in to_llama_state_dict(ours.state_dict()).items()})
    return ours.train(), llama.train()


def make_step(model: nn.Module, ids: torch.Tensor, dtype: str) -> Callable[[], float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> float:
        start = time.perf_counter()
        with autocast(dtype):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    return step


def interleaved_medians(fns: dict[str, Callable[[], float]], reps: int, warmup: int) -> dict[str, float]:
    """Median seconds per call of each fn, calling them round-robin so load changes hit all alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            times[name].append(fn())
    return {name: statistics.median(ts) for name, ts in times.items()}


def bench_models(args: argparse.Namespace) -> list[list[str]]:
    rows = []
    tokens = args.batch_size * args.seq_len
    for preset in args.presets.split(","):
        ours, llama = build_pair(preset)
        params = sum(p.numel() for p in ours.parameters())
        ids = torch.randint(0, ours.config.vocab_size, (args.batch_size, args.seq_len),
                            generator=torch.Generator().manual_seed(0))
        for dtype in args.dtypes.split(","):
            if dtype == "bf16" and args.slow_bf16 and not args.force_bf16:
                rows.append([preset, f"{params / 1e6:.1f}M", dtype, "not timed", "not timed", "slow bf16 GEMM"])
                print("  " + " | ".join(rows[-1]), flush=True)
                continue
            medians = interleaved_medians({"ours": make_step(ours, ids, dtype), "llama": make_step(llama, ids, dtype)},
                                          args.steps, args.warmup)
            ours_tps, llama_tps = tokens / medians["ours"], tokens / medians["llama"]
            rows.append([preset, f"{params / 1e6:.1f}M", dtype, f"{ours_tps:,.0f}", f"{llama_tps:,.0f}",
                         f"{ours_tps / llama_tps:.2f}x"])
            print("  " + " | ".join(rows[-1]), flush=True)
    return rows


def norm_fwd_bwd(module: nn.Module | Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                 dy: torch.Tensor) -> Callable[[], float]:
    def run() -> float:
        xi = x.detach().requires_grad_(True)
        start = time.perf_counter()
        module(xi).backward(dy)
        return time.perf_counter() - start

    return run


def bench_norms(args: argparse.Namespace) -> list[list[str]]:
    dim = args.norm_dim
    torch.manual_seed(0)
    x, dy = torch.randn(args.norm_rows, dim), torch.randn(args.norm_rows, dim)
    weight = nn.Parameter(torch.ones(dim))
    compiled_eager = torch.compile(rms_norm_eager, dynamic=None)
    candidates: dict[str, Callable[[], float]] = {
        "RMSNorm eager": norm_fwd_bwd(RMSNorm(dim, 1e-6, 1.0, "eager"), x, dy),
        "RMSNorm compile": norm_fwd_bwd(RMSNorm(dim, 1e-6, 1.0, "compile"), x, dy),
        "pRMSNorm eager (p=1/16)": norm_fwd_bwd(RMSNorm(dim, 1e-6, 0.0625, "eager"), x, dy),
        "pRMSNorm compile (p=1/16)": norm_fwd_bwd(RMSNorm(dim, 1e-6, 0.0625, "compile"), x, dy),
        # What norm_impl="compile" used to be: torch.compile of the eager formula, differentiated by AOTAutograd.
        "torch.compile(rms_norm_eager)": norm_fwd_bwd(
            lambda t: compiled_eager(t, weight, 1e-6, dim), x, dy),
        "F.rms_norm": norm_fwd_bwd(lambda t: F.rms_norm(t, (dim,), weight, 1e-6), x, dy),
        "nn.LayerNorm": norm_fwd_bwd(nn.LayerNorm(dim, eps=1e-6), x, dy),
    }
    medians = interleaved_medians(candidates, args.norm_reps, warmup=3)
    base = medians["RMSNorm eager"]
    return [[name, f"{seconds * 1e3:.2f}", f"{base / seconds:.2f}x"] for name, seconds in medians.items()]


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"{torch.get_num_threads()} threads, load average {load:.2f} at start", flush=True)
    fp32_rate, bf16_rate = gemm_gflops(torch.float32), gemm_gflops(torch.bfloat16)
    args.slow_bf16 = not cpu_has_fast_bf16()  # the trainer's own rule for --dtype auto; the rates show why
    print(f"GEMM (1024x512 @ 512x1408): fp32 {fp32_rate:.1f} GFLOP/s, bf16 {bf16_rate:.1f} GFLOP/s"
          + (" -- bf16 has no fast path on this CPU; bf16 rows are skipped unless --force_bf16" if args.slow_bf16
             else ""), flush=True)
    if not args.skip_models:
        print(f"\nTraining tokens/s (batch {args.batch_size} x seq {args.seq_len}, forward+backward+AdamW, "
              f"median of {args.steps} interleaved steps):", flush=True)
        rows = bench_models(args)
        print("\n" + markdown_table(["preset", "params", "dtype", "MiniNorm tok/s", "HF Llama tok/s", "ratio"], rows))
    if not args.skip_norms:
        print(f"\nNorm forward+backward, fp32 ({args.norm_rows}, {args.norm_dim}), median of {args.norm_reps}:",
              flush=True)
        rows = bench_norms(args)
        print(markdown_table(["norm", "ms", "speed-up vs eager RMSNorm"], rows))
    end_load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"\nload average {end_load:.2f} at end")


if __name__ == "__main__":
    main()
