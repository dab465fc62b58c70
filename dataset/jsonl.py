"""The one place that reads MiniMind-format jsonl: one parser (Python's ``json``), line by line, into Arrow.

Every line is parsed with Python's ``json`` (through the project's strict reader, dataset/json_text.py) and
checked -- a bad one raises ``ValueError("data.jsonl:17: missing \\"text\\" field")`` unless ``skip_bad_lines`` --
and the checked records (only the needed fields) are written, batch by batch, straight into an Arrow file in the
cache, which the dataset memory-maps. Nothing parses the file a second time: ``datasets.load_dataset("json")``
(pyarrow's JSON reader) once read lines the check had passed differently (a duplicate key stored every text of the
file with its quotes; a lone surrogate or a form-feed line ended in a DatasetGenerationError), and it inferred one
schema from the first 10 MB. A line means what Python's ``json`` reads, except what JSON leaves open or the model
cannot use, which is a bad line: a duplicate key (in any object of the line, or of a tool_calls / tools string), a
lone surrogate in a kept string (a tool_calls or tools string included), nesting deeper than the reader's
MAX_DEPTH (100 levels), an integer longer than its MAX_INT_DIGITS. A blank line (JSON whitespace only: space,
tab, carriage return) is not a record; any other line is one JSON value. A UTF-8 byte order mark at the start of the
file marks its encoding and is not read as content (``numbered_lines``); one starting a later line is a bad line.
A pretraining text of only whitespace is no bad line but nothing to learn: it is left out of the records, counted
and said once (``is_empty_document``).

The Arrow file and the counts are cached by (path, size, mtime), so a second run reads neither the file nor
the counts again, and the ``map`` built on the Arrow file keeps its own cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, fields
from functools import partial
from pathlib import Path
from typing import Literal

import datasets
import pyarrow as pa
from datasets import Features, List, Value

from dataset.atomic_io import atomic_path, atomic_write_text, make_dirs, special_file_kind
from dataset.chat_format import normalize_messages
from dataset.json_text import JsonTextError, check_text, read_json, strict_json

logger = logging.getLogger(__name__)

Kind = Literal["text", "conversations", "preference"]
SCAN_VERSION = 15  # bump when validation or the cached Arrow layout change (6: NaN, Infinity refused; 7: tool
# calls and tools as kept within the depth bound, a tool's description a string; 8: a preference pair's "prompt";
# 9: that prompt not put twice before conversations that begin with it, a "prompt" string beside them taken, a
# null "prompt" none; 10: the file's leading byte order mark read past, so a first line skipped for it is read again;
# 11: a conversation's empty assistant message refused unless empty_answers; 12: a preference pair's empty
# chosen or rejected answer refused; 13: a tool result that answers no call refused; 14: an empty pretraining text
# left out and counted, JsonlScan.empty_documents; 15: a conversation with no assistant message and a pair with no
# prompt refused)
JSON_WHITESPACE = b" \t\r\n"  # RFC 8259's whitespace; a line of only these is blank
# U+FEFF in UTF-8: the byte order mark many Windows editors write at the start of a file
UTF8_BOM = b"\xef\xbb\xbf"
BATCH_RECORDS, BATCH_BYTES = 1000, 32 << 20  # an Arrow record batch holds at most this many records / line bytes

# A message's tool calls and a system message's tools are kept as canonical JSON strings ("" when absent), the form
# dataset.chat_format reads back.
MESSAGES = List({"role": Value("string"), "content": Value("string"), "reasoning_content": Value("string"),
                 "tool_calls": Value("string"), "tools": Value("string")})
FEATURES: dict[str, Features] = {
    "text": Features({"text": Value("string")}),
    "conversations": Features({"conversations": MESSAGES}),
    "preference": Features({"chosen": MESSAGES, "rejected": MESSAGES}),
}


class BadLine(ValueError):
    """A line that does not hold a valid record; the message says why (without file and line)."""


@dataclass(frozen=True)
class JsonlScan:
    """What reading a jsonl file gave: ``arrow_path``, the cached Arrow file of its records (the needed fields
    only), how many ``records`` it holds, how many bad lines were skipped, and how many pretraining texts were left
    out for holding nothing (is_empty_document)."""

    arrow_path: str
    records: int
    skipped_lines: int
    empty_documents: int


def parse_line(raw: bytes, surrogates: bool = False) -> object:
    """The JSON value of one non-blank line, by the project's strict reader (dataset/json_text.py: a duplicate key
    in any object, nesting deeper than its MAX_DEPTH, an integer too long are bad lines); a lone surrogate is
    checked in the kept strings only (``_string``, naming the field) unless ``surrogates`` asks for every string.
    Anything else is a BadLine; so is a line that starts with a byte order mark (``numbered_lines`` has taken the
    file's own away), named as such rather than as Python's advice to decode the file as utf-8-sig."""
    if raw.startswith(UTF8_BOM):
        raise BadLine("a byte order mark (U+FEFF) starts the line, and only the file's first line may begin with "
                      "one: remove it (joining files keeps each one's mark)")
    try:
        return read_json(raw, surrogates=surrogates)
    except JsonTextError as e:
        raise BadLine(str(e)) from None


def numbered_lines(handle: Iterable[bytes]) -> Iterator[tuple[int, bytes]]:
    """(line number from 1, raw bytes) of each line of a jsonl file opened in binary, the first line without a
    leading UTF-8 byte order mark: it marks the file's encoding, not a value (RFC 8259 lets a reader ignore it, and
    Python's json reading bytes and ``datasets`` do), so a file saved by an editor that writes one reads as without."""
    lines = enumerate(handle, start=1)
    while True:
        try:
            number, raw = next(lines)
        except StopIteration:
            return
        except OSError as error:  # a read that fails (an I/O error) was a traceback once the run had started
            raise ValueError(f"{getattr(handle, 'name', 'the file')}: cannot be read "
                             f"({error.strerror or error})") from None
        yield number, raw.removeprefix(UTF8_BOM) if number == 1 else raw


def _string(value: object, where: str) -> str:
    """A kept string, which must be text: a lone surrogate (``"\\ud800"``, valid JSON) cannot be stored or
    tokenized."""
    if not isinstance(value, str):
        raise BadLine(f"{where} must be a string, got {type(value).__name__}")
    try:
        return check_text(value, where)
    except ValueError as e:
        raise BadLine(str(e)) from None


# Each kind's own field, and what a line holding it is: a file of another kind (pretraining text given to SFT or to a
# distillation that reads conversations) was 'missing "conversations" field', which does not say why.
KIND_FIELDS = {"text": "pretraining text", "conversations": "an SFT conversation", "chosen": "a DPO pair",
               "rejected": "a DPO pair"}


def _missing(name: str, obj: dict) -> str:
    """The words for a record without its field `name`, naming the kind of data the record is where another
    kind's field is there."""
    other = next((f for f, kind in KIND_FIELDS.items() if f in obj and kind != KIND_FIELDS.get(name)), None)
    if other is None:
        return f'missing "{name}" field'
    return f'missing "{name}" field; the line holds "{other}": it is {KIND_FIELDS[other]}, data of another kind'


def _check_text(obj: object) -> dict:
    if not isinstance(obj, dict):
        raise BadLine(f"expected a JSON object, got {type(obj).__name__}")
    if "text" not in obj:
        raise BadLine(_missing("text", obj))
    return {"text": _string(obj["text"], '"text"')}


def check_message_shapes(turns: list, name: str) -> None:
    """A BadLine naming the message (`name`[i]) where one of `turns` is not an object with a non-empty "role" string
    and a "content" string or null, before normalize_messages, whose own error does not say which message."""
    for i, message in enumerate(turns):
        if not isinstance(message, dict):
            raise BadLine(f"{name}[{i}] is not an object")
        role, content = message.get("role"), message.get("content", 0)
        if not isinstance(role, str) or not role:
            raise BadLine(f'{name}[{i}] has no "role" string')
        # MiniMind tool-call turns carry "content": null; that is an empty message, not an error.
        if content is not None and not isinstance(content, str):
            raise BadLine(f'{name}[{i}] has no "content" string')


def _check_messages(obj: dict, name: str) -> list[dict]:
    """The messages of field `name` of a record, normalized: role and content, and MiniMind's extra fields
    (reasoning_content, tool_calls, a system message's tools) as dataset.chat_format reads them."""
    if name not in obj:
        raise BadLine(_missing(name, obj))
    turns = obj[name]
    if not isinstance(turns, list) or not turns:
        raise BadLine(f'"{name}" must be a non-empty list of messages')
    check_message_shapes(turns, name)
    try:
        normalized = normalize_messages(turns, name)
    except ValueError as error:
        raise BadLine(str(error)) from None
    messages = []
    for i, message in enumerate(normalized):
        where = f"{name}[{i}]"
        messages.append({
            "role": _string(message["role"], f'{where} "role"'),
            "content": _string(message["content"], f'{where} "content"'),
            "reasoning_content": _string(message.get("reasoning_content", ""), f'{where} "reasoning_content"'),
            "tool_calls": _string(_canonical_json(message.get("tool_calls")), f'{where} "tool_calls"'),
            "tools": _string(_canonical_json(message.get("tools")), f'{where} "tools"'),
        })
    return messages


def _canonical_json(value: list | None) -> str:
    return json.dumps(value, ensure_ascii=False) if value else ""


def check_tool_results(messages: list[dict], name: str, before: dict | None = None) -> None:
    """A BadLine naming the first "tool" message of `messages` (field `name`; `before`: the message put before them,
    if any) that answers no call: the message before it is neither an assistant message with tool_calls nor another
    tool result. Such a result (a converter that dropped the assistant's call turn, whose content is null) renders as
    a user turn holding a <tool_response>, and trains the answers after it on a call that was never made."""
    previous = before
    for index, message in enumerate(messages):
        if message["role"] == "tool" and not (previous and (previous["role"] == "tool" or (
                previous["role"] == "assistant" and previous.get("tool_calls")))):
            raise BadLine(f'{name}[{index}] is a tool result with no tool call before it: a "tool" message follows '
                          f"an assistant message with tool_calls, or another tool result")
        previous = message


def _check_conversations(obj: object, empty_answers: bool = False) -> dict:
    """SFT's conversations; one with no assistant message is refused (nothing to learn: it was dropped without a
    word, or, a file of nothing else, refused as holding nothing "within max_seq_len"; TRL's SFTTrainer refuses an
    example with no assistant tokens too), so is an assistant message with nothing in it unless `empty_answers`
    (check_answers), and a tool result that answers no call (check_tool_results)."""
    if not isinstance(obj, dict):
        raise BadLine(f"expected a JSON object, got {type(obj).__name__}")
    conversations = _check_messages(obj, "conversations")
    if not any(message["role"] == "assistant" for message in conversations):
        raise BadLine('"conversations" holds no assistant message: nothing to learn (only the assistant\'s answers '
                      "are trained on). A conversation of only a prompt is RL data, which train_grpo.py and "
                      "train_ppo.py take")
    check_tool_results(conversations, "conversations")
    if not empty_answers:
        check_answers(conversations, "conversations")
    return {"conversations": conversations}


def _says_nothing(message: dict) -> bool:
    """An assistant message with nothing to learn: no content but whitespace, no tool call, no reasoning (its label
    would be the closing <|im_end|> alone)."""
    return message["role"] == "assistant" and not message["content"].strip() and not message["tool_calls"] \
        and not message["reasoning_content"].strip()


def check_answers(messages: list[dict], name: str) -> None:
    """A BadLine naming the first assistant message of `messages` (field `name`) that holds nothing to learn
    (_says_nothing). Supervised, it teaches the model to answer nothing; such a turn is the open answer of a
    prompt-only row, MiniMind's rlaif.jsonl, which the RL trainers read, as does a distillation whose every step
    samples (empty_answers); the refusal names them all (a distillation with --lmbda below 1 meets it too)."""
    for index, message in enumerate(messages):
        if _says_nothing(message):
            raise BadLine(f"{name}[{index}] is an empty assistant message (no content, tool_calls or "
                          f"reasoning_content): training on it teaches the model to answer nothing. This looks like "
                          f"prompt-only RL data (MiniMind's rlaif.jsonl), which train_grpo.py and train_ppo.py take, "
                          f"and train_distillation.py with --lmbda 1 or --seq_kd (every step samples its answers, "
                          f"reading such a row as its prompt)")


def _pair_prompt(obj: dict, chosen: list[dict], rejected: list[dict]) -> list[dict]:
    """The messages a preference pair's "prompt" puts before both conversations: none without one; none where both
    conversations already hold the whole exchange (UltraFeedback's rows carry the question twice, as a "prompt"
    string and as the conversations' first turns); else the "prompt" list of messages (TRL's explicit prompt before
    answer-only "chosen" and "rejected"). A string before answer-only conversations is refused: it is TRL's plain-text
    form, which names no role. A null "prompt" is none (a dataset of rows with and without one, written by
    `datasets`' to_json, holds null where a row had none)."""
    if obj.get("prompt") is None:
        return []
    whole = len(chosen) > 1 and len(rejected) > 1
    if isinstance(obj["prompt"], str):
        if whole:
            return []
        raise BadLine('"prompt" is a string but "chosen" and "rejected" hold only the answer: give the prompt as a '
                      'list of messages ([{"role": "user", "content": ...}]) or the whole conversation in both')
    prompt = _check_messages(obj, "prompt")
    if whole and chosen[:len(prompt)] == prompt and rejected[:len(prompt)] == prompt:
        return []  # the conversations begin with it already
    return prompt


# Why a pair's empty answer (_says_nothing) is refused, by the side it is on.
EMPTY_PAIR_ANSWER = {
    "chosen": "the pair would teach the model to prefer answering nothing",
    "rejected": "the pair's margin would rest on one token, the closing <|im_end|>, which the loss can push down "
                "alone (the model learns not to stop at once, not the preference); give a rejected answer with text",
}


def _check_preference(obj: object) -> dict:
    """A preference pair (MiniMind's DPO format): "chosen" and "rejected" conversations with the same prompt (every
    message before the last, at least one) and a different last message, an assistant answer in both, with something
    in it (EMPTY_PAIR_ANSWER says why either side's empty answer is refused). TRL's explicit prompt, a "prompt" list
    of messages, is that shared start: it comes before both (ignored as an extra field, it left the pair to train
    with no question)."""
    if not isinstance(obj, dict):
        raise BadLine(f"expected a JSON object, got {type(obj).__name__}")
    chosen = _check_messages(obj, "chosen")
    rejected = _check_messages(obj, "rejected")
    for name, messages in (("chosen", chosen), ("rejected", rejected)):
        if messages[-1]["role"] != "assistant":
            raise BadLine(f'{name}[{len(messages) - 1}] must be the assistant\'s answer, got role '
                          f'{messages[-1]["role"]!r}')
        if _says_nothing(messages[-1]):
            raise BadLine(f"{name}[{len(messages) - 1}] is an empty assistant answer (no content, tool_calls or "
                          f"reasoning_content): {EMPTY_PAIR_ANSWER[name]}")
    prompt = _pair_prompt(obj, chosen, rejected)
    check_tool_results(prompt, "prompt")
    for name, messages in (("chosen", chosen), ("rejected", rejected)):
        check_tool_results(messages, name, prompt[-1] if prompt else None)
    # The refusals name messages as the line gives them (chosen[i]): a "prompt" list put before both is the same
    # in both, so the two differ only in their own messages.
    if chosen[:-1] != rejected[:-1]:
        raise BadLine(f'"chosen" and "rejected" must share their prompt (every message before the last answer); '
                      f'{_where_prompts_part(chosen, rejected)}')
    if not prompt and len(chosen) == 1:  # TRL finds no prompt in such a pair either, and fails on it (IndexError)
        raise BadLine('"chosen" and "rejected" hold only their answers and there is no "prompt": the pair prefers '
                      'one answer to no question; put the prompt\'s messages before the answer in both, or give '
                      'them as a "prompt" list of messages')
    if chosen[-1] == rejected[-1]:  # both log-ratios equal: the loss is log 2 and its gradient zero
        raise BadLine(f'"chosen" and "rejected" have the same answer (chosen[{len(chosen) - 1}] and '
                      f'rejected[{len(rejected) - 1}]): the pair prefers nothing')
    return {"chosen": prompt + chosen, "rejected": prompt + rejected}


def _where_prompts_part(chosen: list[dict], rejected: list[dict]) -> str:
    """The first prompt message in which two conversations differ, or, where one's prompt begins the other's, how
    many prompt messages each holds."""
    for index, (first, second) in enumerate(zip(chosen[:-1], rejected[:-1])):
        if first != second:
            return f"chosen[{index}] and rejected[{index}] differ"
    return f'"chosen" has {len(chosen) - 1} message(s) before its answer, "rejected" {len(rejected) - 1}'


CHECKS = {"text": _check_text, "conversations": _check_conversations, "preference": _check_preference}


def log_skipped_line(path: str | Path, line_number: int, reason: str) -> None:
    """What --skip_bad_lines says of each line it skips (every dataset: the stats count them, this names them)."""
    logger.warning("%s:%d: %s (skipped)", path, line_number, reason)


def check_records_read(path: str | Path, what: str, records: int, skipped: int, empty: int = 0,
                       first_empty: int | None = None) -> None:
    """The end of reading a data file: a ValueError naming it when it gave no `what` record (with the bad lines
    skipped and the `empty` documents left out, the first on line `first_empty`), else a warning of the lines
    skipped and one of the empty documents, if any."""
    if records == 0:
        details = [f"{skipped} bad lines skipped"] * bool(skipped) + [f"{empty} empty documents left out"] * bool(empty)
        detail = f" ({', '.join(details)})" if details else ""
        raise ValueError(f"{path}: no {what} records in the file{detail}; refusing to train on nothing")
    if skipped:
        logger.warning("%s: skipped %d bad line(s), loading the %d good one(s)", path, skipped, records)
    if empty:
        logger.warning("%s: left out %d empty document(s) (a \"text\" of only whitespace, the first on line %d): "
                       "nothing to learn from, and each would train an end of text after nothing", path, empty,
                       first_empty)


def is_empty_document(kind: Kind, record: dict) -> bool:
    """A pretraining text of only whitespace (or none): read, it was a document of one eos token (its whitespace's
    tokens then eos), which teaches the model to end a document that has not begun. Such a line is valid JSON of the
    right shape, so it is left out and counted (JsonlScan.empty_documents), not a bad line."""
    return kind == "text" and not record["text"].strip()


def iter_records(path: str | Path, kind: Kind, skip_bad_lines: bool = False,
                 empty_answers: bool = False) -> Iterator[tuple[int, dict | None, int]]:
    """Yield ``(line_number, record, line_bytes)`` per non-blank line, the record holding only the needed fields;
    a bad line raises ``ValueError("<path>:<line>: <reason>")``, or with ``skip_bad_lines`` yields ``None``.
    ``empty_answers``: a conversation's empty assistant message is read, not refused (a reader that learns none of
    the data's answers)."""
    check = partial(_check_conversations, empty_answers=empty_answers) if kind == "conversations" else CHECKS[kind]
    with open(path, "rb") as f:
        for line_number, raw in numbered_lines(f):
            if not raw.strip(JSON_WHITESPACE):
                continue  # blank lines (a trailing newline, say) are not records
            try:
                record = check(parse_line(raw))
            except BadLine as e:
                if not skip_bad_lines:
                    raise ValueError(f"{path}:{line_number}: {e}") from None
                log_skipped_line(path, line_number, str(e))
                yield line_number, None, len(raw)
                continue
            yield line_number, record, len(raw)


def _fingerprint(path: Path, kind: Kind, skip_bad_lines: bool, empty_answers: bool) -> str:
    stat = path.stat()
    key = f"{SCAN_VERSION}|{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{kind}|{skip_bad_lines}|{empty_answers}"
    return hashlib.sha256(key.encode()).hexdigest()[:24]


def _write_arrow(path: Path, kind: Kind, skip_bad_lines: bool, empty_answers: bool, arrow_path: Path) -> JsonlScan:
    """Stream the checked records of ``path`` into the Arrow file ``arrow_path`` (the stream format ``datasets``
    memory-maps), a bounded batch at a time, so a multi-GB file never sits in memory."""
    schema = FEATURES[kind].arrow_schema
    records = skipped = empty = 0
    first_empty: int | None = None
    batch: list[dict] = []
    batch_bytes = 0
    with atomic_path(arrow_path) as tmp, pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_stream(sink, schema) as out:
        for line_number, record, line_bytes in iter_records(path, kind, skip_bad_lines, empty_answers):
            if record is None:
                skipped += 1
                continue
            if is_empty_document(kind, record):
                empty += 1
                first_empty = first_empty or line_number
                continue
            records += 1
            batch.append(record)
            batch_bytes += line_bytes
            if len(batch) >= BATCH_RECORDS or batch_bytes >= BATCH_BYTES:
                out.write_batch(pa.RecordBatch.from_pylist(batch, schema=schema))
                batch, batch_bytes = [], 0
        if batch:
            out.write_batch(pa.RecordBatch.from_pylist(batch, schema=schema))
        check_records_read(path, kind, records, skipped, empty, first_empty)  # raising leaves no Arrow file behind
    return JsonlScan(arrow_path=str(arrow_path.resolve()), records=records, skipped_lines=skipped,
                     empty_documents=empty)


# The first bytes of the files a jsonl path is most often given instead (a download left compressed, a Hub dataset's
# Parquet or Arrow files, a datasets cache file): what each is, and how to make jsonl of it ({file}: the path).
_DECOMPRESS = "decompress it first ({} {{file}})"
_TO_JSON = "write it as jsonl first (datasets' Dataset.{}.to_json(OUT) writes one object per line)"
FILE_FORMATS: dict[bytes, tuple[str, str]] = {
    b"\x1f\x8b": ("gzip-compressed", _DECOMPRESS.format("gunzip -k")),
    b"\x28\xb5\x2f\xfd": ("zstd-compressed", _DECOMPRESS.format("zstd -d")),
    b"BZh": ("bzip2-compressed", _DECOMPRESS.format("bunzip2 -k")),
    b"\xfd7zXZ\x00": ("xz-compressed", _DECOMPRESS.format("unxz -k")),
    b"PK\x03\x04": ("a zip archive", "extract its jsonl file first (unzip {file})"),
    b"PAR1": ("a Parquet file", _TO_JSON.format("from_parquet('{file}')")),
    b"ARROW1": ("an Arrow file", "write it as jsonl first (datasets' Dataset(pyarrow.feather.read_table('{file}'))"
                                 ".to_json(OUT) writes one object per line)"),
    b"\xff\xff\xff\xff": ("an Arrow stream (a datasets cache file)", _TO_JSON.format("from_file('{file}')")),
}
MAGIC_BYTES = max(map(len, FILE_FORMATS))


def check_data_file(path: Path) -> None:
    """Refuse, in one line, a data path that is not a regular file (missing, a folder, a FIFO, a device: the scan
    cache is keyed by a file's size and time) or that cannot be opened."""
    if path.is_dir():
        raise FileNotFoundError(f"{path} is a folder, not a jsonl data file")
    # a FIFO (a shell's <(zcat ...)) or a device: "no such data file" sent one looking for a file that is there
    if (what := special_file_kind(path)) is not None:
        raise FileNotFoundError(f"{path} is {what}, not a regular file: a jsonl data file must be a regular file "
                                f"(write the data to one first)")
    if not path.is_file():
        raise FileNotFoundError(f"no such data file: {path}")
    try:  # a file another user keeps to themselves: refused here, not as a PermissionError traceback later
        with open(path, "rb") as handle:
            head = handle.read(MAGIC_BYTES)
    except OSError as error:
        raise ValueError(f"{path}: cannot be read ({error.strerror or error})") from None
    # A compressed or columnar file was "path:1: not valid UTF-8 (byte 0x8b at offset 1)", which does not say why.
    for magic, (what, fix) in FILE_FORMATS.items():
        if head.startswith(magic):
            raise ValueError(f"{path}: is {what}, not jsonl text (one JSON object per line); "
                             f"{fix.format(file=path)}")


def scan_jsonl(path: str | Path, kind: Kind, skip_bad_lines: bool = False,
               cache_dir: str | Path | None = None, empty_answers: bool = False) -> JsonlScan:
    """Check ``path`` line by line and write its records into a cached Arrow file; see the module docstring
    (``empty_answers``: iter_records').

    Raises ``ValueError`` naming the file and line for a bad line (unless skipped), and naming the file when
    it holds no records at all.
    """
    path = Path(path)
    check_data_file(path)
    cache = make_dirs(Path(cache_dir or datasets.config.HF_DATASETS_CACHE) / "mininorm_jsonl")
    fingerprint = _fingerprint(path, kind, skip_bad_lines, empty_answers)
    report_path, arrow_path = cache / f"{fingerprint}.json", cache / f"{fingerprint}.arrow"
    cached = _cached_scan(report_path, arrow_path)
    if cached is not None:
        return cached
    scan = _write_arrow(path, kind, skip_bad_lines, empty_answers, arrow_path)
    atomic_write_text(report_path, strict_json(asdict(scan)))
    return scan


def _cached_scan(report_path: Path, arrow_path: Path) -> JsonlScan | None:
    """The cached scan, or None when the cache cannot be trusted and is rebuilt: a report that is missing, not a
    report, or names another Arrow file (whose records would be another file's), or an Arrow file that does not
    hold exactly the report's records (cut short, or damaged)."""
    try:
        report = read_json(report_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    # The counts must be ints (3.0 and True would pass the row count's ==); the row count below bounds the
    # records, so only skipped_lines and empty_documents, which no row count checks, need their sign checked here.
    if not isinstance(report, dict) or set(report) != {f.name for f in fields(JsonlScan)} \
            or report["arrow_path"] != str(arrow_path.resolve()) \
            or any(type(report[name]) is not int for name in ("records", "skipped_lines", "empty_documents")) \
            or report["skipped_lines"] < 0 or report["empty_documents"] < 0:
        return None
    try:
        with pa.memory_map(str(arrow_path)) as source, pa.ipc.open_stream(source) as reader:
            rows = sum(batch.num_rows for batch in reader)
    except (OSError, pa.ArrowException):
        return None
    return JsonlScan(**report) if rows == report["records"] else None


def load_jsonl(
    path: str | Path, kind: Kind, skip_bad_lines: bool = False, cache_dir: str | Path | None = None,
    empty_answers: bool = False,
) -> tuple[datasets.Dataset, JsonlScan]:
    """Checked, Arrow-backed (memory-mapped, cached) dataset of ``kind`` records: the columns of ``FEATURES[kind]``
    (``empty_answers``: iter_records')."""
    scan = scan_jsonl(path, kind, skip_bad_lines, cache_dir, empty_answers)
    return datasets.Dataset.from_file(scan.arrow_path), scan
