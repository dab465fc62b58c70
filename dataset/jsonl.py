"""The one place that reads MiniMind-format jsonl: line-level validation, then Arrow loading.

MiniMind files are loaded unchanged, but ``datasets.load_dataset("json")`` infers one schema from the first
10 MB and fails on later lines with extra or differently typed fields (``reasoning_content``, ``tools``, a
``null`` content). So a streaming pass first checks every line -- a bad one raises
``ValueError("data.jsonl:17: missing \\"text\\" field")`` unless ``skip_bad_lines`` -- and a file that is not
already in the plain shape (only the needed fields, all strings) is rewritten once into a normalized copy
in the cache. A plain file (MiniMind's usual case) is handed to ``load_dataset`` as is. The scan result is
cached by (path, size, mtime), so a second run skips the scan.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import datasets
from datasets import Features, List, Value

from dataset.atomic_io import atomic_write_lines, atomic_write_text

logger = logging.getLogger(__name__)

Kind = Literal["text", "conversations", "preference"]
SCAN_VERSION = 1  # bump when validation or normalization rules change

MESSAGES = List({"role": Value("string"), "content": Value("string")})
FEATURES: dict[str, Features] = {
    "text": Features({"text": Value("string")}),
    "conversations": Features({"conversations": MESSAGES}),
    "preference": Features({"chosen": MESSAGES, "rejected": MESSAGES}),
}


class BadLine(ValueError):
    """A line that does not hold a valid record; the message says why (without file and line)."""


@dataclass(frozen=True)
class JsonlScan:
    """Result of validating a jsonl file. ``load_path`` is the file to give ``load_dataset``: the original,
    or a normalized copy when some line needed changes or was skipped."""

    load_path: str
    records: int
    skipped_lines: int


def _check_text(obj: object) -> tuple[dict, bool]:
    if not isinstance(obj, dict):
        raise BadLine(f"expected a JSON object, got {type(obj).__name__}")
    if "text" not in obj:
        raise BadLine('missing "text" field')
    if not isinstance(obj["text"], str):
        raise BadLine(f'"text" must be a string, got {type(obj["text"]).__name__}')
    return {"text": obj["text"]}, len(obj) == 1


def _check_messages(obj: dict, name: str) -> tuple[list[dict], bool]:
    """The messages of field `name` of a record, normalized, and whether they were already plain."""
    if name not in obj:
        raise BadLine(f'missing "{name}" field')
    turns = obj[name]
    if not isinstance(turns, list) or not turns:
        raise BadLine(f'"{name}" must be a non-empty list of messages')
    plain = True
    messages = []
    for i, message in enumerate(turns):
        if not isinstance(message, dict):
            raise BadLine(f"{name}[{i}] is not an object")
        role, content = message.get("role"), message.get("content", 0)
        if not isinstance(role, str) or not role:
            raise BadLine(f'{name}[{i}] has no "role" string')
        # MiniMind tool-call turns carry "content": null; that is an empty message, not an error.
        if content is not None and not isinstance(content, str):
            raise BadLine(f'{name}[{i}] has no "content" string')
        plain = plain and content is not None and len(message) == 2
        messages.append({"role": role, "content": content or ""})
    return messages, plain


def _check_conversations(obj: object) -> tuple[dict, bool]:
    if not isinstance(obj, dict):
        raise BadLine(f"expected a JSON object, got {type(obj).__name__}")
    messages, plain = _check_messages(obj, "conversations")
    return {"conversations": messages}, plain and len(obj) == 1


def _check_preference(obj: object) -> tuple[dict, bool]:
    """A preference pair (MiniMind's DPO format): "chosen" and "rejected" conversations with the same prompt (every
    message before the last) and a different last message, an assistant answer in both."""
    if not isinstance(obj, dict):
        raise BadLine(f"expected a JSON object, got {type(obj).__name__}")
    chosen, chosen_plain = _check_messages(obj, "chosen")
    rejected, rejected_plain = _check_messages(obj, "rejected")
    for name, messages in (("chosen", chosen), ("rejected", rejected)):
        if messages[-1]["role"] != "assistant":
            raise BadLine(f'{name}[{len(messages) - 1}] must be the assistant\'s answer, got role '
                          f'{messages[-1]["role"]!r}')
    if chosen[:-1] != rejected[:-1]:
        differ = next((i for i, (a, b) in enumerate(zip(chosen[:-1], rejected[:-1])) if a != b),
                      min(len(chosen), len(rejected)) - 1)
        raise BadLine(f'"chosen" and "rejected" must share their prompt (every message before the last answer); '
                      f'they differ at message {differ}')
    return {"chosen": chosen, "rejected": rejected}, chosen_plain and rejected_plain and len(obj) == 2


CHECKS = {"text": _check_text, "conversations": _check_conversations, "preference": _check_preference}




def iter_records(path: str | Path, kind: Kind, skip_bad_lines: bool = False) -> Iterator[tuple[int, dict | None, bool]]:
    """Yield ``(line_number, normalized_record, is_plain)`` per non-blank line; a bad line raises
    ``ValueError("<path>:<line>: <reason>")``, or with ``skip_bad_lines`` yields ``(line, None, False)``."""
    check = CHECKS[kind]
    with open(path, "rb") as f:
        for line_number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue  # blank lines (a trailing newline, say) are not records
            try:
                try:
                    obj = json.loads(raw.decode("utf-8"))
                except UnicodeDecodeError as e:
                    raise BadLine(f"not valid UTF-8 ({e.reason} at byte {e.start})") from None
                except json.JSONDecodeError as e:
                    raise BadLine(f"invalid JSON ({e.msg.removesuffix(' at')} at column {e.colno})") from None
                record, plain = check(obj)
            except BadLine as e:
                if not skip_bad_lines:
                    raise ValueError(f"{path}:{line_number}: {e}") from None
                logger.warning("%s:%d: %s (skipped)", path, line_number, e)
                yield line_number, None, False
                continue
            yield line_number, record, plain


def _fingerprint(path: Path, kind: Kind, skip_bad_lines: bool) -> str:
    stat = path.stat()
    key = f"{SCAN_VERSION}|{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{kind}|{skip_bad_lines}"
    return hashlib.sha256(key.encode()).hexdigest()[:24]


def scan_jsonl(path: str | Path, kind: Kind, skip_bad_lines: bool = False,
               cache_dir: str | Path | None = None) -> JsonlScan:
    """Validate ``path`` line by line (cached) and decide which file to load; see the module docstring.

    Raises ``ValueError`` naming the file and line for a bad line (unless skipped), and naming the file when
    it holds no records at all.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such data file: {path}")
    cache = Path(cache_dir or datasets.config.HF_DATASETS_CACHE) / "mininorm_jsonl"
    cache.mkdir(parents=True, exist_ok=True)
    fingerprint = _fingerprint(path, kind, skip_bad_lines)
    report_path = cache / f"{fingerprint}.json"
    try:
        scan = JsonlScan(**json.loads(report_path.read_text(encoding="utf-8")))
        if Path(scan.load_path).is_file():
            return scan
    except (OSError, ValueError, TypeError):
        pass

    records = skipped = 0
    all_plain = True
    for _, record, plain in iter_records(path, kind, skip_bad_lines):
        if record is None:
            skipped += 1
        else:
            records += 1
        all_plain = all_plain and plain
    if records == 0:
        detail = f" ({skipped} bad lines skipped)" if skipped else ""
        raise ValueError(f"{path}: no {kind} records in the file{detail}; refusing to train on nothing")
    if skipped:
        logger.warning("%s: skipped %d bad line(s), loading the %d good one(s)", path, skipped, records)

    load_path = path
    if not all_plain:
        # Second pass only for files that need it; plain files (the usual case) are never copied.
        load_path = cache / f"{fingerprint}.jsonl"
        atomic_write_lines(
            load_path,
            (json.dumps(record, ensure_ascii=False) + "\n"
             for _, record, _ in iter_records(path, kind, skip_bad_lines) if record is not None),
        )
    scan = JsonlScan(load_path=str(load_path.resolve()), records=records, skipped_lines=skipped)
    atomic_write_text(report_path, json.dumps(asdict(scan)))
    return scan


def load_jsonl(
    path: str | Path, kind: Kind, skip_bad_lines: bool = False, cache_dir: str | Path | None = None
) -> tuple[datasets.Dataset, JsonlScan]:
    """Validated, Arrow-backed (memory-mapped, cached) dataset with the single column ``kind``."""
    scan = scan_jsonl(path, kind, skip_bad_lines, cache_dir)
    dataset = datasets.load_dataset(
        "json",
        data_files=scan.load_path,
        split="train",
        features=FEATURES[kind],
        cache_dir=str(cache_dir) if cache_dir is not None else None,
    )
    return dataset, scan
