"""Compile the fused RMSNorm kernels for an NVIDIA GPU, on any machine, and print their resource usage.

    python eval/benchmarks/kernel_build.py                     # sm_90 (H100/H200), bf16, N = 96 .. 16384
    python eval/benchmarks/kernel_build.py --arch 80 --dtype fp16 --n 4096

No GPU is needed: triton's bundled compiler and ptxas build the cubin a GPU would load, with the arguments our
launch planner would pass (see model/kernels/cuda_build.py). The table shows, per row length, each kernel's launch
configuration, registers per thread and spills to local memory, for plain RMSNorm and for the fused residual add
+ partial RMSNorm (the variant with the most live values). It does not measure speed
(eval/benchmarks/bench_norm.py does, on the GPU).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script from the repo root or from eval/
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trainer.cli import quiet_ctrl_c_while_loading  # noqa: E402

quiet_ctrl_c_while_loading(__name__)  # a Ctrl-C while the imports below load: one line, exit 130

import torch  # noqa: E402
import triton  # noqa: E402

from model.kernels.cuda_build import H100_SMS, build  # noqa: E402
from model.kernels.dtypes import DTYPES  # noqa: E402
from model.kernels.rmsnorm_triton import MAX_N, LaunchTuning  # noqa: E402
from model.rmsnorm_math import P_RANGE  # noqa: E402
from trainer.cli import RawDescriptionDefaultsHelpFormatter, ToolParser, float_within, int_within, run_main  # noqa: E402
from trainer.machine import machine_line  # noqa: E402

GPU_ROW_LENGTHS = [96, 512, 768, 1024, 2048, 4096, 8192, 16384]
# A program's warps (Triton's num_warps): a power of two, at most a CUDA block's 1024 threads (32 warps)
WARPS = (1, 2, 4, 8, 16, 32)
OLDEST_ARCH = 80  # sm_80 (A100): the oldest target the kernels are built for (tests/integration/test_kernel_build.py)
# sm_121 (DGX Spark's GB10): the newest target triton's bundled compiler knows (a later one ended in an LLVM
# error after its 'not a recognized processor' lines)
NEWEST_ARCH = 121
MOST_SMS = 192  # the SMs of the largest GPU die (GB202, whose RTX PRO 6000 enables 188; an H100 SXM's 132)
# The deepest software pipeline of the backward's row loop a GPU can hold: each stage past the first keeps the next
# rows' x and dy tiles in shared memory, at the table's narrowest row (n = 96: 128 x 16 tiles, 8,192 bytes a stage in
# a 16-bit dtype; wider rows and fp32 take more) 28 x 8,192 bytes fit the 227 KiB (232,448 bytes) the largest GPUs
# (sm_90, sm_100) give a program and 29 do not (ptxas: 8,256 bytes at 2 stages, 255,936 at 32). Rows narrower still
# load too little to be staged at all, so a deeper pipeline only lengthens the compile (~2 s a stage: 128 stages took
# 300 s, 1000 had not compiled after minutes).
MOST_BWD_STAGES = 29


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ToolParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=RawDescriptionDefaultsHelpFormatter, epilog=__doc__)
    parser.add_argument("--arch", type=int_within(OLDEST_ARCH, NEWEST_ARCH), default=90,
                        help="compute capability x10: 80 (A100), 90 (H100/H200), 100 (B200), 120 (RTX 50)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="activation dtype (weights fp32)")
    parser.add_argument("--n", type=int_within(1, MAX_N), nargs="+", default=GPU_ROW_LENGTHS,
                        help=f"row lengths (at most {MAX_N}, the Triton kernels' longest row)")
    parser.add_argument("--p", type=float_within(*P_RANGE, above_low=True), default=0.5,
                        help="partial RMSNorm fraction of the fused variant")
    parser.add_argument("--sm_count", type=int_within(1, MOST_SMS), default=H100_SMS,
                        help="SMs (sets the backward grid)")
    parser.add_argument("--fwd_warps", type=int_within(1, WARPS[-1]), choices=WARPS, default=None,
                        help="override the forward's warps")
    parser.add_argument("--bwd_warps", type=int_within(1, WARPS[-1]), choices=WARPS, default=None,
                        help="override the backward's warps")
    parser.add_argument("--bwd_stages", type=int_within(1, MOST_BWD_STAGES), default=None,
                        help=f"software-pipeline stages of the backward's row loop (1: none; default: the heuristic's; "
                             f"at most {MOST_BWD_STAGES}, the most a GPU's shared memory holds at n = 96)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print(f"# Fused RMSNorm kernels compiled for sm_{args.arch} ({args.dtype} activations, fp32 weights, "
          f"backward pipeline stages {args.bwd_stages or 'by heuristic'}), triton {triton.__version__}; "
          f"{machine_line()}\n")
    print("| variant | kernel | N | BLOCK_N × BLOCK_M | warps | stages | registers/thread | spill stores (B/thread) "
          "| shared memory (B) | bar.sync | cp.async |")
    print("|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    dtype = DTYPES[args.dtype]
    tuning = LaunchTuning(fwd_warps=args.fwd_warps, bwd_warps=args.bwd_warps, bwd_stages=args.bwd_stages)
    variants = [(None, "RMSNorm"), (dtype, f"add + pRMSNorm (p={args.p:g})")]
    if dtype != torch.float32:
        variants.append((torch.float32, f"add + pRMSNorm (p={args.p:g}), fp32 residual"))
    for residual_dtype, variant in variants:
        for n in args.n:
            for r in build(n, dtype, residual_dtype=residual_dtype, p=args.p if residual_dtype else 1.0,
                           arch=args.arch, sm_count=args.sm_count, tuning=tuning):
                print(f"| {variant} | {r.kernel} | {n} | {r.block_n} × {r.block_m} | {r.num_warps} | {r.stages} | "
                      f"{r.registers} | {r.spill_store_bytes} | {r.shared_bytes} | {r.barriers} | "
                      f"{r.async_copies} |", flush=True)


if __name__ == "__main__":
    run_main(main)
