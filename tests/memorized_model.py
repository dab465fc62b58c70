"""A tiny SFT model directory trained, full-batch, until it reproduces a few fixed replies: the tool tests use it
to get a model that makes a given tool call and answers a given way after a tool's response."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tests.conftest import _save_tiny, _tiny_model

Row = tuple[list[int], list[int]]  # token ids and labels (-100 where nothing is learned)


def supervised_row(tokenizer, messages: Sequence[dict], **kwargs) -> Row:
    """A conversation's ids with its assistant tokens as labels (dataset.chat_format's SFT masking)."""
    from dataset.chat_format import encode_chatml

    encoding = encode_chatml(tokenizer, messages, **kwargs)
    return encoding.input_ids, [i if a else -100 for i, a in zip(encoding.input_ids, encoding.assistant)]


MARGIN = 1.0  # logits: the memorized token's lead over the next best


CHECK_EVERY = 10  # steps between checks of the margin: a check costs about a third of a step
# The full batch runs as this many groups of rows of like length, each padded to its own longest: the loss (a mean over
# every supervised token) is the full batch's; the tool model's 32 rows of 31-380 tokens were 43% padding in one
# batch, and a step took 0.36 CPU-s in 3 groups against 0.50 in one (1 thread, 2-core Xeon).
LENGTH_GROUPS = 3


def _length_groups(rows: Sequence[Row]) -> list[list[Row]]:
    """`rows` by length, cut into at most LENGTH_GROUPS groups of like size."""
    ordered = sorted(rows, key=lambda row: len(row[0]))
    count = min(LENGTH_GROUPS, len(ordered))
    return [ordered[i * len(ordered) // count:(i + 1) * len(ordered) // count] for i in range(count)]


def _padded(pad: int, rows: Sequence[Row]):
    """The group's input ids, attention mask, next-token targets and where a target is supervised, padded to its
    longest row."""
    import torch

    from model.model import shift_labels

    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in rows])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in rows])
    mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in rows])
    targets = shift_labels(labels)
    return input_ids, mask, targets, targets != -100


def memorized_model(tokenizer, rows: Sequence[Row], path: Path, max_steps: int = 600, positions: int = 256,
                    check_every: int = CHECK_EVERY, beta2: float = 0.95) -> Path:
    """Train a tiny model (`positions` long) on `rows`, full-batch, with AdamW (betas 0.9 and `beta2`) until every
    reply is memorized (by MARGIN, checked every `check_every` steps; at most `max_steps` steps), and save it at
    `path` as an SFT run directory."""
    import torch
    import torch.nn.functional as F

    groups = [_padded(tokenizer.pad_token_id, group) for group in _length_groups(rows)]
    model = _tiny_model(tokenizer, seed=0, max_position_embeddings=positions)
    # beta2 0.95 by default, not AdamW's 0.999: with 0.999 these full-batch runs spiked (the margin fell from about
    # 0 to -9 between two checks) and took 150 to 300 steps; with 0.95 the same rows are memorized in 70 to 120
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, beta2))
    targets = torch.cat([group_targets[supervised] for _, _, group_targets, supervised in groups])

    def supervised_logits() -> torch.Tensor:
        """The logits of the positions that predict a supervised token only, group after group (in `targets`'
        order): the loss and the check need no others, and the vocabulary-wide softmax at every other position was
        most of a step's time."""
        return torch.cat([model.lm_head(model.model(input_ids, mask)[0][supervised])
                          for input_ids, mask, _, supervised in groups])

    def memorized() -> bool:
        """Every supervised token is the argmax after its prefix by MARGIN: greedy decoding then replays each reply
        in any engine (a served model's batched, cached forward rounds otherwise than this one's, and a token won by
        a hair was once lost there)."""
        model.eval()
        with torch.no_grad():
            logits = supervised_logits().float()
        model.train()
        wanted = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        rival = logits.scatter(-1, targets.unsqueeze(-1), float("-inf")).amax(-1)
        return bool((wanted - rival >= MARGIN).all())

    # One thread, whatever the test process's count: tiny tensors gain nothing from intra-op threads, and beside
    # another busy pytest worker on a 2-core machine two threads made each step about 4x slower (tests/conftest.py's
    # one_thread fixture says why). The step at which every reply is memorized depends on the last bits (the
    # thread count, the machine), so the margin is checked every `check_every` steps, not after a fixed count.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for step in range(1, max_steps + 1):
            F.cross_entropy(supervised_logits().float(), targets).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step % check_every == 0 and memorized():
                return _save_tiny(model.eval(), tokenizer, path, "sft")
    finally:
        torch.set_num_threads(threads)
    raise AssertionError(f"the tiny model did not memorise its {len(rows)} rows in {max_steps} steps")
