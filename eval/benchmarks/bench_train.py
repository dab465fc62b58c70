"""Training-step benchmark through the real trainer: tokens/s and MFU of one optimizer step
(forward + backward + clip + the pretraining default's optimizer: Muon, with AdamW for the embedding and norms;
Accelerate, real packed batches of the default corpus) for

  - MiniNorm with RMSNorm, its norms as norm_impl=auto picks them (triton on CUDA, compile on CPU) and eager,
  - MiniNorm with RMSNorm, the whole model under torch.compile (the trainer's --compile on),
  - MiniNorm with LayerNorm, and
  - transformers' LlamaForCausalLM of the same shape, run through the very same trainer step,

per preset and dtype, measured side by side in one run (interleaved steps, medians; on CUDA each step ends with
a synchronize, so no step's queued kernels are billed to the next variant). A second table times forward +
backward of each norm layer alone on a (rows, dim) fp32 input, interleaved the same way: the norms' own share
of a step, including norm_impl="compile" against the plain torch.compile of the formula it replaced. First, a
GEMM probe shows whether this CPU has a fast bf16 path (AMX / AVX512-BF16); without one, bf16 rows are skipped
(they are ~30x slower than fp32) unless --force_bf16.

    python eval/benchmarks/bench_train.py     # CPU: cpu-default and minimind-26m; CUDA: minimind-26m, minimind-64m
    python eval/benchmarks/bench_train.py --presets cpu-default --dtypes float32,bfloat16 --steps 10
    python eval/benchmarks/bench_train.py --skip_steps --threads 1 --norm_reps 200    # only the norm table
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script, from any directory
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trainer.cli import quiet_ctrl_c_while_loading  # noqa: E402

quiet_ctrl_c_while_loading(__name__)  # a Ctrl-C while the imports below load: one line, exit 130

import argparse  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402
from torch import nn  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

from dataset.building import MIN_SEQ_LEN  # noqa: E402
from model.config import MAX_SIZE, PRESETS  # noqa: E402
from model.llama_compat import to_llama_config  # noqa: E402
from model.norms import RMSNorm, resolve_norm_impl, rms_norm_eager  # noqa: E402
from dataset.shown_value import shown_text, shown_value  # noqa: E402
from trainer.cli import (MAX_COUNT, RawDescriptionDefaultsHelpFormatter, ToolParser, benchmark_threads, float_within,  # noqa: E402
                         int_within, run_main)
from trainer.arg_checks import forward_past_max_size  # noqa: E402
from trainer.arg_fields import DTYPES, build_model_config  # noqa: E402
from trainer.args import parse_args  # noqa: E402
from trainer.machine import cpu_has_fast_bf16, machine_line  # noqa: E402
from trainer.memory import FP32_BYTES, allocation_failure_line, largest_tensor, past_memory, working_on  # noqa: E402
from trainer.run_dir import report_error  # noqa: E402
from trainer.run_inputs import load_run_tokenizer  # noqa: E402
from trainer.core import Trainer  # noqa: E402
from trainer.run_optimizer import make_optimizer, make_scheduler  # noqa: E402
from trainer.step_timer import timed_step  # noqa: E402


def interleaved_times(fns: dict[str, Callable[[], float]], reps: int, warmup: int) -> dict[str, list[float]]:
    """Seconds per call of each fn (each returns its own duration), called round-robin so that changes in the
    machine's load hit all of them alike; the first `warmup` rounds are not kept."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for index in range(warmup + reps):
        for name, fn in fns.items():
            seconds = fn()
            if index >= warmup:
                times[name].append(seconds)
    return times


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


# --------------------------------------------------------------------------- the training step
def trainer_argv(preset: str, dtype: str, norm_type: str, batch_size: int, seq_len: int, out_dir: str,
                 norm_impl: str = "auto", peak_flops: float | None = None, compile_model: bool = False) -> list[str]:
    """The pretraining flags of a variant's trainer: everything else, the optimizer included, is the default's."""
    argv = ["--preset", preset, "--dtype", dtype, "--norm_type", norm_type, "--norm_impl", norm_impl,
            "--batch_size", str(batch_size), "--max_seq_len", str(seq_len), "--out_dir", out_dir, "--max_steps", "1000",
            "--compile", "on" if compile_model else "off"]
    if peak_flops:
        argv += ["--peak_flops", str(peak_flops)]
    return argv


def make_trainer(*args: Any, **kwargs: Any) -> Trainer:
    AcceleratorState._reset_state(reset_partial_state=True)
    return Trainer(parse_args("pretrain", trainer_argv(*args, **kwargs)))


def step_title(args: argparse.Namespace, optimizer: str) -> str:
    """The step table's title, naming the optimizer the variants' trainers step (`optimizer`, their --optimizer)."""
    return (f"Training step (fwd + bwd + clip + {optimizer} step) through trainer/core.py, batch {args.batch_size} x "
            f"{args.seq_len}, median of {args.steps} interleaved steps")


def swap_in_llama(trainer: Trainer) -> None:
    """Put a LlamaForCausalLM of the same shape into the trainer's step."""
    llama = LlamaForCausalLM(to_llama_config(trainer.unwrapped.config))
    optimizer = make_optimizer(llama, trainer.args, trainer.accelerator.device)
    scheduler = make_scheduler(optimizer, trainer.args, trainer.total_steps)  # the same schedule, Llama's optimizer
    trainer.model, trainer.optimizer, trainer.scheduler = trainer.accelerator.prepare(llama, optimizer, scheduler)


STEP_VARIANTS = ("rms", "rms_eager", "rms_compiled", "ln", "llama")  # the keys of bench_steps' makers


def step_variants(text: str) -> str:
    """--variants, checked as it is parsed (before the machine line and the GEMM probe take their seconds)."""
    names = text.split(",")
    unknown = [name for name in names if name not in STEP_VARIANTS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {shown_text(','.join(unknown))}; allowed: {','.join(STEP_VARIANTS)}")
    if "llama" not in names:
        raise argparse.ArgumentTypeError(f"{shown_value(text)} lacks llama, the baseline the table compares the "
                                         f"others with")
    return text


def comma_list_of(allowed: tuple[str, ...]) -> Callable[[str], str]:
    """A comma-separated flag's type whose every name is one of `allowed` (the trainer's --preset or --dtype values),
    checked as it is parsed: a wrong one was the trainer's refusal of its own flag (--preset, not --presets), after
    the GEMM probe and every earlier preset's timing."""
    def names(text: str) -> str:
        unknown = [name for name in text.split(",") if name not in allowed]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {shown_text(','.join(unknown))}; allowed: {','.join(allowed)}")
        return text

    return names


# The trainer's flags in its refusals, as bench_train's own: the one it sets from another of bench_train's (--seq_len
# is the trainer's --max_seq_len), and the remedies naming one bench_train leaves at its default (--accumulation_steps).
TRAINER_WORDS = ((" (a higher --accumulation_steps keeps the effective batch)", ""), (" or --accumulation_steps", ""),
                 ("--max_seq_len", "--seq_len"))


def in_bench_flags(refusal: str) -> str:
    """A trainer's refusal of the flags bench_train gave it (trainer_argv), in bench_train's flags (TRAINER_WORDS)."""
    for trainer_words, bench_words in TRAINER_WORDS:
        refusal = refusal.replace(trainer_words, bench_words)
    return refusal


def step_table_too_large(args: argparse.Namespace, presets: list[str], device: torch.device) -> str | None:
    """Why a preset's trainer would refuse its --batch_size x --seq_len (None: none would): a --seq_len past the
    model's positions, or one micro-batch's logits, as trainer/memory.py counts them, more than all the memory of
    `device`. Said in this benchmark's flags, and for every preset before any is timed: the trainer's own refusal
    named its --max_seq_len and --accumulation_steps, after the machine line, the GEMM probe and every earlier
    preset's rows."""
    tokens = args.batch_size * args.seq_len  # the trainer's parse_args refuses past MAX_SIZE, in its own flags
    if tokens > MAX_SIZE:
        return (f"{forward_past_max_size(f'--batch_size {args.batch_size} rows', f'--seq_len {args.seq_len}', tokens)}"
                f": lower --batch_size or --seq_len")
    tokenizer = None
    for preset in presets:
        train_args = parse_args("pretrain", trainer_argv(preset, "float32", "rmsnorm", args.batch_size, args.seq_len,
                                                         "out/bench_train"))
        tokenizer = tokenizer or load_run_tokenizer(train_args)  # the trainer's vocabulary is its tokenizer's
        config = build_model_config(train_args, len(tokenizer))
        if args.seq_len > config.max_position_embeddings:  # trainer/core.py's _base_model refuses it
            return (f"--seq_len {args.seq_len} is more than the {preset} model's {config.max_position_embeddings} "
                    f"positions (its max_position_embeddings): lower --seq_len")
        logits = largest_tensor(train_args, config.vocab_size, config.max_position_embeddings)
        refusal = past_memory(logits.bytes, f"the {preset} trainer's one micro-batch's logits", device,
                              "lower --batch_size or --seq_len",
                              f"--batch_size {logits.rows} rows x --seq_len {logits.tokens} tokens x "
                              f"{logits.vocab_size} vocabulary x {FP32_BYTES} bytes, fp32")
        if refusal is not None:
            return refusal
    return None


def bench_steps(args: argparse.Namespace, presets: list[str], auto_impl: str, on_cpu: bool) -> None:
    variants = args.variants.split(",")
    # The table's rows print as each preset and dtype finishes (a minimind-26m step on a CPU takes seconds, and the
    # compiled variants compile first): a long run shows its progress.
    optimizer = parse_args("pretrain", trainer_argv(presets[0], "float32", "rmsnorm", args.batch_size, args.seq_len,
                                                    "out/bench_train")).optimizer
    print(f"\n{step_title(args, optimizer)}\n")
    print("| preset | dtype | variant | step (ms) | tokens/s | MFU | vs HF Llama | first step (s) |")
    print("|---|---|---|---|---|---|---|---|", flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        for preset in presets:
            for dtype in args.dtypes.split(","):
                if on_cpu and dtype == "bfloat16" and not (cpu_has_fast_bf16() or args.force_bf16):
                    print_step_rows(args, preset, dtype, None)
                    continue
                print(f"timing {preset} {dtype}: {len(variants)} variants, {args.warmup} warm-up and {args.steps} "
                      f"timed steps each", file=sys.stderr, flush=True)

                def make(folder: str, norm_type: str, norm_impl: str = "auto", preset: str = preset,
                         dtype: str = dtype, compile_model: bool = False) -> Trainer:
                    return make_trainer(preset, dtype, norm_type, args.batch_size, args.seq_len,
                                        f"{scratch}/{folder}", norm_impl, args.peak_flops, compile_model)

                makers = {
                    "rms": (f"MiniNorm RMSNorm ({auto_impl})", lambda: make("rms", "rmsnorm")),
                    "rms_eager": ("MiniNorm RMSNorm (eager)", lambda: make("rms_eager", "rmsnorm", "eager")),
                    "rms_compiled": ("MiniNorm RMSNorm, --compile on",
                                     lambda: make("rms_compiled", "rmsnorm", compile_model=True)),
                    "ln": ("MiniNorm LayerNorm", lambda: make("ln", "layernorm")),
                    "llama": ("HF Llama", lambda: make("llama", "rmsnorm")),
                }
                try:
                    trainers = {makers[key][0]: makers[key][1]() for key in variants}
                except ValueError as error:  # the trainer's refusal of these flags (too few rows in its data)
                    raise SystemExit(report_error(f"the {preset} {dtype} trainer refuses --batch_size "
                                                  f"{args.batch_size} with --seq_len {args.seq_len}: "
                                                  f"{in_bench_flags(str(error))}")) from None
                swap_in_llama(trainers["HF Llama"])
                steps = {name: timed_step(t) for name, t in trainers.items()}
                # The first step of each (compilation included) is timed on its own and reported, not medianed.
                first = {name: step() for name, step in steps.items()}
                times = interleaved_times(steps, args.steps, max(args.warmup - 1, 0))
                print_step_rows(args, preset, dtype, {name: (statistics.median(t), trainers[name], first[name])
                                                      for name, t in times.items()})


def print_step_rows(args: argparse.Namespace, preset: str, dtype: str,
                    results: dict[str, tuple[float, Trainer, float]] | None) -> None:
    """One preset and dtype's rows of the step table (None: skipped, no fast bf16 on this CPU)."""
    if results is None:
        print(f"| {preset} | {dtype} | skipped: this CPU has no AMX/AVX512-BF16 (bf16 ~30x slower than fp32; "
              f"--force_bf16 to time it) | | | | | |", flush=True)
        return
    tokens = args.batch_size * args.seq_len
    llama_time = results["HF Llama"][0]
    for name, (seconds, trainer, first) in results.items():
        tokens_per_s = tokens / seconds
        mfu = trainer.reporter.mfu(tokens_per_s)
        print(f"| {preset} | {dtype} | {name} | {seconds * 1000:.0f} | {tokens_per_s:,.0f} | {mfu:.1%} | "
              f"{llama_time / seconds:.2f}x | {first:.1f} |", flush=True)


# --------------------------------------------------------------------------- the norms alone
NORM_TENSORS = 4  # held at once in each timed call of the norm table: its input x, dy, a norm's output and dx


def norm_table_too_large(args: argparse.Namespace) -> str | None:
    """Why the norm table's (--norm_rows, --norm_dim) fp32 tensors cannot be held on this machine (None: they may
    be): they alone are more than all of its memory (trainer/memory.py's past_memory, as the trainer checks its
    logits), so the run would end in the allocator's traceback, or a kill, after the step table's minutes."""
    needed = NORM_TENSORS * args.norm_rows * args.norm_dim * FP32_BYTES
    return past_memory(needed, f"--norm_rows {args.norm_rows} x --norm_dim {args.norm_dim}: the norm table's "
                               f"{NORM_TENSORS} fp32 tensors of that shape (input, dy, output, dx)",
                       torch.device("cpu"),  # bench_norms times on the CPU
                       "lower --norm_rows or --norm_dim, or give --skip_norms")


def norm_fwd_bwd(module: nn.Module | Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                 dy: torch.Tensor) -> Callable[[], float]:
    def run() -> float:
        xi = x.detach().requires_grad_(True)
        start = time.perf_counter()
        module(xi).backward(dy)
        return time.perf_counter() - start

    return run


def bench_norms(args: argparse.Namespace) -> None:
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
        "torch.compile(rms_norm_eager)": norm_fwd_bwd(lambda t: compiled_eager(t, weight, 1e-6, dim), x, dy),
        "F.rms_norm": norm_fwd_bwd(lambda t: F.rms_norm(t, (dim,), weight, 1e-6), x, dy),
        "nn.LayerNorm": norm_fwd_bwd(nn.LayerNorm(dim, eps=1e-6), x, dy),
    }
    print(f"\nNorm forward+backward, fp32 ({args.norm_rows}, {dim}), median of {args.norm_reps}:", flush=True)
    medians = {name: statistics.median(t)
               for name, t in interleaved_times(candidates, args.norm_reps, warmup=3).items()}
    base = medians["RMSNorm eager"]
    print("| norm | ms | speed-up vs eager RMSNorm |")
    print("|---|---|---|")
    for name, seconds in medians.items():
        print(f"| {name} | {seconds * 1e3:.2f} | {base / seconds:.2f}x |")


def main(argv: list[str] | None = None) -> None:
    parser = ToolParser(description=__doc__, formatter_class=RawDescriptionDefaultsHelpFormatter)
    parser.add_argument("--presets", type=comma_list_of(tuple(PRESETS)), default=None,
                        help="comma-separated (default: cpu-default,minimind-26m on CPU; minimind-26m,minimind-64m "
                             "on CUDA)")
    parser.add_argument("--dtypes", type=comma_list_of(DTYPES), default="float32,bfloat16",
                        help="comma-separated dtypes of the step table")
    parser.add_argument("--steps", type=int_within(1, MAX_COUNT), default=6, help="timed training steps per variant")
    parser.add_argument("--warmup", type=int_within(0, MAX_COUNT), default=2,
                        help="steps before the timed ones (the first, with any compilation, is reported on its own)")
    parser.add_argument("--variants", type=step_variants, default=",".join(STEP_VARIANTS),
                        help="comma-separated: rms (norm_impl auto), rms_eager, rms_compiled (--compile on), ln, "
                             "llama (required: the baseline)")
    parser.add_argument("--batch_size", type=int_within(1, MAX_SIZE), default=8, help="sequences per training step")
    parser.add_argument("--seq_len", type=int_within(MIN_SEQ_LEN, MAX_SIZE), default=256, help="tokens per sequence")
    parser.add_argument("--peak_flops", type=float_within(0, math.inf, above_low=True), default=None,
                        help="FLOP/s for MFU (default: the trainer's known value for the device and dtype)")
    parser.add_argument("--force_bf16", action="store_true", help="time bf16 even on CPUs without fast bf16")
    parser.add_argument("--norm_rows", type=int_within(1, MAX_SIZE), default=4096,
                        help="rows of the norm table's input")
    parser.add_argument("--norm_dim", type=int_within(1, MAX_SIZE), default=512,
                        help="row length of the norm table's input")
    parser.add_argument("--norm_reps", type=int_within(1, MAX_COUNT), default=50,
                        help="timed calls of each norm (median reported)")
    parser.add_argument("--threads", type=benchmark_threads("0: torch's default"), default=0,
                        help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--skip_steps", action="store_true", help="only the norm table")
    parser.add_argument("--skip_norms", action="store_true", help="only the training-step table")
    args = parser.parse_args(argv)
    on_cpu = not torch.cuda.is_available()
    presets = (args.presets or ("cpu-default,minimind-26m" if on_cpu else "minimind-26m,minimind-64m")).split(",")
    # before the machine line, the GEMM probe and the step table
    if not args.skip_norms and (too_large := norm_table_too_large(args)) is not None:
        parser.error(too_large)
    device = torch.device("cpu") if on_cpu else torch.device("cuda", torch.cuda.current_device())
    if not args.skip_steps and (too_large := step_table_too_large(args, presets, device)) is not None:
        parser.error(too_large)
    if args.threads:
        torch.set_num_threads(args.threads)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"{machine_line()}; load average {load:.2f} at start", flush=True)
    fp32_rate, bf16_rate = gemm_gflops(torch.float32), gemm_gflops(torch.bfloat16)
    print(f"CPU GEMM (1024x512 @ 512x1408): fp32 {fp32_rate:.1f} GFLOP/s, bf16 {bf16_rate:.1f} GFLOP/s; "
          f"fast bf16 (AMX/AVX512-BF16, the trainer's rule for --dtype auto): {cpu_has_fast_bf16()}", flush=True)
    remedy = "lower --batch_size or --seq_len"
    try:
        if not args.skip_steps:
            auto_impl = resolve_norm_impl("auto", torch.device("cpu" if on_cpu else "cuda")).value
            with working_on("the step table"):
                bench_steps(args, presets, auto_impl, on_cpu)
        if not args.skip_norms:
            remedy = "lower --norm_rows or --norm_dim"
            with working_on("the norm table"):
                bench_norms(args)
    except (MemoryError, RuntimeError) as error:  # sizes that fit the memory alone but not with the rest: one line
        line = allocation_failure_line(error, remedy)
        if line is None:
            raise
        raise SystemExit(report_error(line)) from None
    end_load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"\nload average {end_load:.2f} at end")


if __name__ == "__main__":
    run_main(main)
