"""What the training core minimizes, per kind of run: the loss hook of trainer/core.py's train_step (each update's
forward and backward are trainer/update.py's).

An objective counts the units its loss averages over (supervised tokens, preference pairs), computes one
micro-batch's loss as its sum over those units divided by the whole optimizer step's count (so accumulation and
data parallelism give exactly the full-batch mean), returns per-step statistics as sums over the same units, and
validates. Language modeling (pretraining, SFT, LoRA) is here; DPO is trainer/dpo.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

from dataset.copy_rows import ROW_LENGTH, check_cue_pairs, copy_rows
from model.model import shift_labels
from dataset.shown_value import flag_refusal
from trainer.evaluation import LMEval, evaluate_lm
from trainer.step import StatWindow


class EvalResult(Protocol):
    """A validation result: what run_summary.json's final_val holds, what is logged, and one line for people
    (trainer/evaluation.py's LoggedEval gives the first two, from the result's fields and its task's metric table)."""

    loss: float

    def as_dict(self) -> dict[str, float]: ...

    def logged(self) -> dict[str, float]: ...

    def describe(self) -> str: ...


class Objective(Protocol):
    stat_names: tuple[str, ...]        # per-step statistics logged beside the loss (means over the step's units)
    progress_labels: dict[str, str]    # the statistics the progress bar shows, and their short labels
    # how the log window takes each statistic over its steps (a minimum's the least, ...); one left out: the mean
    stat_windows: dict[str, StatWindow]

    def count_items(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The number of units the loss averages over in one micro-batch (a 0-d tensor)."""
        ...

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor],
             num_items: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the micro-batch's loss summed over its units / num_items, the statistics' sums over its units)."""
        ...

    def evaluate(self, model: torch.nn.Module, loader: DataLoader, accelerator: Accelerator,
                 token_bytes: torch.Tensor, max_batches: int) -> EvalResult:
        """Collective: every process evaluates its shard of the validation set."""
        ...


class LanguageModeling:
    """Next-token cross-entropy on the labelled tokens (model.model.causal_lm_loss): pretraining, SFT, LoRA. For a
    mixture-of-experts model (`moe`) the loss includes the router's terms, and the load-balancing loss and the
    z-loss are logged on their own (`aux_loss`, `z_loss`: their means over the step's labelled tokens)."""

    def __init__(self, moe: bool = False) -> None:
        self.moe = moe
        self.stat_names: tuple[str, ...] = ("aux_loss", "z_loss") if moe else ()
        self.progress_labels: dict[str, str] = {"aux_loss": "aux"} if moe else {}
        self.stat_windows: dict[str, StatWindow] = {}  # every one a mean over the window

    def count_items(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return (shift_labels(batch["labels"]) != -100).sum()

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor],
             num_items: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                    labels=batch["labels"], num_items_in_batch=num_items)
        if not self.moe:
            return out.loss, torch.zeros(0, device=out.loss.device)
        # The router's terms are micro-batch means: weighted by the micro-batch's labelled tokens, they average
        # over the step like the loss does.
        stats = torch.stack([out.aux_loss.detach(), out.z_loss.detach()]).float() * self.count_items(batch)
        return out.loss, stats

    def evaluate(self, model: torch.nn.Module, loader: DataLoader, accelerator: Accelerator,
                 token_bytes: torch.Tensor, max_batches: int) -> LMEval:
        return evaluate_lm(model, loader, accelerator, token_bytes, max_batches)


@dataclass(frozen=True)
class CopySettings:
    """The copy rows beside each micro-batch (--copy_rows, --copy_weight, --copy_steps, --copy_weight_after,
    --copy_cue_pairs)."""

    rows: int
    weight: float
    steps: int
    weight_after: float
    cue_pairs: int = 0

    def weight_at(self, step: int) -> float:
        """The copy loss's weight at optimizer step `step` (0-based)."""
        return self.weight if step < self.steps else self.weight_after


class LanguageModelingWithCopies(LanguageModeling):
    """Language modeling plus, on every training micro-batch, the mean loss of copy rows (dataset/copy_rows.py: half
    random tokens, half the micro-batch's own text, a span repeated, the loss on the repeat) times the step's
    weight, divided by the step's micro-batches over all processes: the step's gradient is the language-modeling
    token mean plus weight x the mean of its micro-batches' copy losses, however the step is split. The rows of
    micro-batch m on process p are drawn from (seed, step, m x processes + p), the global index of its data, so a
    resumed run and the same global batch on other processes draw the same rows. `copy_loss` is logged (the copy
    rows' mean loss: the mean of the step's micro-batches' copy losses, each weighing the same, as in the loss), and
    `lm_loss`, the language-modeling loss alone (what a run without copy rows logs as its loss; what validation
    measures, less a mixture-of-experts model's router terms); the logged `loss` is the minimized sum: lm_loss plus
    weight x copy_loss, however the step's micro-batches differ. The progress bar shows all three."""

    def __init__(self, settings: CopySettings, vocab: range, seed: int, process_index: int, processes: int,
                 accumulation_steps: int, moe: bool = False) -> None:
        super().__init__(moe)
        try:  # refused before the first step, not at it
            check_cue_pairs(settings.cue_pairs, vocab)
        except ValueError as error:
            raise ValueError(flag_refusal("copy_cue_pairs", settings.cue_pairs, str(error))) from None
        self.settings, self.vocab, self.seed = settings, vocab, seed
        self.process_index, self.processes, self.accumulation_steps = process_index, processes, accumulation_steps
        self.stat_names = self.stat_names + ("lm_loss", "copy_loss")
        # "loss" beside a val loss half its size read as a diverging language model: the bar names the parts
        self.progress_labels = {**self.progress_labels, "lm_loss": "lm", "copy_loss": "copy"}
        self.step, self.micro_batch = 0, 0

    def start_step(self, step: int) -> None:
        """Called by the training core before each optimizer step's micro-batches (`step`: the steps done)."""
        self.step, self.micro_batch = step, 0

    def row_seed(self, step: int, micro_batch: int, process_index: int) -> int:
        """The seed of a micro-batch's copy rows: one per (run seed, step, global micro-batch index)."""
        global_index = micro_batch * self.processes + process_index
        return (self.seed * 1_000_003 + step) * 10_007 + global_index

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor],
             num_items: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        loss, stats = super().loss(model, batch, num_items)
        # the micro-batch's token sum of the language-modeling loss: over the step's tokens, its token mean
        stats = torch.cat([stats, (loss.detach().float() * num_items)[None]])
        weight = self.settings.weight_at(self.step)
        if not model.training or weight == 0:
            return loss, torch.cat([stats, torch.zeros(1, device=loss.device)])
        seed = self.row_seed(self.step, self.micro_batch, self.process_index)
        self.micro_batch += 1
        text = batch["input_ids"].cpu()
        ids, labels = copy_rows(seed, self.settings.rows, self.vocab, text, min(ROW_LENGTH, text.shape[1]),
                                self.settings.cue_pairs)
        device = batch["input_ids"].device
        copy = model(input_ids=ids.to(device), labels=labels.to(device)).loss
        share = 1 / (self.accumulation_steps * self.processes)
        # logged over the step's units (num_items): the micro-batches' copy losses weighted as the loss weighs them
        copy_stat = copy.detach().float() * share * num_items
        return loss + weight * share * copy, torch.cat([stats, copy_stat[None]])
