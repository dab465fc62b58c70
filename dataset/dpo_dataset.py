"""DPO data: preference pairs, each a chosen and a rejected ChatML conversation with the same prompt.

A jsonl line is MiniMind's ``{"chosen": [messages], "rejected": [messages]}``: the same messages up to a different
final assistant answer (dataset.jsonl checks it, naming the file and line of a bad one). Both conversations are
encoded by ``dataset.chat_format.encode_chatml_batch`` (text stays text), and labels follow the SFT rule
(``dataset.sft_dataset.assistant_labels``) restricted to the final answer: its content and its closing
``<|im_end|>``. DPO compares the log-probabilities of exactly these tokens. Rows are cut to ``max_seq_len`` (the
start is kept); a pair whose chosen or rejected answer is cut away entirely, or whose two rows are the same once
cut (answers that differ only past ``max_seq_len``), is dropped and counted.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from datasets import Features, List, Value
from torch.utils.data import Dataset
from transformers import PreTrainedTokenizerBase

from dataset.building import list_values, map_jsonl, supervised_stats
from dataset.chat_format import encode_chatml_batch
from dataset.sft_dataset import (IGNORE_INDEX, assistant_labels, chat_pad_token_id, collate_rows,
                                 supervised_count)

SIDES = ("chosen", "rejected")
PAIR_FEATURES = Features(
    {
        **{f"{side}_{column}": List(Value("int32")) for side in SIDES for column in ("input_ids", "labels")},
        "truncated": Value("bool"),
        "supervised_cut": Value("int32"),
    }
)


def _encode_pairs(batch: dict, tokenizer: PreTrainedTokenizerBase, max_seq_len: int) -> dict:
    out: dict[str, list] = {name: [] for name in PAIR_FEATURES}
    count = len(batch["chosen"])
    encodings = encode_chatml_batch(tokenizer, [*batch["chosen"], *batch["rejected"]])
    for chosen, rejected in zip(encodings[:count], encodings[count:]):
        all_labels = {side: assistant_labels(encoding, final_answer_only=True)
                      for side, encoding in zip(SIDES, (chosen, rejected))}
        labels = {side: side_labels[:max_seq_len] for side, side_labels in all_labels.items()}
        if not all(supervised_count(side_labels) for side_labels in labels.values()):
            continue  # an answer cut away entirely: nothing to compare; dropped, and counted by the caller
        if chosen.input_ids[:max_seq_len] == rejected.input_ids[:max_seq_len]:
            # Answers that differ only past the cut: the two rows are one, the pair prefers nothing (loss log 2,
            # no gradient, as a pair with the same answer, which the line check refuses); dropped and counted.
            continue
        for side, encoding in zip(SIDES, (chosen, rejected)):
            out[f"{side}_input_ids"].append(encoding.input_ids[:max_seq_len])
            out[f"{side}_labels"].append(labels[side])
        out["truncated"].append(max(len(chosen.input_ids), len(rejected.input_ids)) > max_seq_len)
        out["supervised_cut"].append(sum(supervised_count(side_labels[max_seq_len:])
                                         for side_labels in all_labels.values()))
    return out


class DPODataset(Dataset):
    """Preference pairs ``{"input_ids", "labels", "rejected_input_ids", "rejected_labels"}`` (LongTensors; the
    first two are the chosen conversation's) from a jsonl of ``{"chosen": [...], "rejected": [...]}`` lines.
    ``collate`` stacks a batch of B pairs as 2B rows, the chosen ones first.

    ``stats``: pairs, samples, dropped_no_supervision (here also the pairs whose two rows are the same once cut),
    truncated, skipped_lines, tokens, supervised_tokens, supervision_cut, supervised_tokens_cut
    (dataset.building.supervised_stats; both answers of a pair counted).
    """

    def __init__(
        self,
        path: str | Path,
        tokenizer: PreTrainedTokenizerBase,
        max_seq_len: int,
        num_proc: int | None = None,
        skip_bad_lines: bool = False,
        cache_dir: str | Path | None = None,
    ) -> None:
        self.pad_token_id = chat_pad_token_id(tokenizer, max_seq_len)
        mapped = map_jsonl(
            path,
            "preference",
            _encode_pairs,
            {"tokenizer": tokenizer, "max_seq_len": max_seq_len},
            features=PAIR_FEATURES,
            batch_size=500,
            desc="tokenizing preference pairs",
            num_proc=num_proc,
            skip_bad_lines=skip_bad_lines,
            cache_dir=cache_dir,
            if_empty=f"no preference pair keeps a token of both answers, and a difference between them, within "
                     f"max_seq_len={max_seq_len}",
        )
        labels = [chunk.flatten() for side in SIDES for chunk in mapped.rows.data.column(f"{side}_labels").chunks]
        self.stats = supervised_stats(
            "pairs", mapped, tokens=list_values(mapped.rows, [f"{side}_input_ids" for side in SIDES]),
            supervised_tokens=int(sum(np.sum(np.asarray(chunk) != IGNORE_INDEX) for chunk in labels)),
        )
        self._rows = mapped.rows.remove_columns(["truncated", "supervised_cut"])

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        row = self._rows[index]
        return {
            "input_ids": torch.tensor(row["chosen_input_ids"], dtype=torch.long),
            "labels": torch.tensor(row["chosen_labels"], dtype=torch.long),
            "rejected_input_ids": torch.tensor(row["rejected_input_ids"], dtype=torch.long),
            "rejected_labels": torch.tensor(row["rejected_labels"], dtype=torch.long),
        }

    def collate(self, batch: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """2B right-padded rows (collate_rows): the B chosen conversations, then the B rejected ones in the same
        order, so row i and row B + i are one pair."""
        rejected = [{"input_ids": item["rejected_input_ids"], "labels": item["rejected_labels"]} for item in batch]
        return collate_rows([*batch, *rejected], self.pad_token_id)
