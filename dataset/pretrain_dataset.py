"""Packed pretraining data: documents joined by eos and cut into fixed-length rows, with no padding.

Every document is tokenized (Arrow-cached ``map``) and followed by the tokenizer's eos (``<|im_end|>`` for
MiniNorm's tokenizer; ``<|endoftext|>`` is only padding here). The token stream of the whole file, in file
order, is cut into ``max_seq_len`` rows: row ``i`` is ``stream[i*L:(i+1)*L]``. So no slot is padding and no
token is lost except the final remainder shorter than one row, which is dropped (at most ``L-1`` tokens).
Rows can span document boundaries; the eos between documents tells the model where one ends. Labels equal
input ids: the model shifts them (Hugging Face convention).

The stream is read zero-copy from the memory-mapped Arrow cache, so multi-GB corpora do not load into RAM.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import torch
from datasets import Features, List, Value
from torch.utils.data import Dataset
from transformers import PreTrainedTokenizerBase

from dataset.jsonl import load_jsonl

TOKEN_FEATURES = Features({"input_ids": List(Value("int32"))})


def _tokenize_documents(batch: dict, tokenizer: PreTrainedTokenizerBase, eos_id: int) -> dict:
    encoded = tokenizer(batch["text"], add_special_tokens=False)["input_ids"]
    return {"input_ids": [ids + [eos_id] for ids in encoded]}


class PretrainDataset(Dataset):
    """Fixed-length packed rows ``{"input_ids", "labels"}`` (LongTensor[max_seq_len]) from a jsonl of
    ``{"text": ...}`` lines. ``stats`` reports documents, tokens (with separators), sequences,
    packing_efficiency (tokens that land in a row / tokens tokenized -- padding is zero by construction, so
    only the dropped tail counts against it), padding_tokens, dropped_tail_tokens, skipped_lines, and
    padded_baseline_efficiency: real/total slots had each document been truncated/padded to its own row,
    as MiniMind does."""

    def __init__(
        self,
        path: str | Path,
        tokenizer: PreTrainedTokenizerBase,
        max_seq_len: int,
        num_proc: int | None = None,
        skip_bad_lines: bool = False,
        cache_dir: str | Path | None = None,
    ) -> None:
        if max_seq_len < 2:
            raise ValueError(f"max_seq_len must be at least 2, got {max_seq_len}")
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos token to separate documents with")
        self.max_seq_len = max_seq_len
        raw, scan = load_jsonl(path, "text", skip_bad_lines, cache_dir)
        self._tokens = raw.map(
            _tokenize_documents,
            batched=True,
            batch_size=1000,
            num_proc=num_proc,
            remove_columns=raw.column_names,
            features=TOKEN_FEATURES,
            fn_kwargs={"tokenizer": tokenizer, "eos_id": tokenizer.eos_token_id},
            desc="tokenizing documents",
        )
        lengths = np.concatenate(
            [pc.list_value_length(chunk).to_numpy() for chunk in self._tokens.data.column("input_ids").chunks]
        ).astype(np.int64)
        total = int(lengths.sum())
        self._num_sequences = total // max_seq_len
        if self._num_sequences == 0:
            raise ValueError(f"{path}: {total} tokens is less than one sequence of max_seq_len={max_seq_len}")
        self._chunks: list[np.ndarray] | None = None
        packed = self._num_sequences * max_seq_len
        self.stats = {
            "documents": int(len(lengths)),
            "tokens": total,
            "sequences": self._num_sequences,
            "packing_efficiency": packed / total,
            "padding_tokens": 0,
            "dropped_tail_tokens": total - packed,
            "skipped_lines": scan.skipped_lines,
            "padded_baseline_efficiency": float(np.minimum(lengths, max_seq_len).sum()) / (len(lengths) * max_seq_len),
        }

    def _stream(self) -> tuple[list[np.ndarray], np.ndarray]:
        """Per-Arrow-chunk flat token arrays (zero-copy views of the mmap) and each chunk's start offset."""
        if self._chunks is None:
            self._chunks = [
                chunk.flatten().to_numpy(zero_copy_only=False) for chunk in self._tokens.data.column("input_ids").chunks
            ]
            self._starts = np.cumsum([0] + [len(c) for c in self._chunks])
        return self._chunks, self._starts

    def __len__(self) -> int:
        return self._num_sequences

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if index < 0:
            index += self._num_sequences
        if not 0 <= index < self._num_sequences:
            raise IndexError(f"sequence {index} out of range [0, {self._num_sequences})")
        chunks, starts = self._stream()
        begin, end = index * self.max_seq_len, (index + 1) * self.max_seq_len
        pieces = []
        chunk = int(np.searchsorted(starts, begin, side="right")) - 1
        while begin < end:
            offset = begin - starts[chunk]
            piece = chunks[chunk][offset : offset + (end - begin)]
            pieces.append(piece)
            begin += len(piece)
            chunk += 1
        input_ids = torch.from_numpy(np.concatenate(pieces).astype(np.int64))
        return {"input_ids": input_ids, "labels": input_ids.clone()}

    def __getstate__(self) -> dict:
        # DataLoader workers get the (path-backed) Arrow dataset and rebuild the zero-copy views themselves.
        state = self.__dict__.copy()
        state["_chunks"] = None
        state.pop("_starts", None)
        return state
