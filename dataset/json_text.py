"""The one strict reader of JSON the project reads from text: a call's arguments, MiniMind's ``tool_calls`` and
``tools`` strings, the JSON a model writes between <tool_call> and </tool_call>, and each line of a jsonl file.

It reads what Python's ``json`` reads, less what I-JSON (RFC 7493) forbids because readers disagree on it -- a key
given twice (Python keeps the last value, others the first or refuse), a lone surrogate (``"\\ud800"``, valid JSON
but not text: the tokenizer cannot encode it) -- and less what would make the answer depend on the process: nesting
deeper than ``MAX_DEPTH`` (Python's ``json`` recurses and stops near the recursion limit, which a caller may have
raised) and an integer longer than ``MAX_INT_DIGITS`` (Python's conversion limit is a process setting). Each refusal
is a ``JsonTextError`` with a one-line reason; ``read_json_field`` words it after the field's name, the form the
chat format, the tools and the server answer with.
"""

from __future__ import annotations

import json
import re
from typing import Any

# Deeper values are refused: a fixed bound gives one answer whatever the recursion limit, and leaves the recursive
# writers (json.dumps of a call's arguments) far from it.
MAX_DEPTH = 100
MAX_INT_DIGITS = 4300  # Python's default conversion limit, fixed here so that raising it changes nothing
TOO_DEEP = f"nested too deeply (more than {MAX_DEPTH} levels of arrays and objects)"
# A \u escape of a surrogate: only a text holding one (or a raw surrogate) can give a lone surrogate.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abcdefABCDEF]")


class JsonTextError(ValueError):
    """Why a text is not JSON the project reads. ``str()`` is the reason alone, for a caller that names the place
    itself (``data.jsonl:3: duplicate key "a"``); ``about(field)`` is the reason after the field's name."""

    def __init__(self, reason: str, about: str) -> None:
        super().__init__(reason)
        self._about = about  # with "{field}" where the field's name goes

    def about(self, field: str) -> str:
        """The one-line error for `field`: ``messages[1].tool_calls[0].arguments has a duplicate key "x"``."""
        return self._about.replace("{field}", field, 1)


def _invalid(detail: str) -> JsonTextError:
    return JsonTextError(f"invalid JSON ({detail})", f"{{field}} is not valid JSON ({detail})")


def _too_deep() -> JsonTextError:
    return JsonTextError(TOO_DEEP, f"{{field}} is {TOO_DEEP}")


def _object(pairs: list[tuple[str, Any]]) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        duplicate = json.dumps(next(key for key, _ in pairs if key in seen or seen.add(key)))
        raise JsonTextError(f"duplicate key {duplicate}", f"{{field}} has a duplicate key {duplicate}")
    return obj


def _integer(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise _invalid(f"an integer of more than {MAX_INT_DIGITS} digits")
    return int(text)


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
                where = _path(keys)
                words = lone_surrogate(node, index)
                raise JsonTextError(f"lone surrogate (U+{ord(node[index]):04X} at character {index})"
                                    + (f" in {where}" if where else ""), "{field}" + where + " " + words)
            continue
        if not isinstance(node, (dict, list)):
            continue
        if depth_limit and depth > MAX_DEPTH:
            raise _too_deep()
        if isinstance(node, dict):
            for key, child in node.items():
                if surrogates and isinstance(key, str) and (index := surrogate_at(key)) is not None:
                    where = _path(keys)
                    words = lone_surrogate(key, index)
                    raise JsonTextError(f"lone surrogate (U+{ord(key[index]):04X} at character {index}) in a key"
                                        + (f" of {where}" if where else ""),
                                        "{field}" + where + " " + words.replace(", which", " in a key, which"))
                stack.append((child, depth + 1, (*keys, key)))
        else:
            stack.extend((child, depth + 1, (*keys, index)) for index, child in enumerate(node))


def read_json(text: str, surrogates: bool = True) -> Any:
    """The JSON value of `text`, as Python's ``json`` reads it, or a JsonTextError (see the module's docstring).
    ``surrogates=False`` leaves lone surrogates to the caller (the jsonl loader checks only the strings it keeps,
    naming each)."""
    try:
        value = json.loads(text, object_pairs_hook=_object, parse_int=_integer)
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


def read_json_field(text: str, field: str) -> Any:
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
