"""How a one-line error message quotes the value it refuses (house rule: one line naming the field and the allowed
values). Python's repr of a tensor or an array is every element over many lines, and that of a long list or dict
(a whole rope_scaling, a token list) buries the field and the allowed values; shown_value keeps the quote to one
short line."""

from __future__ import annotations

import re
from typing import Any

MAX_SHOWN = 60  # characters of a repr kept before "..."


def shown_value(value: Any) -> str:
    """`value` as an error message quotes it: its repr, on one line; a tensor or array of one dimension or more
    by its type, shape and dtype instead (a 0-d one by its repr); a repr over MAX_SHOWN characters cut there, "..."
    added."""
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if isinstance(shape, tuple) and dtype is not None and len(shape) > 0:
        return f"<{type(value).__name__} of shape {tuple(shape)}, {dtype}>"
    text = re.sub(r"\s*\n\s*", " ", repr(value))  # a str's repr has no newline: its spaces stay as they are
    return text if len(text) <= MAX_SHOWN else text[:MAX_SHOWN - 3] + "..."


def flag_refusal(flag: str | None, value: Any, allowed: str) -> str:
    """The one-line refusal of a flag's value, every trainer's and tool's: "--flag=<value> is not allowed; <allowed>",
    the value quoted by shown_value; with `flag` None, "<value> is not allowed; <allowed>" (an argparse type
    function's message, which argparse prefixes with "argument --flag: " itself)."""
    quoted = shown_value(value)
    return f"{quoted} is not allowed; {allowed}" if flag is None else f"--{flag}={quoted} is not allowed; {allowed}"
