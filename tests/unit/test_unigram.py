"""trainer.evaluation.unigram_eval, the unigram baseline of the study: against counts and logs written out by hand,
and against evaluate_lm scoring a model whose logits are those log-probabilities (the one loss owner)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator

from trainer.evaluation import evaluate_lm, unigram_eval

VOCAB = 7
# Rows of labels as the packed datasets give them; the target of position t is labels[t + 1], -100 is no target.
TRAIN = [{"input_ids": torch.tensor([[0, 1, 1, 2], [3, 3, 3, 5]])},
         {"input_ids": torch.tensor([[6, 3, 1, 1]])}]
VAL = [{"input_ids": torch.tensor([[2, 4, 1, 3], [0, 3, 6, 0]])}, {"input_ids": torch.tensor([[5, 1, 1, 2]])}]
for _batch in TRAIN + VAL:
    _batch["labels"] = _batch["input_ids"].clone()
TRAIN[0]["labels"][1, 3] = -100  # an unsupervised position is not counted


def test_unigram_is_add_one_smoothed_training_frequencies():
    # Training targets, by hand: [1, 1, 2] + [3, 3] (the -100 dropped) + [3, 1, 1].
    counts = {1: 4, 2: 1, 3: 3}
    total = 8
    val_targets = [4, 1, 3, 3, 6, 0, 1, 1, 2]
    token_bytes = torch.tensor([1, 2, 3, 1, 4, 0, 2])
    expected = -sum(math.log((counts.get(t, 0) + 1) / (total + VOCAB)) for t in val_targets) / len(val_targets)
    result = unigram_eval(TRAIN, VAL, VOCAB, token_bytes)
    assert result.tokens == len(val_targets)
    assert result.loss == pytest.approx(expected, rel=1e-12)
    assert result.perplexity == pytest.approx(math.exp(expected), rel=1e-12)
    num_bytes = sum(int(token_bytes[t]) for t in val_targets)
    assert result.bytes == num_bytes
    assert result.bits_per_byte == pytest.approx(expected * len(val_targets) / math.log(2) / num_bytes, rel=1e-12)


class _UnigramModel(torch.nn.Module):
    """Logits that are the same log-probabilities at every position: a model that ignores the context."""

    def __init__(self, log_probs: torch.Tensor) -> None:
        super().__init__()
        self.log_probs = log_probs

    def forward(self, input_ids, attention_mask=None):  # noqa: ARG002
        return SimpleNamespace(logits=self.log_probs.expand(*input_ids.shape, -1))


def test_unigram_equals_evaluate_lm_of_a_frequency_model():
    counts = torch.bincount(torch.tensor([1, 1, 2, 3, 3, 3, 1, 1]), minlength=VOCAB).double()
    model = _UnigramModel(torch.log((counts + 1) / (counts.sum() + VOCAB)))
    reference = evaluate_lm(model, VAL, Accelerator(cpu=True))  # fp32 logits, hence rel 1e-6
    assert unigram_eval(TRAIN, VAL, VOCAB).loss == pytest.approx(reference.loss, rel=1e-6)
    assert unigram_eval(TRAIN, VAL, VOCAB).tokens == reference.tokens
