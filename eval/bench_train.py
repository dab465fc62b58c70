"""Training-step benchmark through the real trainer: tokens/s and MFU of one optimizer step
(forward + backward + clip + AdamW, Accelerate, real packed batches of the default corpus) for

  - MiniNorm with RMSNorm, its norms as norm_impl=auto picks them (triton on CUDA, compile on CPU) and eager,
  - MiniNorm with LayerNorm, and
  - transformers' LlamaForCausalLM of the same shape, run through the very same trainer step,

per preset and dtype, measured side by side in one run (interleaved steps, medians; on CUDA each step ends with
a synchronize, so no step's queued kernels are billed to the next variant).

    python eval/bench_train.py          # CPU: cpu-default and minimind-26m; CUDA: minimind-26m and minimind-64m
    python eval/bench_train.py --presets cpu-default --dtypes float32,bfloat16 --steps 10
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

from model.llama_compat import to_llama_config  # noqa: E402
from model.norms import resolve_norm_impl  # noqa: E402
from trainer.args import cpu_has_fast_bf16, parse_args  # noqa: E402
from trainer.core import Trainer  # noqa: E402
from trainer.optim import build_optimizer  # noqa: E402
from trainer.schedule import warmup_cosine  # noqa: E402


def make_trainer(preset: str, dtype: str, norm_type: str, batch_size: int, seq_len: int, out_dir: str,
                 norm_impl: str = "auto", peak_flops: float | None = None) -> Trainer:
    AcceleratorState._reset_state(reset_partial_state=True)
    argv = ["--preset", preset, "--dtype", dtype, "--norm_type", norm_type, "--norm_impl", norm_impl,
            "--batch_size", str(batch_size), "--max_seq_len", str(seq_len), "--out_dir", out_dir, "--max_steps", "1000"]
    if peak_flops:
        argv += ["--peak_flops", str(peak_flops)]
    return Trainer(parse_args("pretrain", argv))


def swap_in_llama(trainer: Trainer) -> None:
    """Put a LlamaForCausalLM of the same shape (and weights) into the trainer's step."""
    llama = LlamaForCausalLM(to_llama_config(trainer.unwrapped.config))
    optimizer = build_optimizer(llama, trainer.args.learning_rate, trainer.args.weight_decay)
    args = trainer.args
    scheduler = warmup_cosine(optimizer, min(args.warmup_steps, trainer.total_steps), trainer.total_steps,
                              args.min_lr_ratio)  # the same schedule, now stepping Llama's optimizer
    trainer.model, trainer.optimizer, trainer.scheduler = trainer.accelerator.prepare(llama, optimizer, scheduler)


def time_steps(trainers: dict[str, Trainer], steps: int, warmup: int) -> dict[str, list[float]]:
    batches = {name: iter(t.train_loader) for name, t in trainers.items()}
    times: dict[str, list[float]] = {name: [] for name in trainers}
    for index in range(warmup + steps):
        for name, trainer in trainers.items():  # interleaved: each repetition times every variant once
            batch = next(batches[name])
            started = time.perf_counter()
            trainer._optimizer_step([batch], arm_diagnostics=False)
            if trainer.accelerator.device.type == "cuda":
                torch.cuda.synchronize()
            if index >= warmup:
                times[name].append(time.perf_counter() - started)
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default=None, help="comma-separated (default: cpu-default,minimind-26m on "
                                                            "CPU; minimind-26m,minimind-64m on CUDA)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--peak_flops", type=float, default=None,
                        help="FLOP/s for MFU (default: the trainer's known value for the device and dtype)")
    parser.add_argument("--force_bf16", action="store_true", help="time bf16 even on CPUs without fast bf16")
    args = parser.parse_args(argv)
    on_cpu = not torch.cuda.is_available()
    presets = args.presets or ("cpu-default,minimind-26m" if on_cpu else "minimind-26m,minimind-64m")
    auto_impl = resolve_norm_impl("auto", torch.device("cpu" if on_cpu else "cuda")).value
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for preset in presets.split(","):
            for dtype in args.dtypes.split(","):
                if on_cpu and dtype == "bfloat16" and not (cpu_has_fast_bf16() or args.force_bf16):
                    rows.append((preset, dtype, None))
                    continue
                def make(folder: str, norm_type: str, norm_impl: str = "auto") -> Trainer:
                    return make_trainer(preset, dtype, norm_type, args.batch_size, args.seq_len,
                                        f"{scratch}/{folder}", norm_impl, args.peak_flops)

                trainers = {
                    f"MiniNorm RMSNorm ({auto_impl})": make("rms", "rmsnorm"),
                    "MiniNorm RMSNorm (eager)": make("rms_eager", "rmsnorm", "eager"),
                    "MiniNorm LayerNorm": make("ln", "layernorm"),
                    "HF Llama": make("llama", "rmsnorm"),
                }
                swap_in_llama(trainers["HF Llama"])
                rows.append((preset, dtype, {name: (statistics.median(t), trainers[name])
                                             for name, t in time_steps(trainers, args.steps, args.warmup).items()}))
    device = torch.cuda.get_device_name() if not on_cpu else f"CPU, {torch.get_num_threads()} threads"
    print(f"\nTraining step (fwd + bwd + clip + AdamW) through trainer/core.py, batch {args.batch_size} x "
          f"{args.seq_len}, median of {args.steps} interleaved steps, {device}, torch {torch.__version__}\n")
    print("| preset | dtype | variant | step (ms) | tokens/s | MFU | vs HF Llama |")
    print("|---|---|---|---|---|---|---|")
    tokens = args.batch_size * args.seq_len
    for preset, dtype, results in rows:
        if results is None:
            print(f"| {preset} | {dtype} | skipped: this CPU has no AMX/AVX512-BF16 (bf16 ~30x slower than fp32; "
                  f"--force_bf16 to time it) | | | | |")
            continue
        llama_time = results["HF Llama"][0]
        for name, (seconds, trainer) in results.items():
            tokens_per_s = tokens / seconds
            mfu = tokens_per_s * trainer.flops_per_token / trainer.peak_flops if trainer.peak_flops else float("nan")
            print(f"| {preset} | {dtype} | {name} | {seconds * 1000:.0f} | {tokens_per_s:,.0f} | {mfu:.1%} | "
                  f"{llama_time / seconds:.2f}x |")


if __name__ == "__main__":
    main()
