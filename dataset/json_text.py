"""The one strict reader of JSON the project reads from text: a call's arguments, MiniMind's ``tool_calls`` and
``tools`` strings, the JSON a model writes between <tool_call> and </tool_call>, each line of a jsonl file, and the
server's request bodies.

It reads what Python's ``json`` reads, less what is not JSON (RFC 8259: ``NaN`` and ``Infinity``, which Python
writes and reads by default, and a number beyond a 64-bit float, which Python reads as an infinity), less what
I-JSON (RFC 7493) forbids because readers disagree on it -- a key given twice (Python keeps the last value, others
the first or refuse), a lone surrogate (``"\\ud800"``, valid JSON but not text: the tokenizer cannot encode it) --
and less what would make the answer depend on the process: nesting deeper than ``MAX_DEPTH`` (Python's ``json``
recurses and stops near the recursion limit, which a caller may have raised) and an integer longer than
``MAX_INT_DIGITS`` (Python's conversion limit is a process setting). Bytes are read as UTF-8, the one encoding of
JSON exchanged between systems (RFC 8259). Each refusal is a ``JsonTextError`` with a one-line reason;
``read_json_field`` words it after the field's name, the form the chat format, the tools and the server answer with.

It also owns how the project writes JSON: ``strict_json`` is the text of every JSON file it writes (a run's summary,
metrics, checkpoint state, a sweep's state and results, the studies' and evaluations' reports), strict JSON that
jq and JavaScript's ``JSON.parse`` read too: a float that is not finite (a diverged run's loss, the step time of a
run that timed no step) is written as null, not as Python's ``NaN`` or ``Infinity``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dataset.atomic_io import not_utf8
from dataset.shown_value import shown_json, shown_text

# Deeper values are refused: a fixed bound gives one answer whatever the recursion limit, and leaves the recursive
# writers (json.dumps of a call's arguments) far from it.
MAX_DEPTH = 100
MAX_INT_DIGITS = 4300  # Python's default conversion limit, fixed here so that raising it changes nothing
# A \u escape of a surrogate: only a text holding one (or a raw surrogate) can give a lone surrogate.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abcdefABCDEF]")
_VERB = re.compile(r"(?:is|has an?|holds an?) ")  # what a problem starts with, and its reason does not


class JsonTextError(ValueError):
    """Why a text is not JSON the project reads, written once as `problem`: what follows the name of the field that
    holds the value (``has a duplicate key "a"``), at `where` inside it (``["a"][0]``). ``about(field)`` is that
    sentence. ``str()`` is for a caller that names the place itself (``data.jsonl:3: duplicate key "a"``): the
    problem without its verb (``duplicate key "a"``, ``invalid JSON (...)``), or, when it lies inside the value,
    the sentence from there (``["a"][0] holds a lone surrogate ...``)."""

    def __init__(self, problem: str, keys: tuple[str | int, ...] = ()) -> None:
        # keys: the object keys and array indices down to the value, for a caller that names the place its own way
        # (the server's error "param": messages[0].content)
        self.problem, self.keys, self.where = problem, keys, _path(keys)
        if keys:
            reason = self.about("")
        elif problem.startswith("is not valid JSON"):  # "invalid JSON (...)": what a bad jsonl line is known by
            reason = "in" + problem.removeprefix("is not ")
        else:
            verb = _VERB.match(problem)
            reason = problem[verb.end():] if verb else problem
        super().__init__(reason)

    def about(self, field: str) -> str:
        """The one-line error for `field`: ``messages[1].tool_calls[0].arguments has a duplicate key "x"``."""
        return f"{field}{self.where} {self.problem}"


def _invalid(detail: str) -> JsonTextError:
    return JsonTextError(f"is not valid JSON ({detail})")


def _too_deep() -> JsonTextError:
    return JsonTextError(f"is nested too deeply (more than {MAX_DEPTH} levels of arrays and objects)")


def _object(pairs: list[tuple[str, Any]]) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        duplicate = next(key for key, _ in pairs if key in seen or seen.add(key))
        raise JsonTextError(f"has a duplicate key {shown_json(duplicate)}")
    return obj


def _integer(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise _invalid(f"an integer of more than {MAX_INT_DIGITS} digits")
    return int(text)


class _NotAJsonNumber(JsonTextError):
    """NaN, an infinity or a number past a 64-bit float: json's hooks meet it without its place (see _placed)."""


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NotAJsonNumber(f"is not valid JSON ({shown_text(text)} is beyond the range of a 64-bit float)")
    return value


def _no_constant(name: str) -> float:
    raise _NotAJsonNumber(f"is not valid JSON ({name} is not a JSON number)")


class _Unread:
    """Where _placed's reading found a value that is not a JSON number."""


class _Pairs(list):
    """An object as _placed reads it: its (key, value) pairs, a key given twice kept twice."""


def _placed(text: str, error: _NotAJsonNumber) -> JsonTextError:
    """`error` at the place of the first value of `text` that is not a JSON number (``["temperature"]``): `text`
    is read again with a marker in each such value's place and walked in document order. `error` as it is where
    that reading fails otherwise (text past that value that is no JSON at all)."""
    try:
        value = json.loads(text, object_pairs_hook=_Pairs, parse_int=_integer,
                           parse_float=lambda number: _Unread if not math.isfinite(float(number)) else 0.0,
                           parse_constant=lambda name: _Unread)
    except (ValueError, RecursionError):
        return error
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(value, ())]
    while stack:
        node, keys = stack.pop()
        if node is _Unread:
            return JsonTextError(error.problem, keys)
        children = node if isinstance(node, _Pairs) else enumerate(node) if isinstance(node, list) else ()
        stack.extend((child, (*keys, key)) for key, child in reversed(list(children)))
    return error


def _path(keys: tuple[str | int, ...]) -> str:
    """``["a"][0]``: where a value sits inside the field."""
    return "".join(f"[{json.dumps(key, ensure_ascii=False)}]" if isinstance(key, str) else f"[{key}]"
                   for key in keys)


def surrogate_at(text: str) -> int | None:
    """The index of the first lone surrogate in `text`, or None when it is all text (an ASCII string at no cost)."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return error.start
    return None


def lone_surrogate(text: str, index: int) -> str:
    """The words for a lone surrogate at `index` of `text`."""
    return f"holds a lone surrogate (U+{ord(text[index]):04X} at character {index}), which is not text"


def _walk(value: Any, depth_limit: bool, surrogates: bool) -> None:
    """Raise JsonTextError for a value deeper than MAX_DEPTH or holding a lone surrogate; without recursion."""
    stack: list[tuple[Any, int, tuple[str | int, ...]]] = [(value, 1, ())]
    while stack:
        node, depth, keys = stack.pop()
        if isinstance(node, str):
            if surrogates and (index := surrogate_at(node)) is not None:
                raise JsonTextError(lone_surrogate(node, index), keys)
            continue
        if not isinstance(node, (dict, list)):
            continue
        if depth_limit and depth > MAX_DEPTH:
            raise _too_deep()
        if isinstance(node, dict):
            for key, child in node.items():
                if surrogates and isinstance(key, str) and (index := surrogate_at(key)) is not None:
                    raise JsonTextError(lone_surrogate(key, index).replace(", which", " in a key, which"), keys)
                stack.append((child, depth + 1, (*keys, key)))
        else:
            stack.extend((child, depth + 1, (*keys, index)) for index, child in enumerate(node))


def read_json(text: str | bytes, surrogates: bool = True) -> Any:
    """The JSON value of `text` (bytes: UTF-8), as Python's ``json`` reads it, or a JsonTextError (see the module's
    docstring). ``surrogates=False`` leaves lone surrogates to the caller (the jsonl loader checks only the strings
    it keeps, naming each)."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as error:
            raise JsonTextError(f"is {not_utf8(error)}") from None
    try:
        value = json.loads(text, object_pairs_hook=_object, parse_int=_integer, parse_float=_finite_float,
                           parse_constant=_no_constant)
    except _NotAJsonNumber as error:
        raise _placed(text, error) from None
    except JsonTextError:
        raise
    except json.JSONDecodeError as error:
        where = f"line {error.lineno} column {error.colno}" if error.lineno > 1 else f"column {error.colno}"
        raise _invalid(f"{error.msg.removesuffix(' at')} at {where}") from None
    except RecursionError:
        raise _too_deep() from None
    # Walk only a text that could hold what the walk looks for: most hold neither many brackets nor a surrogate.
    deep = text.count("[") + text.count("{") > MAX_DEPTH
    surrogates = surrogates and (_SURROGATE_ESCAPE.search(text) is not None or surrogate_at(text) is not None)
    if deep or surrogates:
        _walk(value, deep, surrogates)
    return value


def read_json_field(text: str | bytes, field: str) -> Any:
    """read_json for a field's text; the ValueError names the field: ``args is not valid JSON (...)``."""
    try:
        return read_json(text)
    except JsonTextError as error:
        raise ValueError(error.about(field)) from None


def check_json_value(value: Any, field: str) -> None:
    """The same rules for a value given as itself (an object in a request, not its text): a ValueError naming the
    field when it nests deeper than MAX_DEPTH or holds a lone surrogate."""
    try:
        _walk(value, True, True)
    except JsonTextError as error:
        raise ValueError(error.about(field)) from None


def check_text(text: str, field: str) -> str:
    """`text`, or a ValueError naming the field when it holds a lone surrogate (it cannot be encoded)."""
    index = surrogate_at(text)
    if index is not None:
        raise ValueError(f"{field} {lone_surrogate(text, index)}")
    return text


def finite_or_null(value: Any) -> Any:
    """`value` with every float that is not finite (NaN, an infinity; numpy's float64 too) put as None, inside
    mappings, lists and tuples (a tuple becomes a list, as JSON writes it); other values are kept as they are."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite_or_null(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(item) for item in value]
    return value


def strict_json(value: Any, default: Callable[[Any], Any] | None = None, **dumps_args: Any) -> str:
    """The JSON text of `value` as every JSON file of the project holds it (see the module's docstring): Python's
    ``json.dumps`` with its other arguments (indent, ensure_ascii, sort_keys), after ``finite_or_null``, with
    ``allow_nan=False``. What `default` gives for a value JSON has no type for is held to the same rule."""
    if default is not None:
        given = default

        def default(item: Any) -> Any:
            return finite_or_null(given(item))
    return json.dumps(finite_or_null(value), allow_nan=False, default=default, **dumps_args)


def json_file_value(file: Path) -> Any:
    """The JSON value `file` holds, read leniently, for a check that names what is wrong with a file of the right
    kind: None where it is missing, unreadable or not JSON (the reader that comes next names that in its own words),
    or holds null."""
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    # ValueError: JSONDecodeError, not UTF-8, an integer past Python's 4300 digits; RecursionError: nested too deep
    except (OSError, ValueError, RecursionError):
        return None
