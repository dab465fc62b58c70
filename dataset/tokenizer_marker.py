"""The name of a model directory's record of its tokenizer files, the one owner (what the record holds, and how a
save writes and a load checks it: dataset/tokenization.py). On its own, importing nothing, so trainer/run_dir.py
lists it among a model directory's files without loading transformers."""

from __future__ import annotations

TOKENIZER_MARKER = "tokenizer_files.json"
