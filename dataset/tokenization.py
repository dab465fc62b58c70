"""Loading the tokenizer committed in ``model/`` (regenerate it with ``scripts/train_tokenizer.py``), making sure
a model is trained further with the tokenizer it was trained with, and where each token of a text starts."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerBase
from transformers.convert_slow_tokenizer import bytes_to_unicode

DEFAULT_TOKENIZER_DIR = Path(__file__).resolve().parents[1] / "model"
_BYTE_OF_CHAR = {char: byte for byte, char in bytes_to_unicode().items()}  # byte-level BPE's alphabet, read back
_WORD_MARK = "\u2581"  # SentencePiece's "▁": a space before the word
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a byte no piece holds, as its own token


def load_tokenizer(path: str | Path | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer at ``path`` (a directory or hub id); by default MiniNorm's own from ``model/``."""
    return AutoTokenizer.from_pretrained(str(path) if path is not None else str(DEFAULT_TOKENIZER_DIR))


def token_map_digest(backend: Tokenizer) -> str:
    """A digest of what gives a token id its meaning: the vocabulary, the merges and the added tokens with their ids
    (not padding, truncation or the chat template)."""
    spec = json.loads(backend.to_str())
    added = sorted((token["id"], token["content"], token["special"]) for token in spec.get("added_tokens", []))
    key = json.dumps([spec.get("model"), spec.get("pre_tokenizer"), spec.get("normalizer"), added], sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def check_same_tokenizer(tokenizer: PreTrainedTokenizerBase, model_dir: Path, flag: str) -> None:
    """Refuse, in one line, to train the model in ``model_dir`` further with another tokenizer than the one saved
    beside it: with the same vocabulary size nothing else would notice, and every id would mean another token. A
    directory without a tokenizer.json is not checked."""
    saved = model_dir / "tokenizer.json"
    if not saved.is_file() or not getattr(tokenizer, "is_fast", False):
        return
    if token_map_digest(Tokenizer.from_file(str(saved))) != token_map_digest(tokenizer.backend_tokenizer):
        source = getattr(tokenizer, "name_or_path", "") or "the given tokenizer"
        raise ValueError(f"{flag} {model_dir}: its tokenizer.json differs from the tokenizer in {source} (a model "
                         f"made before MiniNorm's tool and thinking tokens?); its ids would mean other tokens -- pass "
                         f"--tokenizer_path {model_dir}, or train it again from scratch with today's tokenizer")


def token_starts(tokenizer: PreTrainedTokenizerBase, text: str) -> list[tuple[int, int]]:
    """Each token of `text` (no special tokens) with the offset of its first character in `text`."""
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return [(token, start) for token, (start, _) in zip(encoding["input_ids"], encoding["offset_mapping"])]


def token_bytes(tokenizer: PreTrainedTokenizerBase, token_ids: Sequence[int]) -> list[bytes]:
    """Each token's own bytes, which may be part of a character only (the first byte of a 3-byte Chinese
    character): a byte-level BPE token's bytes (MiniNorm's and Qwen's tokenizers); a SentencePiece-style token's
    text with its word mark "▁" as a space, or its one byte for a byte-fallback token ("<0xE4>"; Llama's
    tokenizers); an added token's text (<|im_end|>) in UTF-8. A token of any other kind is the UTF-8 of its
    decoded text."""
    added = tokenizer.added_tokens_decoder
    kind = _piece_kind(tokenizer)
    out = []
    for token_id, piece in zip(token_ids, tokenizer.convert_ids_to_tokens(list(token_ids))):
        if token_id in added or piece is None:
            out.append(tokenizer.decode([token_id]).encode("utf-8"))
        elif kind == "byte_level" and all(char in _BYTE_OF_CHAR for char in piece):
            out.append(bytes(_BYTE_OF_CHAR[char] for char in piece))
        elif kind == "sentencepiece" and (byte := _BYTE_FALLBACK.fullmatch(piece)):
            out.append(bytes([int(byte.group(1), 16)]))
        elif kind == "sentencepiece":
            out.append(piece.replace(_WORD_MARK, " ").encode("utf-8"))
        else:
            out.append(tokenizer.decode([token_id]).encode("utf-8"))
    return out


def _piece_kind(tokenizer: PreTrainedTokenizerBase) -> str:
    """How the tokenizer writes a token's bytes, read from its decoder: "byte_level" (one character per byte),
    "sentencepiece" ("▁" for a space) or "other". A tokenizer without a fast backend is taken as byte-level,
    as MiniNorm's own are."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.decoder is None:
        return "byte_level" if backend is None else "other"
    decoder = json.loads(backend.decoder.__getstate__())
    steps = decoder.get("decoders") or [decoder]
    types = {step.get("type") for step in steps}
    if "ByteLevel" in types:
        return "byte_level"
    if "Metaspace" in types or any(step.get("type") == "Replace" and step.get("pattern", {}).get("String")
                                   == _WORD_MARK for step in steps):
        return "sentencepiece"
    return "other"
