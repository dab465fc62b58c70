"""Copy rows: short sequences that repeat a span, supervised only on the repeat.

A curriculum for in-context copying (docs/tools.md, "Copy rows"): trained beside the pretraining batch with enough
weight, a model with smeared keys (docs/architecture.md) learns to predict a span it has seen before within a few
hundred steps, which the default pretraining alone never teaches it. Half the rows are random tokens (nothing but
the repeat is predictable, so only copying lowers their loss), half are pretraining text with one of its own
spans written again later (copying text, which the tools' dialogues ask for). Rows are a function of a seed, so a
resumed run, or the same step split over other processes, draws the same ones.

With cue pairs, the copy's first token is taught too: the span follows a cue token and its repeat that cue's
partner, one of a fixed table of (cue, partner) pairs, and the repeat's first token is in the loss. As in a tool
call's argument (`"value": 80` for "Convert 80 liters"), the token before the copy differs from the token before the
original, and only a learned relation between the two says where the copy starts (docs/tools.md, "Cue pairs").
"""

from __future__ import annotations

import torch

ROW_LENGTH = 128           # tokens per copy row
SPAN_LENGTHS = (5, 60)     # the repeated span's length, drawn per row (inclusive), at most half a row less one
SHORTEST_ROW = 2 * SPAN_LENGTHS[0] + 2  # the shortest span twice, with room to place it: a row's least tokens
CUE_TABLE_SEED = 0         # the cue pairs are one table for every run and row, so they can be learned


def copy_rows(seed: int, rows: int, vocab: range, text: torch.Tensor | None = None,
              length: int = ROW_LENGTH, cue_pairs: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels), each (rows, length): row r holds random token ids from `vocab` when r is even or no
    `text` is given, else the first `length` tokens of text row (r // 2) % len(text); then a span of it (its length
    drawn from SPAN_LENGTHS) is written again at a later place. `labels` is -100 except on the repeat's 2nd token
    onwards -- the tokens that copying predicts; the repeat's first token is not, nothing announces it.
    With `cue_pairs` > 0, a pair drawn per row from the first `cue_pairs` of `cue_table(vocab)` puts its cue just
    before the span and its partner just before the repeat, and the repeat's first token is in `labels` too."""
    generator = torch.Generator().manual_seed(seed)
    check_cue_pairs(cue_pairs, vocab)
    table = cue_table(vocab)[:cue_pairs] if cue_pairs else None
    if length < SHORTEST_ROW:
        raise ValueError(f"copy rows of {length} tokens are too short; they need at least {SHORTEST_ROW}")
    if text is not None and text.shape[1] < length:
        raise ValueError(f"copy rows of {length} tokens need text rows at least as long, got {text.shape[1]}")
    ids = torch.randint(vocab.start, vocab.stop, (rows, length), generator=generator)
    labels = torch.full((rows, length), -100, dtype=torch.long)
    shortest, longest = SPAN_LENGTHS[0], min(SPAN_LENGTHS[1], length // 2 - 1)
    for row in range(rows):
        if text is not None and row % 2:
            ids[row] = text[(row // 2) % len(text), :length]
        span = _draw(generator, shortest, longest)
        if table is None:
            start = _draw(generator, 0, length - 2 * span)
            repeat = _draw(generator, start + span, length - span)
        else:  # room for the cue before the span and for its partner between the span and the repeat
            start = _draw(generator, 1, length - 2 * span - 1)
            repeat = _draw(generator, start + span + 1, length - span)
            ids[row, start - 1], ids[row, repeat - 1] = table[_draw(generator, 0, len(table) - 1)]
        ids[row, repeat:repeat + span] = ids[row, start:start + span].clone()
        first_supervised = repeat if table is not None else repeat + 1
        labels[row, first_supervised:repeat + span] = ids[row, first_supervised:repeat + span]
    return ids, labels


def check_cue_pairs(cue_pairs: int, vocab: range) -> None:
    """Refuse more cue pairs than `vocab` makes (or fewer than none)."""
    if not 0 <= cue_pairs <= len(vocab) // 2:
        raise ValueError(f"{cue_pairs} cue pairs are too many or too few; the vocabulary's {len(vocab)} ordinary "
                         f"tokens make 0 to {len(vocab) // 2} pairs")


def cue_table(vocab: range) -> torch.Tensor:
    """The (cue, partner) token pairs of copy rows with cue pairs, (len(vocab) // 2, 2): `vocab` shuffled by
    CUE_TABLE_SEED and paired off, so no token is in two pairs; a run's first N pairs stay the same for any N."""
    order = torch.randperm(len(vocab), generator=torch.Generator().manual_seed(CUE_TABLE_SEED)) + vocab.start
    return order[:len(order) // 2 * 2].view(-1, 2)


def _draw(generator: torch.Generator, low: int, high: int) -> int:
    """A uniform integer in [low, high]."""
    return int(torch.randint(low, high + 1, (), generator=generator))
