"""Property-based tests of the three jsonl loaders (issue 34): files of generated lines of every JSON shape either
load with exactly the content Python's ``json`` reads from the good lines, or stop with one ``FILE:LINE: reason``
at the first bad line (and skip_bad_lines skips exactly the bad lines). A UTF-8 byte order mark before the file's
first line changes nothing (Python's json reading bytes skips it); one starting any later line makes it bad.

Each generated line carries its expected outcome by construction (a well-formed record, dressed up; a line made
bad on purpose; a blank line), so the oracle never re-implements the loader's check. Bounded for CI; a longer run:
``MININORM_FUZZ_EXAMPLES=2000 python -m pytest tests/integration/test_jsonl_fuzz.py`` (docs/data.md).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dataset.chat_format import encode_chatml_batch
from dataset.dpo_dataset import DPODataset
from dataset.pretrain_dataset import PretrainDataset
from dataset.sft_dataset import SFTDataset

EXAMPLES = int(os.environ.get("MININORM_FUZZ_EXAMPLES", "100"))  # per loader
FIELDS = {"text": ("text",), "conversations": ("conversations",), "preference": ("chosen", "rejected")}
SURROGATES = ["\ud800", "\udbff", "\udc00", "\udfff"]
NOT_JSON_WHITESPACE = ["\f", "\v", "\x85", "\xa0", "\u2028", "\ufeff"]
JSON_WHITESPACE = ["", " ", "\t", "\r", " \t\r"]
DEEP = "[" * 1000 + "]" * 1000
BOM = "\ufeff"  # the byte order mark: not content at the start of the file, a bad line's start anywhere else

# Text that is text (any character but a surrogate, control characters included) and any string at all.
texts = st.text(st.characters(exclude_categories=("Cs",)), max_size=12)
any_strings = st.text(st.one_of(st.characters(exclude_categories=()), st.sampled_from(SURROGATES)), max_size=8)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | any_strings,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(any_strings, inner, max_size=3),
    max_leaves=8,
)
roles = st.sampled_from(["user", "assistant", "system", "tool"])  # dataset.chat_format.ROLES; another is a bad line
# A good record's roles: a "tool" message answers an assistant's tool call, which these messages never make (a tool
# result with no call before it is a bad line: test_jsonl_hostile.py)
call_free_roles = st.sampled_from(["user", "assistant", "system"])


@dataclass(frozen=True)
class Line:
    raw: bytes
    outcome: str  # "good", "bad" or "blank"
    first: str | None = None  # the outcome as the file's first line, where its leading BOM is the file's own mark


def _encode(line: str) -> tuple[bytes, bool]:
    """The line's bytes, and whether they are UTF-8 (a lone surrogate written raw is not)."""
    try:
        return line.encode("utf-8"), True
    except UnicodeEncodeError:
        return line.encode("utf-8", "surrogatepass"), False


@st.composite
def messages(draw, last_role: str | None = None, min_size: int = 1) -> list[dict]:
    turns = draw(st.lists(st.fixed_dictionaries({"role": call_free_roles, "content": texts | st.none()},
                                                optional={"reasoning_content": texts | st.none()}),
                          min_size=min_size, max_size=3))
    if last_role is not None:
        turns[-1]["role"] = last_role
    for turn in turns:  # only an assistant thinks: a thought elsewhere is a bad line (bad_objects)
        if turn["role"] != "assistant" and turn.get("reasoning_content"):
            turn["reasoning_content"] = ""
    return turns


@st.composite
def answers(draw) -> dict:
    """An assistant message with something in it: content or a thought."""
    turn = draw(messages(last_role="assistant"))[-1]
    if not (turn["content"] or "").strip() and not (turn.get("reasoning_content") or "").strip():
        turn["content"] = draw(texts.filter(str.strip))
    return turn


def _as_loaded(message: dict) -> tuple:
    """A message as the loader compares it: a null content or thought is an empty one."""
    return message["role"], message["content"] or "", message.get("reasoning_content") or ""


@st.composite
def good_records(draw, kind: str) -> dict:
    if kind == "text":
        record = {"text": draw(texts)}
    elif kind == "conversations":  # an assistant message with nothing in it is a bad line, and so is a conversation
        # with none (bad_objects)
        record = {"conversations": draw(messages())}
        if not any(turn["role"] == "assistant" for turn in record["conversations"]):
            record["conversations"].append(draw(answers()))
        for turn in record["conversations"]:
            if turn["role"] == "assistant" and not (turn["content"] or "").strip() \
                    and not (turn.get("reasoning_content") or "").strip():
                turn["content"] = draw(texts.filter(str.strip))
    else:  # a shared prompt, then two different answers, neither empty (the same answer twice is a bad line, and
        # so is an empty one, as in conversations, and a pair with no prompt)
        prompt = draw(messages())
        answer = answers()
        chosen = draw(answer)
        rejected = draw(answer.filter(lambda message: _as_loaded(message) != _as_loaded(chosen)))
        record = {"chosen": prompt + [chosen], "rejected": prompt + [rejected]}
    # "prompt" is no extra field of a pair: TRL's explicit prompt, which comes before both answers
    extras = draw(st.dictionaries(any_strings.filter(lambda key: key not in FIELDS[kind] + ("prompt",)), json_values,
                                  max_size=2))
    return {**extras, **record} if draw(st.booleans()) else {**record, **extras}


def _dump(draw, obj: object) -> str:
    return json.dumps(obj, ensure_ascii=draw(st.booleans()),
                      separators=draw(st.sampled_from([(",", ":"), (", ", ": ")])))


@st.composite
def bad_objects(draw, kind: str) -> object:
    """A JSON value that is not a valid record of `kind`, made so by construction."""
    record = draw(good_records(kind))
    field = draw(st.sampled_from(FIELDS[kind]))
    how = draw(st.sampled_from(["not an object", "missing", "wrong type", "bad message", "surrogate", "bad extra"]
                               + (["answer role", "prompt", "same answer", "no prompt"] if kind == "preference"
                                  else [])
                               + (["empty answer", "no answer"] if kind == "conversations" else [])))
    if how == "not an object":
        return draw(json_values.filter(lambda value: not isinstance(value, dict)))
    if how == "missing":
        del record[field]
    elif how == "wrong type":
        record[field] = draw(json_values.filter(lambda value: not isinstance(value, str if kind == "text" else list)
                                                or value == []))
    elif how == "surrogate" and kind == "text":
        record[field] += draw(st.sampled_from(SURROGATES))
    elif kind == "text":
        record[field] = draw(st.sampled_from([1, None, ["a"], {"text": "a"}]))
    elif how == "surrogate":
        message = draw(st.sampled_from(record[field]))
        key = draw(st.sampled_from(["role", "content"]))
        message[key] = (message[key] or "") + draw(st.sampled_from(SURROGATES))
    elif how == "bad message":
        index = draw(st.integers(0, len(record[field]) - 1))
        record[field][index] = draw(st.sampled_from([
            "text", None, [], {"content": "no role"}, {"role": "", "content": "x"}, {"role": 3, "content": "x"},
            {"role": "user", "content": 5}, {"role": "user", "content": ["x"]}, {"role": "human", "content": "x"}]))
    elif how == "bad extra" and kind != "text":
        message = draw(st.sampled_from(record[field]))
        key = draw(st.sampled_from(["reasoning_content", "tool_calls", "tools"]))
        message[key] = draw(st.sampled_from([3, ["x"]] + ([] if key == "reasoning_content" else
                                                          ["not json", '[{"name": 1}]'])))
    elif how == "empty answer":  # SFT would learn an answer of nothing (MiniMind's rlaif.jsonl gives one)
        index = draw(st.integers(0, len(record[field]) - 1))
        record[field][index] = {"role": "assistant", "content": draw(st.sampled_from(["", None, " ", "\n\t"])),
                                **draw(st.sampled_from([{}, {"reasoning_content": None}, {"reasoning_content": " "}]))}
    elif how == "no answer":  # nothing to learn: a prompt only (RL data)
        for message in record[field]:
            message["role"] = "user" if message["role"] == "assistant" else message["role"]
    elif how == "no prompt":  # the answers alone: a preference for no question
        record["chosen"], record["rejected"] = record["chosen"][-1:], record["rejected"][-1:]
    elif how == "answer role":
        record[field][-1]["role"] = draw(roles.filter(lambda role: role != "assistant"))
    elif how == "same answer":
        record["rejected"][-1] = dict(record["chosen"][-1])
    else:  # the two prompts differ: one more message in one of them
        record[field].insert(0, draw(messages().map(lambda m: m[0])))
    return record


@st.composite
def lines(draw, kind: str) -> Line:
    shape = draw(st.sampled_from(["good", "good", "good", "blank", "bad value", "duplicate", "deep", "truncated",
                                  "odd whitespace", "raw control"]))
    pad = draw(st.sampled_from(JSON_WHITESPACE)), draw(st.sampled_from(JSON_WHITESPACE))
    if shape == "blank":
        return Line(draw(st.sampled_from(JSON_WHITESPACE)).encode(), "blank")
    record = draw(good_records(kind))
    if shape == "good":
        raw, utf8 = _encode(pad[0] + _dump(draw, record) + pad[1])
        return Line(raw, "good" if utf8 else "bad")
    if shape == "bad value":
        text = _dump(draw, draw(bad_objects(kind)))
    elif shape == "duplicate":  # a key repeated with another value, at the top or inside a message
        key = draw(st.sampled_from(sorted(record)))
        text = _dump(draw, record)[:-1] + f', {json.dumps(key)}: {_dump(draw, draw(json_values))}}}'
        if kind != "text" and draw(st.booleans()):
            text = _dump(draw, record).replace('"role"', '"role": "user", "role"', 1)
    elif shape == "deep":
        text = _dump(draw, record)[:-1] + f', "deep": {DEEP}}}'
    elif shape == "truncated":
        whole = _dump(draw, record)
        text = whole[: draw(st.integers(1, len(whole) - 1))]
    elif shape == "odd whitespace":
        odd = draw(st.sampled_from(NOT_JSON_WHITESPACE))
        text = draw(st.sampled_from([odd, odd + _dump(draw, record), _dump(draw, record) + odd]))
        if odd == BOM and not pad[0] and text.startswith(BOM):  # as line 1, the rest is the line: blank or a record
            raw, utf8 = _encode(text + pad[1])
            return Line(raw, "bad", "blank" if text == BOM else "good" if utf8 else "bad")
    else:  # a control character written raw inside a string, which JSON forbids
        text = '{"text": "a' + chr(draw(st.integers(0, 0x1F).filter(lambda c: c != 0x0A))) + 'b"}'
    return Line(_encode(pad[0] + text + pad[1])[0], "bad")


def _expected(kind: str, raw: bytes) -> dict:
    """What Python's json reads from a good line: the kind's fields, a null content as an empty message."""
    obj = json.loads(raw.decode("utf-8-sig"))
    if kind == "text":
        return {"text": obj["text"]}
    return {field: [{"role": m["role"], "content": m["content"] or "", "reasoning_content": m.get("reasoning_content")}
                    for m in obj[field]] for field in FIELDS[kind]}


def _content(kind: str, loaded) -> list:
    if kind == "text":
        return [token for i in range(len(loaded)) for token in loaded[i]["input_ids"].tolist()]
    keys = ["input_ids"] + (["rejected_input_ids"] if kind == "preference" else [])
    return [[loaded[i][key].tolist() for key in keys] for i in range(len(loaded))]


def _expected_content(kind: str, records: list[dict], tokenizer) -> tuple[list, bool]:
    """The rows the loader should give for `records`, and whether there are none (a file-level error)."""
    if kind == "text":
        eos = tokenizer.eos_token_id
        stream = [token for record in records if record["text"].strip()  # an empty document is left out
                  for token in tokenizer(record["text"], add_special_tokens=False)["input_ids"] + [eos]]
        stream = stream[: len(stream) // 2 * 2]  # max_seq_len 2: the odd last token is the dropped tail
        return stream, not stream
    if kind == "conversations":
        kept = [r["conversations"] for r in records]
        return [[encoding.input_ids] for encoding in encode_chatml_batch(tokenizer, kept)], not kept
    chosen = encode_chatml_batch(tokenizer, [r["chosen"] for r in records])
    rejected = encode_chatml_batch(tokenizer, [r["rejected"] for r in records])
    return [[c.input_ids, r.input_ids] for c, r in zip(chosen, rejected)], not records


LOADERS = {"text": (PretrainDataset, 2), "conversations": (SFTDataset, 100_000), "preference": (DPODataset, 100_000)}


def _check_file(kind: str, file_lines: list[Line], final_newline: bool, bom: bool, tokenizer) -> None:
    """Load the file of `file_lines`, `bom`: after a byte order mark (which leaves every line's outcome as it is)."""
    cls, max_seq_len = LOADERS[kind]
    if file_lines[0].first and not bom:  # the line's own leading BOM is then the file's
        file_lines = [Line(file_lines[0].raw, file_lines[0].first)] + file_lines[1:]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "data.jsonl"
        path.write_bytes(BOM.encode() * bom + b"\n".join(line.raw for line in file_lines)
                         + (b"\n" if final_newline else b""))
        bad = [number for number, line in enumerate(file_lines, start=1) if line.outcome == "bad"]
        good = [_expected(kind, line.raw) for line in file_lines if line.outcome == "good"]
        expected, nothing = _expected_content(kind, good, tokenizer)
        for skip in (False, True) if bad else (False,):
            try:
                loaded = cls(path, tokenizer, max_seq_len, skip_bad_lines=skip, cache_dir=Path(tmp) / "cache")
            except ValueError as e:
                message = str(e)
                assert "\n" not in message, message
                if bad and not skip:
                    assert message.startswith(f"{path}:{bad[0]}: "), message
                else:
                    assert nothing and re.match(re.escape(f"{path}: ") + r"\S", message), message
                continue
            assert not (bad and not skip), f"line {bad[0]} loaded: {file_lines[bad[0] - 1].raw!r}"
            assert _content(kind, loaded) == expected
            assert loaded.stats["skipped_lines"] == len(bad if skip else [])


# Derandomized in CI (the same cases each run, so CI does not flake); a longer run with the variable is random.
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, print_blob=True,
                derandomize="MININORM_FUZZ_EXAMPLES" not in os.environ,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])


@pytest.mark.parametrize("kind", list(LOADERS))
def test_loader_reads_what_json_reads_or_names_the_first_bad_line(kind, tokenizer):
    @FUZZ
    @given(file_lines=st.lists(lines(kind), min_size=1, max_size=6), final_newline=st.booleans(), bom=st.booleans())
    def check(file_lines: list[Line], final_newline: bool, bom: bool) -> None:
        _check_file(kind, file_lines, final_newline, bom, tokenizer)

    check()
