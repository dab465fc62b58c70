"""Copy rows: short sequences that repeat a span, supervised only on the repeat.

A curriculum for in-context copying (docs/tools.md, "Copy rows"): trained beside the pretraining batch with enough
weight, a model with smeared keys (docs/architecture.md) learns to predict a span it has seen before within a few
hundred steps, which the default pretraining alone never teaches it. Half the rows are random tokens (nothing but
the repeat is predictable, so only copying lowers their loss), half are pretraining text with one of its own
spans written again later (copying text, which the tools' dialogues ask for). Rows are a function of a seed, so a
resumed run, or the same step split over other processes, draws the same ones.
"""

from __future__ import annotations

import torch

ROW_LENGTH = 128           # tokens per copy row
SPAN_LENGTHS = (5, 60)     # the repeated span's length, drawn per row (inclusive), at most half a row less one


def copy_rows(seed: int, rows: int, vocab: range, text: torch.Tensor | None = None,
              length: int = ROW_LENGTH) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels), each (rows, length): row r holds random token ids from `vocab` when r is even or no
    `text` is given, else the first `length` tokens of text row (r // 2) % len(text); then a span of it (its length
    drawn from SPAN_LENGTHS) is written again at a later place. `labels` is -100 except on the repeat's 2nd token
    onwards -- the tokens that copying predicts; the repeat's first token is not, nothing announces it."""
    generator = torch.Generator().manual_seed(seed)
    if length < 2 * SPAN_LENGTHS[0] + 2:
        raise ValueError(f"copy rows of {length} tokens are too short; they need at least {2 * SPAN_LENGTHS[0] + 2}")
    if text is not None and text.shape[1] < length:
        raise ValueError(f"copy rows of {length} tokens need text rows at least as long, got {text.shape[1]}")
    ids = torch.randint(vocab.start, vocab.stop, (rows, length), generator=generator)
    labels = torch.full((rows, length), -100, dtype=torch.long)
    shortest, longest = SPAN_LENGTHS[0], min(SPAN_LENGTHS[1], length // 2 - 1)
    for row in range(rows):
        if text is not None and row % 2:
            ids[row] = text[(row // 2) % len(text), :length]
        span = _draw(generator, shortest, longest)
        start = _draw(generator, 0, length - 2 * span)
        repeat = _draw(generator, start + span, length - span)
        ids[row, repeat:repeat + span] = ids[row, start:start + span].clone()
        labels[row, repeat + 1:repeat + span] = ids[row, repeat + 1:repeat + span]
    return ids, labels


def _draw(generator: torch.Generator, low: int, high: int) -> int:
    """A uniform integer in [low, high]."""
    return int(torch.randint(low, high + 1, (), generator=generator))
