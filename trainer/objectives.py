"""What the training core minimizes, per kind of run: the loss hook of trainer/core.py.

An objective counts the units its loss averages over (supervised tokens, preference pairs), computes one
micro-batch's loss as its sum over those units divided by the whole optimizer step's count (so accumulation and
data parallelism give exactly the full-batch mean), returns per-step statistics as sums over the same units, and
validates. Language modeling (pretraining, SFT, LoRA) is here; DPO is trainer/dpo.py.
"""

from __future__ import annotations

from typing import Protocol

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

from model.model import shift_labels
from trainer.evaluation import LMEval, evaluate_lm


class EvalResult(Protocol):
    """A validation result: what run_summary.json's final_val holds, what is logged, and one line for people."""

    loss: float

    def as_dict(self) -> dict[str, float]: ...

    def logged(self) -> dict[str, float]: ...

    def describe(self) -> str: ...


class Objective(Protocol):
    stat_names: tuple[str, ...]        # per-step statistics logged beside the loss (means over the step's units)
    progress_labels: dict[str, str]    # the statistics the progress bar shows, and their short labels

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
        self.stat_names: tuple[str, ...] = ("aux_loss", "z_loss") if moe else ()
        self.progress_labels: dict[str, str] = {"aux_loss": "aux"} if moe else {}

    def count_items(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return (shift_labels(batch["labels"]) != -100).sum()

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor],
             num_items: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                    labels=batch["labels"], num_items_in_batch=num_items)
        if not self.stat_names:
            return out.loss, torch.zeros(0, device=out.loss.device)
        # The router's terms are micro-batch means: weighted by the micro-batch's labelled tokens, they average
        # over the step like the loss does.
        stats = torch.stack([out.aux_loss.detach(), out.z_loss.detach()]).float() * self.count_items(batch)
        return out.loss, stats

    def evaluate(self, model: torch.nn.Module, loader: DataLoader, accelerator: Accelerator,
                 token_bytes: torch.Tensor, max_batches: int) -> LMEval:
        return evaluate_lm(model, loader, accelerator, token_bytes, max_batches)
