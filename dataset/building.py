"""How every training dataset is built from its jsonl file: load, map, check, count.

The records that ``dataset.jsonl`` validated (a bad line is an error naming the file and line) are mapped batch by
batch into rows by the dataset's own function, with ``datasets``' Arrow cache (a second run on the same file,
tokenizer and arguments reads the cached rows) and ``num_proc`` workers; a file that leaves no row is an error
naming the file. Each dataset keeps what is its own: the mapper and its row schema, and what its ``stats`` count.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import numpy as np

from dataset.jsonl import Kind, load_jsonl

# The shortest --max_seq_len a training dataset takes: a sample's first token and the next one it learns to predict
# (trainer/arg_checks.py refuses a shorter one with the other flags, before any data work).
MIN_SEQ_LEN = 2


@dataclass(frozen=True)
class MappedJsonl:
    """A jsonl file's records mapped into rows: ``rows`` holds only the mapper's columns; ``records`` counts the
    records read (a mapper may drop some), ``skipped_lines`` the bad lines skipped (``skip_bad_lines``) and
    ``empty_documents`` the pretraining texts of only whitespace left out (dataset.jsonl.is_empty_document);
    ``source`` is the records themselves (memory-mapped, as read)."""

    rows: datasets.Dataset
    records: int
    skipped_lines: int
    source: datasets.Dataset
    empty_documents: int = 0


def map_jsonl(
    path: str | Path,
    kind: Kind,
    mapper: Callable[..., dict],
    fn_kwargs: dict[str, Any],
    *,
    features: datasets.Features,
    batch_size: int,
    desc: str,
    num_proc: int | None,
    skip_bad_lines: bool,
    cache_dir: str | Path | None,
    if_empty: str | None = None,
    empty_answers: bool = False,
) -> MappedJsonl:
    """Load ``path`` as records of ``kind`` and map them, ``batch_size`` at a time, with ``mapper(batch,
    **fn_kwargs)`` into rows of ``features``. ``if_empty``: the reason given, after the path, when no row is left
    (``None``: the mapper never leaves none). ``empty_answers``: dataset.jsonl.iter_records'."""
    raw, scan = load_jsonl(path, kind, skip_bad_lines, cache_dir, empty_answers)
    rows = raw.map(
        mapper,
        batched=True,
        batch_size=batch_size,
        num_proc=num_proc,
        remove_columns=raw.column_names,
        features=features,
        fn_kwargs=fn_kwargs,
        desc=desc,
    )
    if if_empty is not None and len(rows) == 0:
        raise ValueError(f"{path}: {if_empty}")
    return MappedJsonl(rows, len(raw), scan.skipped_lines, raw, scan.empty_documents)


def list_values(rows: datasets.Dataset, columns: Sequence[str]) -> int:
    """How many values the list columns ``columns`` hold in all, read from the Arrow chunks without copying rows."""
    return int(sum(len(chunk.flatten()) for column in columns for chunk in rows.data.column(column).chunks))


def supervised_stats(unit: str, mapped: MappedJsonl, tokens: int, supervised_tokens: int) -> dict:
    """The ``stats`` of a dataset that learns from some tokens of each row only (SFT, DPO): the records read, named
    ``unit``; the samples kept; the records dropped for keeping no supervised token within max_seq_len; the rows
    cut to max_seq_len (the rows' bool column ``truncated``); the bad lines skipped; the tokens given; and, of the
    samples kept, those whose supervision the cut shortened (``supervision_cut``: a reply that loses its end, and
    with it the ``<|im_end|>`` that teaches the model to stop) and the supervised tokens they lost (the rows' int
    column ``supervised_cut``)."""
    columns = mapped.rows.with_format("numpy", columns=["truncated", "supervised_cut"])[:]
    truncated, supervised_cut = columns["truncated"], columns["supervised_cut"]
    return {
        unit: mapped.records,
        "samples": len(mapped.rows),
        "dropped_no_supervision": mapped.records - len(mapped.rows),
        "truncated": int(np.sum(truncated)),
        "skipped_lines": mapped.skipped_lines,
        "tokens": tokens,
        "supervised_tokens": supervised_tokens,
        "supervision_cut": int(np.sum(supervised_cut > 0)),
        "supervised_tokens_cut": int(np.sum(supervised_cut)),
    }
