"""SFT data: ChatML-rendered conversations with the loss on assistant replies only.

Labels are the input ids on exactly these tokens of every assistant turn: its content and its closing
``<|im_end|>``. Everything else is -100: system and user turns, the ``<|im_start|>assistant\\n`` header (the
prompt supplies it at inference), and the newline after ``<|im_end|>`` (the model stops at eos and never
generates it). MiniMind issues #636 and #416 were off-by-one bugs exactly at these boundaries.

Conversations are encoded by ``dataset.chat_format.encode_chatml_batch``, the encoder chat and the server use
too: the same ids ``apply_chat_template`` gives, except that a control-token string inside a message stays text
(an answer that mentions ``<|im_end|>`` does not teach the model to stop there). It also says which tokens are
assistant tokens. Rows are cut to ``max_seq_len`` (the start is kept); a row left with no supervised token is
dropped and counted; a row whose replies the cut shortened is kept and counted, with the supervised tokens it lost.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from datasets import Features, List, Value
from torch.utils.data import Dataset
from transformers import PreTrainedTokenizerBase

from dataset.building import MIN_SEQ_LEN, list_values, map_jsonl, supervised_stats
from dataset.chat_format import ChatEncoding, check_chatml_tokenizer, encode_chatml_batch

IGNORE_INDEX = -100
SAMPLE_FEATURES = Features(
    {
        "input_ids": List(Value("int32")),
        "labels": List(Value("int32")),
        "supervised": Value("int32"),
        "truncated": Value("bool"),
        "supervised_cut": Value("int32"),
    }
)


def assistant_labels(encoding: ChatEncoding, final_answer_only: bool = False) -> list[int]:
    """The labels of an encoded conversation: its ids on assistant tokens (each assistant message's content and
    closing <|im_end|>), -100 elsewhere. `final_answer_only`: on the last assistant message's tokens only (what a
    preference pair's two answers differ in); earlier turns are prompt."""
    learned = encoding.assistant
    if final_answer_only:
        # Assistant messages are separated by their headers (never learned), so the last run of learned tokens is
        # the last assistant message.
        end = len(learned)
        while end and not learned[end - 1]:
            end -= 1
        start = end
        while start and learned[start - 1]:
            start -= 1
        learned = [start <= index < end for index in range(len(learned))]
    return [token if is_learned else IGNORE_INDEX for token, is_learned in zip(encoding.input_ids, learned)]


def supervised_count(labels: Sequence[int]) -> int:
    """How many of ``labels`` are learnt (not -100)."""
    return sum(label != IGNORE_INDEX for label in labels)


def chat_pad_token_id(tokenizer: PreTrainedTokenizerBase, max_seq_len: int) -> int:
    """The checks every chat dataset makes of its arguments; returns the id collate_rows pads with."""
    if max_seq_len < MIN_SEQ_LEN:
        raise ValueError(f"max_seq_len must be at least {MIN_SEQ_LEN}, got {max_seq_len}")
    check_chatml_tokenizer(tokenizer)
    if tokenizer.pad_token_id is None:
        raise ValueError("the tokenizer has no pad token for collate()")
    return int(tokenizer.pad_token_id)


def collate_rows(rows: Sequence[dict[str, torch.Tensor]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad rows of ``input_ids`` and ``labels``: ``input_ids`` with the pad id, ``labels`` with -100, plus
    ``attention_mask``."""
    width = max(len(item["input_ids"]) for item in rows)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for row, item in enumerate(rows):
        n = len(item["input_ids"])
        input_ids[row, :n] = item["input_ids"]
        labels[row, :n] = item["labels"]
        attention_mask[row, :n] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


def _encode_conversations(batch: dict, tokenizer: PreTrainedTokenizerBase, max_seq_len: int) -> dict:
    out: dict[str, list] = {name: [] for name in SAMPLE_FEATURES}
    for encoding in encode_chatml_batch(tokenizer, batch["conversations"]):
        ids = encoding.input_ids
        all_labels = assistant_labels(encoding)
        labels = all_labels[:max_seq_len]
        supervised = supervised_count(labels)
        if supervised == 0:
            continue  # nothing to learn from; dropping it (a batch map may shrink) is counted by the caller
        out["input_ids"].append(ids[:max_seq_len])
        out["labels"].append(labels)
        out["supervised"].append(supervised)
        out["truncated"].append(len(ids) > max_seq_len)
        out["supervised_cut"].append(supervised_count(all_labels[max_seq_len:]))
    return out


class SFTDataset(Dataset):
    """Rows ``{"input_ids", "labels"}`` (LongTensor[L], L <= max_seq_len) from a jsonl of
    ``{"conversations": [{"role", "content"}, ...]}`` lines (MiniMind's format; extra fields such as
    ``reasoning_content`` or ``tools`` are ignored). Use ``DataLoader(ds, collate_fn=ds.collate)``.

    ``stats``: conversations, samples, dropped_no_supervision, truncated, skipped_lines, tokens,
    supervised_tokens, supervision_cut, supervised_tokens_cut (dataset.building.supervised_stats).

    An assistant message with nothing in it (MiniMind's rlaif.jsonl ends each prompt so) is a bad line: learnt, it
    teaches the model to answer nothing. ``empty_answers`` reads it, for a run that learns none of the data's
    answers (a distillation whose every step samples its completions for the prompts).
    """

    def __init__(
        self,
        path: str | Path,
        tokenizer: PreTrainedTokenizerBase,
        max_seq_len: int,
        num_proc: int | None = None,
        skip_bad_lines: bool = False,
        cache_dir: str | Path | None = None,
        empty_answers: bool = False,
    ) -> None:
        self.pad_token_id = chat_pad_token_id(tokenizer, max_seq_len)
        mapped = map_jsonl(
            path,
            "conversations",
            _encode_conversations,
            {"tokenizer": tokenizer, "max_seq_len": max_seq_len},
            features=SAMPLE_FEATURES,
            batch_size=500,
            desc="tokenizing conversations",
            num_proc=num_proc,
            skip_bad_lines=skip_bad_lines,
            cache_dir=cache_dir,
            if_empty=f"no conversation has a supervised token within max_seq_len={max_seq_len}",
            empty_answers=empty_answers,
        )
        supervised = mapped.rows.with_format("numpy", columns=["supervised"])[:]["supervised"]
        self.stats = supervised_stats("conversations", mapped, tokens=list_values(mapped.rows, ["input_ids"]),
                                      supervised_tokens=int(np.sum(supervised)))
        self._rows = mapped.rows.select_columns(["input_ids", "labels"])

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        row = self._rows[index]
        return {
            "input_ids": torch.tensor(row["input_ids"], dtype=torch.long),
            "labels": torch.tensor(row["labels"], dtype=torch.long),
        }

    def collate(self, batch: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Right-pad a batch (collate_rows)."""
        return collate_rows(batch, self.pad_token_id)
