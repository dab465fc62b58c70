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


def memorized_model(tokenizer, rows: Sequence[Row], path: Path, steps: int = 120, positions: int = 256) -> Path:
    """Train a tiny model (`positions` long) on `rows`, full-batch, for `steps` AdamW steps, and save it at `path`
    as an SFT run directory."""
    import torch
    import torch.nn.functional as F

    from model.model import shift_labels

    width = max(len(ids) for ids, _ in rows)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in rows])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in rows])
    mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in rows])
    model = _tiny_model(tokenizer, seed=0, max_position_embeddings=positions)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    targets = shift_labels(labels)
    supervised = targets != -100

    def supervised_logits() -> torch.Tensor:
        """The logits of the positions that predict a supervised token only: the loss and the check need no
        others, and the vocabulary-wide softmax at every other position was most of a step's time."""
        hidden = model.model(input_ids, mask)[0]
        return model.lm_head(hidden[supervised])

    def memorized() -> bool:
        """Every supervised token is the argmax after its prefix by MARGIN: greedy decoding then replays each reply
        in any engine (a served model's batched, cached forward rounds otherwise than this one's, and a token won by
        a hair was once lost there)."""
        model.eval()
        with torch.no_grad():
            logits = supervised_logits().float()
        model.train()
        wanted = logits.gather(-1, targets[supervised].unsqueeze(-1)).squeeze(-1)
        rival = logits.scatter(-1, targets[supervised].unsqueeze(-1), float("-inf")).amax(-1)
        return bool((wanted - rival >= MARGIN).all())

    # Full-batch steps until every reply is memorized: `steps`, then more in rounds of `steps` if the last bits
    # (which depend on the thread count and the machine) left a token wrong -- a clear error after four rounds.
    for _ in range(4):
        for _ in range(steps):
            F.cross_entropy(supervised_logits().float(), targets[supervised]).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if memorized():
            return _save_tiny(model.eval(), tokenizer, path, "sft")
    raise AssertionError(f"the tiny model did not memorise its {len(rows)} rows in {4 * steps} steps")
