"""The norm laboratory's speed table (issue 27): every norm type, with and without its affine parameters, side by
side in one interleaved run on the CPU.

Two measurements per variant, both interleaved round by round across the variants (so a change of the machine's
load hits every variant alike), each the median over rounds of a round's median:
  - norm: forward + backward (the input's gradient and the parameters') of one norm module as the model builds it
    (`build_norm`, so `norm_impl` as configured: auto is the compiled RMSNorm on CPU), on the default training
    run's activation shape, batch x max_seq_len x hidden_size;
  - step: a full training step of the default pretraining model with that norm (forward, loss, backward,
    clipping, the default optimizer, under the default precision), on random tokens of the default batch shape.
The defaults are the pretraining trainer's own (trainer/arg_fields.py: TASK_DEFAULTS["pretrain"] over TrainArgs), so
the table follows them when they change.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from model.config import MiniNormConfig
from model.model import MiniNormForCausalLM
from model.norms import build_norm
from dataset.shown_value import shown_value
from trainer.arg_fields import TASK_DEFAULTS, TrainArgs, build_model_config
from trainer.run_optimizer import make_optimizer
from trainer.machine import resolve_dtype

# name -> MiniNormConfig overrides. The names are what --lab_norms takes.
LAB_VARIANTS: dict[str, dict[str, object]] = {
    "rmsnorm": dict(norm_type="rmsnorm"),
    "layernorm": dict(norm_type="layernorm"),
    "dyt": dict(norm_type="dyt"),
    "rmsnorm-free": dict(norm_type="rmsnorm", norm_affine=False),
    "layernorm-free": dict(norm_type="layernorm", norm_affine=False),
    "dyt-free": dict(norm_type="dyt", norm_affine=False),
    "prmsnorm": dict(norm_type="prmsnorm"),
}
DEFAULT_LAB_NORMS = ("rmsnorm", "layernorm", "dyt", "rmsnorm-free", "layernorm-free", "dyt-free")


def default_run() -> TrainArgs:
    """The settings of `python trainer/train_pretrain.py` with no flags, --dtype resolved as the trainer does."""
    run = TrainArgs(task="pretrain", **TASK_DEFAULTS["pretrain"])
    run.dtype = resolve_dtype(run.dtype)
    return run


@dataclass
class LabVariant:
    name: str
    norm: torch.nn.Module
    model: MiniNormForCausalLM
    optimizer: torch.optim.Optimizer
    norm_ms: list[float] = field(default_factory=list)  # per round: the median forward+backward of the norm
    step_ms: list[float] = field(default_factory=list)  # per round: the median training step


def build_variant(name: str, run: TrainArgs, vocab_size: int) -> LabVariant:
    if name not in LAB_VARIANTS:
        raise ValueError(f"--lab_norms: {shown_value(name)} is not allowed; choose from {', '.join(LAB_VARIANTS)}")
    run = dataclasses.replace(run, model={**run.model, **LAB_VARIANTS[name]})
    config: MiniNormConfig = build_model_config(run, vocab_size=vocab_size)
    torch.manual_seed(run.seed)
    model = MiniNormForCausalLM(config).train()
    # The trainer's own optimizer: an fp32 run on a CPU also orthogonalizes Muon's updates in fp32.
    optimizer = make_optimizer(model, run, torch.device("cpu"))
    return LabVariant(name, build_norm(config, config.hidden_size).train(), model, optimizer)


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return 1e3 * statistics.median(times)


def _norm_fwd_bwd(norm: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor) -> Callable[[], object]:
    inputs = [x, *norm.parameters()]

    def run() -> object:
        return torch.autograd.grad(norm(x), inputs, dy)
    return run


def _train_step(variant: LabVariant, batches: Iterator[torch.Tensor], dtype: torch.dtype) -> Callable[[], None]:
    def run() -> None:
        ids = next(batches)
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            loss = variant.model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(variant.model.parameters(), 1.0)
        variant.optimizer.step()
        variant.optimizer.zero_grad(set_to_none=True)
    return run


def run_lab(names: list[str], rounds: int, norm_repeats: int, steps: int, warmup: int, norm_dtype: torch.dtype,
            vocab_size: int = MiniNormConfig.vocab_size,
            log: Callable[[str], None] = print) -> tuple[list[LabVariant], dict]:
    """Build every variant, warm each up (compiles), then `rounds` interleaved rounds. Returns the variants with
    their per-round medians and the shapes and precisions used."""
    run = default_run()
    variants = [build_variant(name, run, vocab_size) for name in names]
    hidden = variants[0].model.config.hidden_size
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(run.batch_size, run.max_seq_len, hidden, generator=generator).to(norm_dtype).requires_grad_()
    dy = torch.randn(x.shape, generator=generator).to(norm_dtype)
    step_dtype = getattr(torch, run.dtype)

    def token_batches() -> Iterator[torch.Tensor]:
        tokens = torch.Generator().manual_seed(1)
        while True:
            yield torch.randint(0, vocab_size, (run.batch_size, run.max_seq_len), generator=tokens)

    batches = token_batches()
    norm_calls = {v.name: _norm_fwd_bwd(v.norm, x, dy) for v in variants}
    step_calls = {v.name: _train_step(v, batches, step_dtype) for v in variants}
    for variant in variants:
        for _ in range(warmup):
            norm_calls[variant.name]()
            step_calls[variant.name]()
    for round_index in range(rounds):
        for variant in variants:
            variant.norm_ms.append(_median_ms(norm_calls[variant.name], norm_repeats))
            variant.step_ms.append(_median_ms(step_calls[variant.name], steps))
        log(f"round {round_index + 1}/{rounds}: " + ", ".join(
            f"{v.name} {v.norm_ms[-1]:.3f} / {v.step_ms[-1]:.0f} ms" for v in variants))
    setup = {"preset": run.preset, "hidden_size": hidden, "batch_size": run.batch_size, "seq_len": run.max_seq_len,
             "optimizer": run.optimizer, "step_dtype": str(step_dtype).removeprefix("torch."),
             "norm_dtype": str(norm_dtype).removeprefix("torch."),
             "norm_impl": variants[0].model.config.norm_impl}
    return variants, setup


def lab_table(variants: list[LabVariant]) -> str:
    """Markdown: per variant, the medians over rounds and their ratio to the first variant's."""
    norm_ref = statistics.median(variants[0].norm_ms)
    step_ref = statistics.median(variants[0].step_ms)
    reference = variants[0].name
    lines = [f"| norm | fwd+bwd of one norm (ms) | vs {reference} | training step (ms) | vs {reference} |",
             "|---|---:|---:|---:|---:|"]
    for v in variants:
        norm, step = statistics.median(v.norm_ms), statistics.median(v.step_ms)
        lines.append(f"| {v.name} | {norm:.3f} | {norm / norm_ref:.2f} | {step:.1f} | {step / step_ref:.3f} |")
    return "\n".join(lines)
