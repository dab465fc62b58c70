"""The one strict reader of JSON held in a text field or a body (dataset/json_text.py): what Python's json reads,
less what is not JSON -- NaN, Infinity, a number beyond a 64-bit float --, less what I-JSON (RFC 7493) forbids -- a
duplicate key, a lone surrogate -- and less what would make its caller crash or depend on the process -- nesting
past a fixed depth, an integer past a fixed length; bytes read as UTF-8; each refusal a one-line reason, and
nothing recursive for the depth to exhaust."""

from __future__ import annotations

import json
import sys

import pytest

from dataset.json_text import MAX_DEPTH, MAX_INT_DIGITS, JsonTextError, check_json_value, read_json, read_json_field


@pytest.mark.parametrize("text", ['{"a": [1, 2.5, "x", null, true]}', "[]", '"\\ud83d\\ude00"', " 7 ",
                                  "[" * MAX_DEPTH + "]" * MAX_DEPTH, "1" * MAX_INT_DIGITS, '{"a": {"a": 1}}'])
def test_what_json_reads_and_the_rules_allow_reads_as_json_does(text):
    assert read_json(text) == json.loads(text)


@pytest.mark.parametrize("text, reason", [
    ("{oops", "invalid JSON (Expecting property name enclosed in double quotes at column 2)"),
    ('{"a": 1}\n{"b"', "invalid JSON (Extra data at line 2 column 1)"),
    ("", "invalid JSON (Expecting value at column 1)"),
    ("1" * (MAX_INT_DIGITS + 1), f"invalid JSON (an integer of more than {MAX_INT_DIGITS} digits)"),
    ("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), f"nested too deeply (more than {MAX_DEPTH} levels"),
    ("[" * 100_000, f"nested too deeply (more than {MAX_DEPTH} levels"),
    ('{"a": 1, "b": {"c": 2, "c": 3}}', 'duplicate key "c"'),
    ('{"a": ["\\ud800"]}', '["a"][0] holds a lone surrogate (U+D800 at character 0), which is not text'),
    ('{"x\\udfff": 1}', "lone surrogate (U+DFFF at character 1) in a key"),
    ('{"a": {"x\\udfff": 1}}', '["a"] holds a lone surrogate (U+DFFF at character 1) in a key'),
    # named by where they lie (json's hooks meet them without their place): it was "invalid JSON (NaN ...)" alone
    ("[NaN]", "[0] is not valid JSON (NaN is not a JSON number)"),
    ('{"a": Infinity}', '["a"] is not valid JSON (Infinity is not a JSON number)'),
    ("-Infinity", "invalid JSON (-Infinity is not a JSON number)"),
    ('{"a": 1e400}', '["a"] is not valid JSON (1e400 is beyond the range of a 64-bit float)'),
    ("[-2e308]", "[0] is not valid JSON (-2e308 is beyond the range of a 64-bit float)"),
    ('{"a": [1, {"b": 2}], "c": {"d": [3, NaN, Infinity]}}', '["c"]["d"][1] is not valid JSON (NaN is not'),
    # the first in the text, a key given twice kept apart; text past it that is not JSON leaves it unplaced
    ('{"a": 1, "a": NaN, "b": 1e400}', '["a"] is not valid JSON (NaN is not'),
    ('{"a": NaN, "b": }', "invalid JSON (NaN is not a JSON number)"),
    # cut as every quote is (dataset/shown_value.py: 57 characters, then "..."): it was echoed whole
    ("1" * 10_000 + ".0", f"invalid JSON ({'1' * 57}... is beyond the range of a 64-bit float)"),
    (b'{"a": "\xff"}', "not valid UTF-8 (byte 0xff at offset 7)"),
    ('{"a": 1}'.encode("utf-16"), "not valid UTF-8 (byte 0xff at offset 0)"),
    ('"\\ude00\\ud83d"', "lone surrogate (U+DE00 at character 0)"),
])
def test_each_refusal_is_one_line(text, reason):
    with pytest.raises(JsonTextError) as caught:
        read_json(text)
    assert str(caught.value).startswith(reason) and "\n" not in str(caught.value)


@pytest.mark.parametrize("text", [b'{"a": ["\xc3\xa9", 1.5e308, -0.0, 1e-400]}', '{"a": ["\u00e9", 1.5e308, -0.0]}'])
def test_bytes_are_read_as_utf8_and_floats_within_float64_as_floats(text):
    assert read_json(text) == json.loads(text)


def test_the_depth_bound_does_not_depend_on_the_recursion_limit():
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(100_000)
    try:
        with pytest.raises(JsonTextError, match="nested too deeply"):
            read_json("[" * 5000 + "]" * 5000)
    finally:
        sys.setrecursionlimit(limit)


def test_a_field_message_names_the_field():
    with pytest.raises(ValueError, match=r"^messages\[1\].tool_calls is not valid JSON \(Expecting value"):
        read_json_field("nope", "messages[1].tool_calls")
    with pytest.raises(ValueError, match=r'^args\["a"\]\[1\] holds a lone surrogate \(U\+D800 at character 2\)'):
        read_json_field('{"a": [0, "xy\\ud800"]}', "args")
    with pytest.raises(ValueError, match=r"^args is nested too deeply"):
        read_json_field("[" * 5000, "args")
    with pytest.raises(ValueError, match=r'^args has a duplicate key "a"'):
        read_json_field('{"a": 1, "a": 1}', "args")
    with pytest.raises(ValueError, match=r'^args\["a"\] is not valid JSON \(NaN is not a JSON number\)$'):
        read_json_field('{"a": NaN}', "args")
    with pytest.raises(ValueError, match=r"^body is not valid UTF-8 \(byte 0xff at offset 0\)$"):
        read_json_field(b"\xff{}", "body")


def test_a_long_duplicate_key_is_quoted_cut_to_one_short_line():
    key = "k" * 100_000  # a server's client can send it: the error quotes it cut, as every refusal quotes a value
    with pytest.raises(ValueError) as refused:
        read_json_field('{"%s": 1, "%s": 2}' % (key, key), "body")
    assert str(refused.value).startswith('body has a duplicate key "kkk') and len(str(refused.value)) < 120


def test_a_value_given_as_itself_follows_the_same_rules():
    check_json_value({"a": [1, "ok", {"b": None}]}, "v")
    deep: list = []
    for _ in range(MAX_DEPTH):
        deep = [deep]
    with pytest.raises(ValueError, match=r"^v is nested too deeply"):
        check_json_value(deep, "v")
    with pytest.raises(ValueError, match=r'^v\["a"\]\[0\] holds a lone surrogate'):
        check_json_value({"a": ["\ud800"]}, "v")


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def test_strict_json_writes_what_is_not_finite_as_null_and_the_rest_as_json_does():
    """What every JSON file of the project holds (a run's summary, its metrics, a sweep's state): JSON a strict
    reader (jq, JavaScript's JSON.parse) reads, NaN and the infinities as null, inside mappings and lists too."""
    import numpy as np

    from dataset.json_text import strict_json

    nan, inf = float("nan"), float("inf")
    value = {"loss": nan, "steps": 3, "final_val": {"loss": 2.5, "ppl": inf}, "curve": [1.0, -inf, (2, nan)],
             "numpy": np.float64("nan"), "ok": True, "name": "x", "none": None}
    text = strict_json(value, indent=1)
    read = json.loads(text, parse_constant=_refuse_constant)
    assert read == {"loss": None, "steps": 3, "final_val": {"loss": 2.5, "ppl": None},
                    "curve": [1.0, None, [2, None]], "numpy": None, "ok": True, "name": "x", "none": None}
    assert read_json(text) == read  # the project's own strict reader takes it
    # json.dumps's arguments pass through; what `default` gives for an unknown type follows the same rule
    assert strict_json({"a": 1.5}, indent=None) == json.dumps({"a": 1.5})
    assert strict_json({"b": np.float32("nan"), "c": np.float32(0.5)}, default=float) == '{"b": null, "c": 0.5}'
    assert strict_json({"p": sys}, default=str) == json.dumps({"p": str(sys)})
