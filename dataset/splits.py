"""The default corpus's train/validation rule, on its own so every data builder shares it without importing the
corpus builder: about 2 % of split keys (a Wikipedia title, a chit-chat conversation id, ...) are validation, chosen
by a hash that is the same in every process and on every machine."""

from __future__ import annotations

import hashlib

from dataset.sources import Dialog, WikiArticle

VAL_PER_MILLE = 20  # 2 % validation
WIKI_NAMESPACE = "wikipedia_en"


def wiki_split_key(article: WikiArticle) -> str:
    """The split key of a Wikipedia article: its text and every conversation made from it share it."""
    return f"{WIKI_NAMESPACE}\x00{article.title}"


def dialog_split_key(dialog: Dialog) -> str:
    """The split key of a chit-chat or chatterbot dialog: its text and every SFT window of it share it."""
    return f"{dialog.source}\x00{dialog.key}"


def is_validation(split_key: str) -> bool:
    """Deterministic, process-independent (unlike ``hash()``) train/val assignment of a split key."""
    digest = hashlib.sha256(split_key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % 1000 < VAL_PER_MILLE
