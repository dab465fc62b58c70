"""How a flag's text is read as a number: every tool's number flags (trainer/cli.py's ToolParser and flag types, the
trainers' flags, --threads, a --config YAML's quoted values) read it here.

Why not int() and float() alone: they take more than a number written in ASCII -- the digits of every script
(int('٣') is 3, float('１.５') is 1.5) and '_' between digits (int('1_0') is 10, Python's literal separator). No flag
means those: a value holding them is a typo or text pasted from elsewhere, and read as a number it ran with a value
the command line does not show. What int() and float() take otherwise (a sign, an exponent, inf and nan, spaces
around the number) is unchanged; each flag's own range refuses what it must. Kept free of heavy imports:
trainer/threads.py reads --threads here before torch loads."""

from __future__ import annotations

from collections.abc import Callable

ASCII_NUMBERS = "numbers are written in ASCII digits 0-9, without '_'"


def written_in_ascii(text: str) -> bool:
    """Whether `text` could be a number as flags write them: ASCII, without '_'."""
    return text.isascii() and "_" not in text


def ascii_hint(text: str) -> str:
    """What a refusal of `text` as a number adds: ASCII_NUMBERS in brackets where `text` holds what int() and
    float() take and flags do not, else nothing."""
    return "" if written_in_ascii(str(text)) else f" ({ASCII_NUMBERS})"


def ascii_int(text: str) -> int:
    """int(text) for a number written in ASCII: a ValueError for any other text, '٣' and '1_0' included."""
    if not written_in_ascii(text):
        raise ValueError(f"{text!r}: {ASCII_NUMBERS}")
    return int(text)


def ascii_float(text: str) -> float:
    """float(text) for a number written in ASCII: a ValueError for any other text, '٣' and '1_0' included."""
    if not written_in_ascii(text):
        raise ValueError(f"{text!r}: {ASCII_NUMBERS}")
    return float(text)


# Named as the types they stand for: argparse's refusal says "invalid int value" / "invalid float value".
ascii_int.__name__, ascii_float.__name__ = "int", "float"
ascii_int.kind, ascii_float.kind = int, float  # type: ignore[attr-defined]  # what a --config YAML's check names
NUMBER_READERS: dict[type, Callable[[str], object]] = {int: ascii_int, float: ascii_float}


def number_reader(kind: object) -> object:
    """The reader a flag of type `kind` reads its text with: ascii_int for int, ascii_float for float, any other
    type itself (it reads numbers, if at all, with these)."""
    return NUMBER_READERS.get(kind, kind) if isinstance(kind, type) else kind
