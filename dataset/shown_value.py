"""How a one-line error message quotes the value it refuses (house rule: one line naming the field and the allowed
values). Python's repr of a tensor or an array is every element over many lines, and that of a long list or dict
(a whole rope_scaling, a token list) buries the field and the allowed values; shown_value keeps the quote to one
short line. shown_json quotes a JSON API's client value as JSON, shown_text cuts a quote or a name a client chose
(a server's error echoing a 100,000-character tool name made a 100,000-character error), shown_name names a field
by a key a user wrote (a sweep YAML's parameter), and flag_refusal writes the refusal line of a flag."""

from __future__ import annotations

import json
import re
from typing import Any

MAX_SHOWN = 60  # characters of a quote kept before "..."
PATH_MAX = 4096  # Linux's longest path a system call takes: shown_path names one whole up to it


def shown_value(value: Any) -> str:
    """`value` as an error message quotes it: its repr, on one line; a tensor or array of one dimension or more
    by its type, shape and dtype instead (a 0-d one by its repr); a repr over MAX_SHOWN characters cut there, "..."
    added."""
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if isinstance(shape, tuple) and dtype is not None and len(shape) > 0:
        return f"<{type(value).__name__} of shape {tuple(shape)}, {dtype}>"
    return shown_text(repr(value))


def shown_json(value: Any) -> str:
    """`value` as an error message of a JSON API quotes it: its JSON text (what the client wrote: "a", not 'a'; a
    newline as \\n), cut as shown_value cuts a repr."""
    return shown_text(json.dumps(value))


def shown_text(text: str) -> str:
    """`text`, a quote (a repr, JSON) or a name a client chose (a field, a key), on one line and cut at MAX_SHOWN
    characters, "..." added: the cut every quote of a refused value takes."""
    text = re.sub(r"\s*\n\s*", " ", text)  # a str's repr has no newline: its spaces stay as they are
    return text if len(text) <= MAX_SHOWN else text[:MAX_SHOWN - 3] + "..."


def shown_path(path: str) -> str:
    """A path as an error names it: whole up to PATH_MAX characters (the longest a system call takes; a user needs
    the whole name to find the file), longer cut as shown_text cuts (such a text only names a file after pathlib
    folds its "./" away), on one line either way (a newline or other control character escaped as repr escapes it)."""
    escaped = _escaped(path)
    return escaped if len(escaped) <= PATH_MAX else shown_text(escaped)


def shown_name(name: str) -> str:
    """A key a user wrote (a YAML mapping's key, a sweep's parameter name) as a message names a field by it
    (``parameters.<name>.values``): as written where it is short and printable, else each control character
    escaped as repr escapes it (a newline as \\n: the line stays one, and a name holding "\\r" or a terminal's
    escape codes cannot rewrite it) and cut as shown_text cuts."""
    return shown_text(_escaped(name))


def _escaped(text: str) -> str:
    """`text` with each character that is not printable (a newline, a tab, an escape code) as repr writes it."""
    return "".join(char if char.isprintable() else repr(char)[1:-1] for char in text)


def flag_refusal(flag: str | None, value: Any, allowed: str) -> str:
    """The one-line refusal of a flag's value, every trainer's and tool's: "--flag=<value> is not allowed; <allowed>",
    the value quoted by shown_value; with `flag` None, "<value> is not allowed; <allowed>" (an argparse type
    function's message, which argparse prefixes with "argument --flag: " itself)."""
    quoted = shown_value(value)
    return f"{quoted} is not allowed; {allowed}" if flag is None else f"--{flag}={quoted} is not allowed; {allowed}"
