"""RL prompt data: prompts to sample completions for, each with the row's other fields for the reward functions.

A jsonl line is one of
- ``{"prompt": "...", ...}``: one user message; ``{"prompt": [...], ...}`` (TRL's conversational prompt) its messages;
- ``{"messages": [...], ...}`` or MiniMind's ``{"conversations": [...]}`` (its rlaif.jsonl): a conversation whose
  prompt is every message before its last assistant turn (an rlaif row's last assistant turn is empty or absent);
every other field (e.g. ``answer``) is a column handed to the reward functions (trainer/rewards.py). A row with
more than one of these fields is prompted by the first of "prompt", "messages", "conversations" (``prompt_field``),
and the others are columns: TRL's GRPOTrainer prompts with its "prompt" column alone and hands every other column,
a "messages" one too, to its reward functions. The prompt is
encoded as ChatML with the assistant's header open (``add_generation_prompt``; with ``open_thinking`` the thinking
block is left open too, so the policy may think first; with ``tools``, GRPO's and PPO's --tools, their schemas in
the system turn in place of any the row's system message carries, as the rollouts run exactly those): what the policy
continues. A
prompt longer than ``max_seq_len`` tokens is dropped and counted. A bad line is an error naming the file, the line
and the field (or, with ``skip_bad_lines``, skipped and counted); so is a row whose columns the run's rewards cannot
read (``column_check``: trainer/rewards.py's column_problems, for the rewards the run names).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset
from transformers import PreTrainedTokenizerBase

from dataset.atomic_io import first_line
from dataset.chat_format import encode_chatml_batch, normalize_messages
from dataset.tools import tool_schemas
from dataset.jsonl import (JSON_WHITESPACE, check_data_file, check_message_shapes, check_records_read,
                           check_tool_results, log_skipped_line, numbered_lines, parse_line)

PROMPT_FIELDS = ("prompt", "messages", "conversations")  # the fields that may hold the prompt, the first present
# What the rewards make of the rows' columns: {line: reason} of the rows they cannot score, given the rows' line
# numbers and columns and the file's name (a ValueError where the data cannot fit them at all).
ColumnCheck = Callable[[Sequence[tuple[int, Mapping[str, Any]]], str], dict[int, str]]


def prompt_field(row: Mapping[str, Any]) -> str | None:
    """The field of a row that holds its prompt: the first of PROMPT_FIELDS it has (None: none). "prompt" first, as
    TRL's GRPOTrainer reads only that column; the row's other fields are columns."""
    return next((field for field in PROMPT_FIELDS if field in row), None)


def prompt_messages(row: Any) -> list[dict[str, Any]]:
    """The messages of a row's prompt (prompt_field), normalized as SFT's are (dataset/chat_format.py,
    normalize_messages: tools, tool calls and reasoning kept), or a ValueError naming the field that is wrong."""
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object, got {type(row).__name__}")
    name = prompt_field(row)
    if name == "prompt" and not isinstance(row["prompt"], list):  # a list: TRL's conversational prompt, messages
        if not isinstance(row["prompt"], str) or not row["prompt"]:
            raise ValueError("field 'prompt' must be a non-empty string or a list of messages")
        return [{"role": "user", "content": row["prompt"]}]
    if name is None:
        raise ValueError(f"no prompt: expected one of the fields {', '.join(PROMPT_FIELDS)}")
    if not isinstance(row[name], list):
        raise ValueError(f"field {name!r} must be a list of messages, got {type(row[name]).__name__}")
    check_message_shapes(row[name], name)  # the message that is wrong, named as SFT's reader names it
    messages = normalize_messages(row[name], name)
    check_tool_results(messages, name)
    if messages and messages[-1]["role"] == "assistant":
        messages = messages[:-1]  # the answer the policy is to write (rlaif.jsonl: empty)
    if not messages:
        raise ValueError(f"field {name!r} holds no message before its last assistant turn")
    return messages


def prompt_text(messages: Sequence[dict[str, Any]]) -> str:
    """What a reward function sees as the prompt: the last user message's content (the question)."""
    return next((m["content"] for m in reversed(messages) if m["role"] == "user"), messages[-1]["content"])


class PromptDataset(Dataset):
    """Prompts ``{"input_ids": LongTensor, "prompt": str, "columns": dict}`` from a jsonl file (see the module's
    docstring). ``collate`` keeps a batch as lists: ``prompt_ids`` (lists of ints), ``prompts``, ``padding``
    (flags) and ``columns`` (one list per column name over the batch; None where a row lacks it).

    ``stats``: prompts, tokens (prompt tokens), dropped_too_long, skipped_lines; ``rows``: each kept prompt's line
    number and columns."""

    def __init__(self, path: str | Path, tokenizer: PreTrainedTokenizerBase, max_seq_len: int,
                 num_proc: int | None = None, skip_bad_lines: bool = False, open_thinking: bool = False,
                 column_check: ColumnCheck | None = None, tools: Sequence[str] = ()) -> None:
        path = Path(path)
        check_data_file(path)
        columns, messages, lines, skipped = [], [], [], 0  # columns: each row's fields beside its prompt
        with open(path, "rb") as handle:
            for number, raw in numbered_lines(handle):
                if not raw.strip(JSON_WHITESPACE):
                    continue
                try:
                    # Every field reaches the reward functions, so a lone surrogate anywhere is a bad line.
                    row = parse_line(raw, surrogates=True)
                    row_messages = prompt_messages(row)
                except ValueError as error:  # BadLine is one
                    if skip_bad_lines:  # named as the other datasets name it: a validation file's skips are in
                        # no printed stats
                        log_skipped_line(path, number, first_line(error))
                        skipped += 1
                        continue
                    raise ValueError(f"{path}:{number}: {first_line(error)} (pass --skip_bad_lines "
                                     f"to skip bad lines)") from None
                columns.append({key: value for key, value in row.items() if key != prompt_field(row)})
                messages.append(row_messages)
                lines.append(number)
        problems = column_check(list(zip(lines, columns)), str(path)) if column_check else {}
        for number in sorted(problems):
            if not skip_bad_lines:
                raise ValueError(f"{path}:{number}: {problems[number]} (pass --skip_bad_lines to skip bad lines)")
            log_skipped_line(path, number, problems[number])
        if problems:
            kept = [index for index, number in enumerate(lines) if number not in problems]
            columns, messages, lines = ([values[index] for index in kept] for values in (columns, messages, lines))
            skipped += len(problems)
        check_records_read(path, "prompt", len(messages), skipped)
        schemas = tool_schemas(tools) if tools else None
        encodings = encode_chatml_batch(tokenizer, messages, add_generation_prompt=True, tools=schemas,
                                        open_thinking=open_thinking)
        self.samples: list[tuple[list[int], str, dict]] = []
        kept_rows: list[tuple[int, dict]] = []
        dropped = 0
        for row_columns, row_messages, encoding, number in zip(columns, messages, encodings, lines):
            if len(encoding.input_ids) > max_seq_len:
                dropped += 1
                continue
            self.samples.append((encoding.input_ids, prompt_text(row_messages), row_columns))
            kept_rows.append((number, row_columns))
        if not self.samples:
            raise ValueError(f"{path}: no prompt of at most --max_seq_len={max_seq_len} tokens (all {dropped} are "
                             f"longer); raise --max_seq_len")
        self.rows = tuple(kept_rows)
        self.stats = {"prompts": len(self.samples), "tokens": sum(len(ids) for ids, _, _ in self.samples),
                      "dropped_too_long": dropped, "skipped_lines": skipped}

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, Any]:
        ids, prompt, columns = self.samples[index]
        return {"input_ids": torch.tensor(ids, dtype=torch.long), "prompt": prompt, "columns": columns}

    @staticmethod
    def collate(samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
        names = sorted({name for sample in samples for name in sample["columns"]})
        return {"prompt_ids": [sample["input_ids"].tolist() for sample in samples],
                "prompts": [sample["prompt"] for sample in samples],
                # a copy that pads a validation shard to equal length (trainer/data.py): not counted
                "padding": [bool(sample.get("padding", False)) for sample in samples],
                "columns": {name: [sample["columns"].get(name) for sample in samples] for name in names}}
