"""Loaders for the local lm-evaluation-harness tasks in this folder (docs/harness.md): each task's rows come from
the jsonl file beside this one, so the harness runs with no hub access and from any working directory."""

from __future__ import annotations

from pathlib import Path

import datasets

HERE = Path(__file__).resolve().parent


def _test_split(file_name: str) -> datasets.DatasetDict:
    rows = datasets.load_dataset("json", data_files=str(HERE / file_name), split="train")
    return datasets.DatasetDict({"test": rows})


def load_qa(**kwargs) -> datasets.DatasetDict:
    """Short questions with one answer: {"question", "answer"}."""
    return _test_split("qa.jsonl")


def load_cloze(**kwargs) -> datasets.DatasetDict:
    """Sentence starts with four endings, the first one right: {"context", "choices", "gold"}."""
    return _test_split("cloze.jsonl")
