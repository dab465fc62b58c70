"""Language-model evaluation shared by the trainer's validation and eval/evaluate.py: token-weighted mean loss,
perplexity and bits per byte over a dataloader. The loss is the training loss itself (model.model.causal_lm_loss).
Also the unigram baseline: the same numbers for a model that knows only the training split's token frequencies."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import ClassVar

import torch
from accelerate import Accelerator
from transformers import PreTrainedTokenizerBase

from dataset import tokenization
from model.model import causal_lm_loss, shift_labels
from trainer.run_dir import VAL_METRICS


class LoggedEval:
    """What every validation result (trainer/objectives.py's EvalResult) shares: its fields for run_summary.json and
    the metrics it logs, named by `metrics` (logged name -> field: trainer/run_dir.py's table of its task). A plain
    base, not a dataclass, so frozen and unfrozen dataclasses alike build on it."""

    metrics: ClassVar[dict[str, str]]

    def as_dict(self) -> dict[str, float]:
        """The fields for run_summary.json's final_val; one this run does not compute (None: DPO's nll_loss without
        --rpo_alpha or sft) is left out, as it is from the logged metrics."""
        return {key: value for key, value in asdict(self).items() if value is not None}

    def logged(self) -> dict[str, float]:
        """The metrics as the trainer logs them (metrics.jsonl, wandb): val_loss and the task's others."""
        return {name: getattr(self, key) for name, key in self.metrics.items() if getattr(self, key) is not None}


@dataclass(frozen=True)
class LMEval(LoggedEval):
    metrics = VAL_METRICS  # val_loss, val_ppl, val_bpb

    loss: float          # mean next-token cross-entropy over supervised tokens, in nats
    perplexity: float
    bits_per_byte: float  # total bits / UTF-8 bytes of the predicted tokens (special tokens count 0 bytes)
    tokens: int
    bytes: int

    def describe(self) -> str:
        return f"val loss {self.loss:.4f} (ppl {self.perplexity:.2f}, {self.bits_per_byte:.3f} bits/byte)"


def token_byte_lengths(tokenizer: PreTrainedTokenizerBase) -> torch.Tensor:
    """UTF-8 byte length of every token id of a byte-level BPE tokenizer; special tokens count 0."""
    special = set(tokenizer.all_special_ids)
    ids = [index for index in range(len(tokenizer)) if index not in special]
    lengths = torch.zeros(len(tokenizer), dtype=torch.long)
    lengths[ids] = torch.tensor([len(piece) for piece in tokenization.token_bytes(tokenizer, ids)], dtype=torch.long)
    return lengths


@torch.no_grad()
def evaluate_lm(model: torch.nn.Module, dataloader: Iterable[dict[str, torch.Tensor]], accelerator: Accelerator,
                token_bytes: torch.Tensor | None = None, max_batches: int = 0) -> LMEval:
    """Token-weighted loss over `dataloader` (summed across processes). max_batches=0 means all batches."""
    was_training = model.training
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=accelerator.device)  # nats, tokens, bytes
    for index, batch in enumerate(dataloader):
        if max_batches and index >= max_batches:
            break
        batch = {key: value.to(accelerator.device) for key, value in batch.items()}
        logits = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask")).logits
        nats = causal_lm_loss(logits, batch["labels"], num_items_in_batch=1)  # the token sum
        targets = shift_labels(batch["labels"])
        supervised = targets != -100
        totals[0] += nats.double()
        totals[1] += supervised.sum()
        if token_bytes is not None:
            lengths = token_bytes.to(targets.device)[targets.clamp(min=0)]
            totals[2] += (lengths * supervised).sum()
    totals = accelerator.reduce(totals, reduction="sum")
    model.train(was_training)
    nats, tokens, num_bytes = totals.tolist()
    loss = nats / tokens if tokens else float("nan")
    return LMEval(loss=loss, perplexity=math.exp(min(loss, 700.0)),
                  bits_per_byte=nats / math.log(2) / num_bytes if num_bytes else float("nan"),
                  tokens=int(tokens), bytes=int(num_bytes))


def _targets(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The supervised next-token targets of a batch, flat: what causal_lm_loss scores."""
    targets = shift_labels(batch["labels"]).reshape(-1)
    return targets[targets != -100]


def unigram_eval(train_batches: Iterable[dict[str, torch.Tensor]], val_batches: Iterable[dict[str, torch.Tensor]],
                 vocab_size: int, token_bytes: torch.Tensor | None = None) -> LMEval:
    """The unigram baseline: the loss of a model that predicts every token from the training split's token
    frequencies alone, ignoring the context (add-one smoothed: p(t) = (count(t) + 1) / (N + V) over the training
    targets). Scored like evaluate_lm, token-weighted over the validation targets; a language model that has not
    got below this has learned nothing but token frequencies."""
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for batch in train_batches:
        counts += torch.bincount(_targets(batch), minlength=vocab_size)[:vocab_size].double()
    log_probs = torch.log(counts + 1) - math.log(float(counts.sum()) + vocab_size)
    nats = tokens = num_bytes = 0.0
    for batch in val_batches:
        targets = _targets(batch)
        nats -= float(log_probs[targets].sum())
        tokens += targets.numel()
        if token_bytes is not None:
            num_bytes += float(token_bytes[targets].sum())
    loss = nats / tokens if tokens else float("nan")
    return LMEval(loss=loss, perplexity=math.exp(min(loss, 700.0)),
                  bits_per_byte=nats / math.log(2) / num_bytes if num_bytes else float("nan"),
                  tokens=int(tokens), bytes=int(num_bytes))
