"""How the sparse MoE MLP's cost scales with the expert count: forward + backward of one block's MLP.

    python eval/benchmarks/bench_moe.py                       # cpu-wide's width, batch 8 x seq 256, top-1, fp32
    python eval/benchmarks/bench_moe.py --experts 1,4,16 --top_k 2 --threads 2

Every variant runs the same tokens through experts as wide as the dense SwiGLU MLP (moe_intermediate_size =
intermediate_size), so at top-1 each token does the dense MLP's FLOPs plus the router's; what grows with the
expert count is the routing: the per-expert gather / scatter (index_select, index_add) and the number of
smaller matmuls. Variants are run interleaved, round by round, so drifting machine load hits each alike; reported:
the median over rounds of each variant's mean call time, and its ratio to the dense MLP.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `import model...` work from any directory
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trainer.cli import quiet_ctrl_c_while_loading  # noqa: E402

quiet_ctrl_c_while_loading(__name__)  # a Ctrl-C while the imports below load: one line, exit 130

import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from model.config import PRESETS, MiniNormConfig  # noqa: E402
from model.model import SparseMoE, SwiGLU  # noqa: E402
from trainer.cli import MAX_COUNT, ToolParser, benchmark_threads, int_list, int_within, run_main  # noqa: E402
from trainer.machine import machine_line  # noqa: E402
from trainer.memory import FP32_BYTES, allocation_failure_line, past_memory  # noqa: E402
from trainer.run_dir import report_error  # noqa: E402

MLP_TENSORS = 3  # (tokens, hidden) fp32 tensors each call holds at once, at the least: x, the output and dx


def call_seconds(mlp: torch.nn.Module, x: torch.Tensor, calls: int) -> float:
    """Mean seconds of one forward + backward of `mlp` over `x`."""
    start = time.perf_counter()
    for _ in range(calls):
        out = mlp(x)
        (out[0] if isinstance(out, tuple) else out).sum().backward()
    return (time.perf_counter() - start) / calls


def routing(top_k: int, experts: list[int]) -> str:
    """The header's top-k: the one each variant routes to, --top_k lowered to its expert count where it has fewer,
    grouped by the k used ("top-1 with 1 expert, top-2 with 2,4 experts")."""
    used: dict[int, list[int]] = {}
    for count in dict.fromkeys(experts):
        used.setdefault(min(top_k, count), []).append(count)
    if len(used) == 1:
        return f"top-{next(iter(used))}"
    return ", ".join(f"top-{k} with {','.join(map(str, counts))} expert{'s' if counts != [1] else ''}"
                     for k, counts in used.items())


def main(argv: list[str] | None = None) -> None:
    parser = ToolParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="cpu-wide", choices=list(PRESETS),
                        help="model preset whose MLP width every variant takes")
    parser.add_argument("--experts", type=int_list(1), default="1,2,4,8,16",
                        help="expert counts to time besides the dense MLP")
    parser.add_argument("--top_k", type=int_within(1), default=1, help="experts each token is routed to")
    parser.add_argument("--batch_size", type=int_within(1), default=8, help="sequences per call")
    parser.add_argument("--seq_len", type=int_within(1), default=256, help="tokens per sequence")
    parser.add_argument("--rounds", type=int_within(1, MAX_COUNT), default=5,
                        help="interleaved rounds over all variants (median reported)")
    parser.add_argument("--calls", type=int_within(1, MAX_COUNT), default=5, help="calls per variant per round")
    parser.add_argument("--threads", type=benchmark_threads(), default=1, help="torch threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dense_config = MiniNormConfig.from_preset(args.preset)
    needed = MLP_TENSORS * args.batch_size * args.seq_len * dense_config.hidden_size * FP32_BYTES
    refusal = past_memory(needed, f"--batch_size {args.batch_size} x --seq_len {args.seq_len}: the {MLP_TENSORS} fp32 "
                                  f"tensors of that many tokens x hidden {dense_config.hidden_size} a call holds "
                                  f"(input, output, its gradient)", torch.device("cpu"),
                          "lower --batch_size or --seq_len")
    if refusal is not None:  # as the trainer refuses its logits
        parser.error(refusal)
    variants: dict[str, torch.nn.Module] = {"dense": SwiGLU(dense_config)}
    for count in args.experts:
        config = MiniNormConfig.from_preset(args.preset, num_experts=count, num_experts_per_tok=min(args.top_k, count))
        moe = SparseMoE(config)
        for module in moe.modules():  # a trained router's spread, so tokens land on every expert
            if isinstance(module, torch.nn.Linear):
                torch.nn.init.normal_(module.weight, std=0.02 if module is not moe.gate else 1.0)
        variants[f"{count} experts"] = moe
    times: dict[str, list[float]] = {name: [] for name in variants}
    try:
        x = torch.randn(args.batch_size * args.seq_len, dense_config.hidden_size, requires_grad=True)
        for name, mlp in variants.items():  # warm-up
            call_seconds(mlp, x, 1)
        for _ in range(args.rounds):
            for name, mlp in variants.items():
                times[name].append(call_seconds(mlp, x, args.calls))
    except (MemoryError, RuntimeError) as error:  # sizes that fit alone, not with the experts' activations
        line = allocation_failure_line(error, "lower --batch_size or --seq_len")
        if line is None:
            raise
        raise SystemExit(report_error(line)) from None
    print(machine_line())
    print(f"{args.preset}: hidden {dense_config.hidden_size}, expert width {dense_config.intermediate_size}, "
          f"{x.shape[0]} tokens, {routing(args.top_k, args.experts)}, {args.threads} thread(s), {args.rounds} rounds "
          f"x {args.calls} calls")
    reference = statistics.median(times["dense"])
    for name, seconds in times.items():
        median = statistics.median(seconds)
        print(f"{name:>12}: {median * 1e3:8.2f} ms  x{median / reference:.2f}")


if __name__ == "__main__":
    run_main(main)
