"""Packed pretraining data: documents joined by eos and cut into fixed-length rows, with no padding.

Every document is tokenized (Arrow-cached ``map``) and followed by the tokenizer's eos (``<|im_end|>`` for
MiniNorm's tokenizer; ``<|endoftext|>`` is only padding here). The token stream of the whole file, in file
order, is cut into ``max_seq_len`` rows: row ``i`` is ``stream[i*L:(i+1)*L]``. So no slot is padding and no
token is lost except the final remainder shorter than one row, which is dropped (at most ``L-1`` tokens).
Rows can span document boundaries; the eos between documents tells the model where one ends. Labels equal
input ids: the model shifts them (Hugging Face convention).

The stream is read zero-copy from the memory-mapped Arrow cache, so multi-GB corpora do not load into RAM.

A held-out split must be cut by document, not by row: rows span document boundaries, so splitting rows would put
the rest of a validation document into training. ``split_documents`` gives two views of the same tokenized file,
each packing only its own documents (in file order).

The first token of every row is never a target: position t predicts token t + 1, so each row of L tokens trains
on L - 1 of them, and 1/L of the stream (its every L-th token) is only ever seen as context.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import datasets
import numpy as np
import pyarrow.compute as pc
import torch
from datasets import Features, List, Value
from torch.utils.data import Dataset
from transformers import PreTrainedTokenizerBase

from dataset.building import MIN_SEQ_LEN, map_jsonl
from dataset.chat_format import text_backend

TOKEN_FEATURES = Features({"input_ids": List(Value("int32"))})


def encode_documents(tokenizer: PreTrainedTokenizerBase, texts: list[str],
                     control_tokens: bool = False) -> list[list[int]]:
    """Each pretraining document's token ids (no eos). Text is text: a `<|im_end|>` or `<|endoftext|>` written in a
    document is a few ordinary tokens, never the control token, which a scraped page could otherwise plant (an eos
    in mid-document). `control_tokens` reads such strings as the control tokens: MiniMind's pretrain_hq.jsonl marks
    its turns with them (--control_tokens_in_text)."""
    if control_tokens:
        return tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [encoding.ids for encoding in text_backend(tokenizer).encode_batch(texts, add_special_tokens=False)]


def control_token_text(tokenizer: PreTrainedTokenizerBase, texts: datasets.Dataset) -> np.ndarray:
    """Which documents (a bool per row of `texts`, the records' "text" column) hold one of the tokenizer's special
    token strings, `<|im_start|>` say: read as text unless --control_tokens_in_text, so MiniMind's pretrain_hq.jsonl
    without the flag trains its turn marks as characters (a pyarrow substring search over the memory-mapped text)."""
    specials = sorted({added.content for added in tokenizer.added_tokens_decoder.values() if added.special})
    column = texts.data.column("text")
    if not specials:
        return np.zeros(len(column), dtype=bool)
    # One RE2 pass of the strings as literals (4 ms over the 17 MB default corpus; a search per string took 0.5 s)
    found = pc.match_substring_regex(column, "|".join(re.escape(token) for token in specials))
    return np.asarray(found.to_numpy(zero_copy_only=False), dtype=bool)


def _tokenize_documents(batch: dict, tokenizer: PreTrainedTokenizerBase, eos_id: int, control_tokens: bool) -> dict:
    return {"input_ids": [ids + [eos_id] for ids in encode_documents(tokenizer, batch["text"], control_tokens)]}


class PretrainDataset(Dataset):
    """Fixed-length packed rows ``{"input_ids", "labels"}`` (LongTensor[max_seq_len]) from a jsonl of
    ``{"text": ...}`` lines. ``stats`` reports documents, tokens (with separators), sequences,
    packing_efficiency (tokens that land in a row / tokens tokenized -- padding is zero by construction, so
    only the dropped tail counts against it), padding_tokens, dropped_tail_tokens, skipped_lines, empty_documents
    (texts of only whitespace, left out of the file's documents: dataset.jsonl.is_empty_document), and
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
        control_tokens: bool = False,
    ) -> None:
        if max_seq_len < MIN_SEQ_LEN:
            raise ValueError(f"max_seq_len must be at least {MIN_SEQ_LEN}, got {max_seq_len}")
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos token to separate documents with")
        self.max_seq_len = max_seq_len
        mapped = map_jsonl(
            path,
            "text",
            _tokenize_documents,
            {"tokenizer": tokenizer, "eos_id": tokenizer.eos_token_id, "control_tokens": control_tokens},
            features=TOKEN_FEATURES,
            batch_size=1000,
            desc="tokenizing documents",
            num_proc=num_proc,
            skip_bad_lines=skip_bad_lines,
            cache_dir=cache_dir,
        )
        self._tokens = mapped.rows
        self._doc_lengths = np.concatenate(
            [pc.list_value_length(chunk).to_numpy() for chunk in self._tokens.data.column("input_ids").chunks]
        ).astype(np.int64)
        self._skipped_lines, self._empty_documents = mapped.skipped_lines, mapped.empty_documents
        # Read as the tokens, they need no note; read as text, a note says how many documents hold them.
        self._control_text = (np.zeros(len(self._doc_lengths), dtype=bool) if control_tokens
                              else control_token_text(tokenizer, mapped.source))
        self._chunks: list[np.ndarray] | None = None
        self._path = path
        self._select(np.arange(len(self._doc_lengths)))

    def _select(self, documents: np.ndarray) -> None:
        """Pack only `documents` (indices in file order, ascending): their tokens, concatenated, are the stream."""
        lengths = self._doc_lengths[documents]
        total = int(lengths.sum())
        self._num_sequences = total // self.max_seq_len
        if self._num_sequences == 0:
            raise ValueError(f"{self._path}: {total} tokens is less than one sequence of "
                             f"max_seq_len={self.max_seq_len}")
        # Runs of consecutive documents become one segment (start in the file's stream, length); the view's stream
        # is the segments one after the other.
        file_starts = np.concatenate([[0], np.cumsum(self._doc_lengths)])[documents]
        view_starts = np.concatenate([[0], np.cumsum(lengths)])
        run_firsts = np.concatenate([[0], np.flatnonzero(np.diff(documents) != 1) + 1])
        self._segment_starts = file_starts[run_firsts]
        self._segment_offsets = np.append(view_starts[run_firsts], total)
        packed = self._num_sequences * self.max_seq_len
        self.documents = documents
        self.stats = {
            "documents": int(len(documents)),
            "tokens": total,
            "sequences": self._num_sequences,
            "packing_efficiency": packed / total,
            "padding_tokens": 0,
            "dropped_tail_tokens": total - packed,
            "skipped_lines": self._skipped_lines,
            "empty_documents": self._empty_documents,
            "control_token_text": int(self._control_text[documents].sum()),
            "padded_baseline_efficiency": float(np.minimum(lengths, self.max_seq_len).sum())
            / (len(lengths) * self.max_seq_len),
        }

    def split_documents(self, fraction: float, seed: int) -> tuple[PretrainDataset, PretrainDataset]:
        """(train, validation) views: a seeded random `fraction` of the documents (at least one) is held out whole."""
        count = len(self._doc_lengths)
        order = np.random.default_rng(seed).permutation(count)
        num_val = max(1, round(count * fraction))
        if num_val >= count:
            raise ValueError(f"{self._path}: only {count} documents, too few to hold out a validation split; "
                             f"give --val_data_path")
        views = []
        advice = {"training": "lower --max_seq_len or give more text",
                  "validation": "raise --val_fraction or give --val_data_path"}
        for split, chosen in (("training", order[num_val:]), ("validation", order[:num_val])):
            view = copy.copy(self)
            try:
                view._select(np.sort(chosen))
            except ValueError:  # said of the split, not of the whole file
                tokens = int(self._doc_lengths[chosen].sum())
                raise ValueError(f"{self._path}: its {split} split ({len(chosen)} of {count} documents, --val_fraction "
                                 f"{fraction:g} held out) holds {tokens} tokens, less than one sequence of "
                                 f"max_seq_len={self.max_seq_len}; {advice[split]}") from None
            views.append(view)
        return views[0], views[1]

    def _stream(self) -> tuple[list[np.ndarray], np.ndarray]:
        """Per-Arrow-chunk flat token arrays (zero-copy views of the mmap) and each chunk's start offset."""
        if self._chunks is None:
            self._chunks = [
                chunk.flatten().to_numpy(zero_copy_only=False) for chunk in self._tokens.data.column("input_ids").chunks
            ]
            self._starts = np.cumsum([0] + [len(c) for c in self._chunks])
        return self._chunks, self._starts

    def _read(self, begin: int, end: int, pieces: list[np.ndarray]) -> None:
        """Append the file's stream[begin:end] to `pieces` (it may cross Arrow chunks)."""
        chunks, starts = self._stream()
        chunk = int(np.searchsorted(starts, begin, side="right")) - 1
        while begin < end:
            offset = begin - starts[chunk]
            piece = chunks[chunk][offset : offset + (end - begin)]
            pieces.append(piece)
            begin += len(piece)
            chunk += 1

    def __len__(self) -> int:
        return self._num_sequences

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if index < 0:
            index += self._num_sequences
        if not 0 <= index < self._num_sequences:
            raise IndexError(f"sequence {index} out of range [0, {self._num_sequences})")
        begin, end = index * self.max_seq_len, (index + 1) * self.max_seq_len
        pieces: list[np.ndarray] = []
        segment = int(np.searchsorted(self._segment_offsets, begin, side="right")) - 1
        while begin < end:
            inside = begin - self._segment_offsets[segment]
            take = min(end, self._segment_offsets[segment + 1]) - begin
            start = int(self._segment_starts[segment] + inside)
            self._read(start, start + int(take), pieces)
            begin += take
            segment += 1
        input_ids = torch.from_numpy(np.concatenate(pieces).astype(np.int64))
        return {"input_ids": input_ids, "labels": input_ids.clone()}

    def __getstate__(self) -> dict:
        # DataLoader workers get the (path-backed) Arrow dataset and rebuild the zero-copy views themselves.
        state = self.__dict__.copy()
        state["_chunks"] = None
        state.pop("_starts", None)
        return state
