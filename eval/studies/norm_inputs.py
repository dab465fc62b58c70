"""What each norm of a trained model sees: per norm module, the RMS of its input on validation text and, for DyT,
its alpha and the fraction of units where tanh saturates (|alpha * x| > 3, where tanh' < 0.01 and almost no
gradient passes).

A norm divides by its input's scale, so a growing residual stream changes nothing it outputs; DyT's tanh does not,
so the same growth saturates it unless alpha shrinks in step. This is the check behind the second study's DyT
finding (docs/study.md): run it on a trial's model directory. (The trainer's diagnostics log each norm's input RMS
during training; this reads a finished model and adds DyT's alpha and saturation. It runs on the CPU, where every
norm computes through its forward, so a forward hook sees every call.)

    python eval/studies/norm_inputs.py out/sweeps/study2_lr/trials/<trial> [more model dirs] [--out PATH]
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script, from any directory
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trainer.cli import quiet_ctrl_c_while_loading  # noqa: E402

quiet_ctrl_c_while_loading(__name__)  # a Ctrl-C while the imports below load: one line, exit 130

import math  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import TYPE_CHECKING  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

from dataset.atomic_io import atomic_write_text  # noqa: E402
from model.config import MAX_SIZE  # noqa: E402
from model.norms import DyT, LayerNorm, RMSNorm  # noqa: E402
from trainer.cli import MAX_COUNT, ToolParser, benchmark_threads, int_within, output_file, run_main  # noqa: E402
from trainer.machine import machine_line  # noqa: E402
from trainer.run_dir import check_report_file, locate_model, recorded_config, report_error  # noqa: E402

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

SATURATED_AT = 3.0  # |alpha * x| beyond which tanh' = 1 - tanh^2 < 0.01
NORM_MODULES = (RMSNorm, LayerNorm, DyT)  # the no-norm ablation's identities have nothing to report


@dataclass
class NormInput:
    name: str                    # the module's name in the model, e.g. model.layers.3.attn_norm
    input_rms: float             # root mean square of its input over every token and channel
    alpha: float | None          # DyT's alpha; None for a norm
    saturated: float | None      # DyT: fraction of input units with |alpha * x| > SATURATED_AT; None for a norm


def norm_inputs(model: nn.Module, batches: Sequence[torch.Tensor]) -> list[NormInput]:
    """Every norm module's input statistics over ``batches`` (token ids, each (B, T)), in forward order."""
    sums: dict[str, list[float]] = {}  # name -> [sum of squares, saturated units, units]
    modules: dict[str, nn.Module] = {}

    def hook(name: str):
        def record(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
            x = inputs[0].detach().double()
            totals = sums.setdefault(name, [0.0, 0.0, 0.0])
            totals[0] += x.square().sum().item()
            totals[2] += x.numel()
            if isinstance(module, DyT):
                totals[1] += ((module.alpha.detach().double() * x).abs() > SATURATED_AT).sum().item()
        return record

    handles = []
    for name, module in model.named_modules():
        if isinstance(module, NORM_MODULES):
            modules[name] = module
            handles.append(module.register_forward_hook(hook(name)))
    try:
        with torch.no_grad():
            for batch in batches:
                model(batch)
    finally:
        for handle in handles:
            handle.remove()
    return [NormInput(name, math.sqrt(total[0] / total[2]),
                      modules[name].alpha.item() if isinstance(modules[name], DyT) else None,
                      total[1] / total[2] if isinstance(modules[name], DyT) else None)
            for name, total in sums.items()]


def validation_batches(tokenizer: PreTrainedTokenizerBase, seq_len: int, num_batches: int,
                       batch_size: int) -> list[torch.Tensor]:
    """The first packed rows of the default corpus's validation split (the text every trial is scored on)."""
    from dataset.corpus import ensure_default_corpus
    from dataset.pretrain_dataset import PretrainDataset

    rows = PretrainDataset(ensure_default_corpus(quiet=True).pretrain_val, tokenizer, seq_len)
    count = min(len(rows), num_batches * batch_size)
    ids = torch.stack([rows[i]["input_ids"] for i in range(count)])
    return list(ids.split(batch_size))


def table(results: dict[str, list[NormInput]]) -> str:
    """One row per norm module, three columns per model: input RMS, alpha and saturated fraction (DyT only)."""
    names = list(next(iter(results.values()))) if results else []
    header = "| norm |" + "".join(f" {label}: input RMS | alpha | saturated |" for label in results)
    lines = [header, "|---|" + "---|---|---|" * len(results)]
    for index, row in enumerate(names):
        cells = []
        for entries in results.values():
            entry = entries[index] if index < len(entries) else None
            if entry is None:
                cells += ["", "", ""]
                continue
            cells += [f"{entry.input_rms:.3g}", "–" if entry.alpha is None else f"{entry.alpha:.3f}",
                      "–" if entry.saturated is None else f"{entry.saturated:.1%}"]
        lines.append(f"| {row.name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = ToolParser(description="Per norm module of trained models: input RMS on validation text; DyT's alpha "
                                    "and saturated fraction.")
    parser.add_argument("models", nargs="+", help="model directories (a trial's folder, out/pretrain, ...)")
    parser.add_argument("--labels", help="comma-separated column labels, one per model (default: folder names)")
    parser.add_argument("--seq_len", type=int_within(2, MAX_SIZE),
                        help="tokens per row (default: the model's training max_seq_len from its train_config.yaml, "
                             "else 128)")
    parser.add_argument("--batches", type=int_within(1, MAX_COUNT), default=4, help="validation batches")
    parser.add_argument("--batch_size", type=int_within(1, MAX_SIZE), default=8, help="rows per batch")
    parser.add_argument("--threads", type=benchmark_threads(), default=1, help="torch CPU threads")
    parser.add_argument("--out", type=output_file, help="also write the table (markdown) to this file")
    args = parser.parse_args(argv)
    labels = args.labels.split(",") if args.labels else [Path(m).name for m in args.models]
    if len(labels) != len(args.models):
        parser.error(f"--labels has {len(labels)} labels for {len(args.models)} models")
    torch.set_num_threads(args.threads)
    from model.loading import load_model

    results: dict[str, list[NormInput]] = {}
    try:
        # A folder without a model (a trial brought back from records): one line, before any loads.
        paths = [locate_model(path)[0] for path in args.models]
        for path in paths if args.out else ():  # a table written over a model's file would destroy it
            check_report_file(Path(args.out), "--out", path, model_flag="the model folder")
        for label, path in zip(labels, paths):
            model, tokenizer = load_model(path, device="cpu", dtype="float32")
            model.eval()
            seq_len = args.seq_len or training_seq_len(path)
            results[label] = norm_inputs(model, validation_batches(tokenizer, seq_len, args.batches,
                                                                   args.batch_size))
    except (OSError, ValueError) as error:
        return report_error(error)
    text = (f"Norm inputs on the validation split ({args.batches} x {args.batch_size} packed rows; saturated: "
            f"|alpha x| > {SATURATED_AT:g}); {machine_line()}\n\n{table(results)}\n")
    print(text)
    if args.out:
        atomic_write_text(args.out, text)
    return 0


def training_seq_len(model_dir: Path) -> int:
    """The max_seq_len the model was trained with (as its run recorded it), else 128."""
    value = recorded_config(model_dir).get("max_seq_len")
    return value if isinstance(value, int) and value > 1 else 128


if __name__ == "__main__":
    run_main(main)
