"""Loading the tokenizer committed in ``model/`` (regenerate it with ``scripts/train_tokenizer.py``)."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

DEFAULT_TOKENIZER_DIR = Path(__file__).resolve().parents[1] / "model"


def load_tokenizer(path: str | Path | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer at ``path`` (a directory or hub id); by default MiniNorm's own from ``model/``."""
    return AutoTokenizer.from_pretrained(str(path) if path is not None else str(DEFAULT_TOKENIZER_DIR))
