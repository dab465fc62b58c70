"""Built-in tools a chat model can call: ``wiki``, ``calculator`` and ``convert_units``.

Each tool has an OpenAI-format schema (``{"type": "function", "function": {"name", "description", "parameters"}}``)
and a function that returns a string. ``run_tool(name, arguments)`` is the one entry point for chat, the server and
data generation: it parses and checks the arguments against the schema, runs the tool, cuts the result to a budget
(characters, and tokens when a counter is given) and never raises -- every failure comes back as a string starting
with ``ERROR_PREFIX``, which the model reads like any other tool result.

The tools live in the library (beside the corpus they read) so that the chat tool, the server and the data generator
share one implementation.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `import dataset...` work from any directory
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.cli import quiet_ctrl_c_while_loading  # noqa: E402

quiet_ctrl_c_while_loading(__name__)  # a Ctrl-C while the imports below load: one line, exit 130

import ast  # noqa: E402
import contextlib  # noqa: E402
import difflib  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import unicodedata  # noqa: E402
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from fractions import Fraction  # noqa: E402
from typing import Any, NamedTuple  # noqa: E402

from dataset.json_text import check_json_value, read_json_field  # noqa: E402
from dataset.sources import WikiArticle, read_wikipedia  # noqa: E402
from dataset.wiki_qa import split_sentences  # noqa: E402

ERROR_PREFIX = "Error: "
ELLIPSIS = "…"
# The default model's context is 512 tokens, and the SFT that teaches the tools trains on rows of 384 (pretraining's
# are 256; trainer/arg_fields.py): a tool result must stay a fraction of a row.
DEFAULT_RESULT_CHARS = 400


class ToolError(Exception):
    """A failure the caller should see as a tool result (bad input, no such article, overflow)."""


def is_tool_error(result: str) -> bool:
    return result.startswith(ERROR_PREFIX)


def format_number(value: int | float) -> str:
    """Integers exactly; floats to 12 significant digits, so 0.1 + 0.2 reads 0.3 and 10 / 2 reads 5."""
    if isinstance(value, int):
        return str(value)
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return format(value, ".12g")


# ---------------------------------------------------------------------------------------------------------- budget
@dataclass(frozen=True)
class ResultBudget:
    """How much of a tool result fits the context: at most ``max_chars`` characters and, when ``count_tokens`` is
    given, at most ``max_tokens`` tokens."""

    max_chars: int = DEFAULT_RESULT_CHARS
    max_tokens: int | None = None
    count_tokens: Callable[[str], int] | None = None

    def __post_init__(self) -> None:
        if self.max_chars < 1:
            raise ValueError(f"max_chars must be at least 1, got {self.max_chars}")
        if (self.max_tokens is None) != (self.count_tokens is None):
            raise ValueError("max_tokens and count_tokens go together: give both or neither")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")

    def fits(self, text: str) -> bool:
        if len(text) > self.max_chars:
            return False
        return self.count_tokens is None or self.count_tokens(text) <= self.max_tokens


def fit_text(text: str, budget: ResultBudget) -> str:
    """``text`` unchanged when it fits, else as many whole sentences as fit, else as many whole words as fit; a cut
    text ends with an ellipsis so the reader knows there was more."""
    if budget.fits(text):
        return text
    sentences = split_sentences(text)
    kept = ""
    for end in range(1, len(sentences)):  # all of them would be the whole text, which did not fit
        candidate = " ".join(sentences[:end]) + " " + ELLIPSIS
        if not budget.fits(candidate):
            break
        kept = candidate
    if kept:
        return kept
    words = text.split()
    kept = _longest_prefix(lambda n: " ".join(words[:n]) + ELLIPSIS, len(words), budget)
    # Nothing whole fits (one huge word): cut inside it, down to the bare ellipsis.
    return kept or _longest_prefix(lambda n: text[:n] + ELLIPSIS, len(text), budget) or ELLIPSIS


def _longest_prefix(make: Callable[[int], str], count: int, budget: ResultBudget) -> str:
    """make(n) for the largest n in 1..count whose text fits, found by bisection (longer prefixes never count
    fewer characters or tokens); "" when not even make(1) fits."""
    low, high = 0, count
    while low < high:
        middle = (low + high + 1) // 2
        if budget.fits(make(middle)):
            low = middle
        else:
            high = middle - 1
    return make(low) if low else ""


# ------------------------------------------------------------------------------------------------------------ wiki
_APOSTROPHES = "'’ʼ`"
# Letters NFKD does not split into a base letter and an accent.
_LIGATURES = str.maketrans({"æ": "ae", "œ": "oe", "ß": "ss", "ø": "o", "đ": "d", "ł": "l", "ı": "i"})
_LEADING_ARTICLES = ("the ", "a ", "an ")
_DISAMBIGUATION = re.compile(r"\s*\([^()]*\)\s*$")  # "Horn (instrument)" -> "Horn"


def title_key(text: str) -> str:
    """What a title lookup compares: case, accents, punctuation, spacing and a leading article do not count
    ("the Eiffel tower!" and "Eiffel Tower" share a key; so do "Dvorak" and "Dvořák", "fermats" and "Fermat's")."""
    text = unicodedata.normalize("NFKD", text)
    text = "".join(c for c in text if not unicodedata.combining(c)).casefold().translate(_LIGATURES)
    text = text.replace("&", " and ")
    text = "".join(c for c in text if c not in _APOSTROPHES)
    text = " ".join("".join(c if c.isalnum() else " " for c in text).split())
    for article in _LEADING_ARTICLES:
        if text.startswith(article) and len(text) > len(article):
            text = text[len(article):]
            break
    return text


class WikiIndex:
    """The embedded Wikipedia summaries by title, with the forgiving lookup of ``wiki``."""

    def __init__(self, articles: Iterable[WikiArticle]) -> None:
        self.articles: dict[str, WikiArticle] = {}
        self._by_key: dict[str, list[str]] = {}
        self._by_base: dict[str, list[str]] = {}  # key of the title without its "(disambiguation)"
        for article in articles:
            self.articles.setdefault(article.title, article)
        for title in self.articles:
            self._by_key.setdefault(title_key(title), []).append(title)
            self._by_base.setdefault(title_key(_DISAMBIGUATION.sub("", title)), []).append(title)

    def find(self, query: str) -> WikiArticle:
        """The article ``query`` names: the exact title, else the one title with the same key, else the one title
        whose key without its parenthesised qualifier matches ("jaws" -> "Jaws (film)"). Raises
        ToolError when nothing or several titles match, naming the candidates."""
        query = query.strip()
        if query in self.articles:
            return self.articles[query]
        key = title_key(query)
        if not key:
            raise ToolError("title must contain letters or digits")
        for table in (self._by_key, self._by_base):
            titles = table.get(key, [])
            if len(titles) == 1:
                return self.articles[titles[0]]
            if titles:
                listed = "; ".join(sorted(titles)[:8])
                raise ToolError(f"{query!r} matches several articles: {listed}. Call wiki with one of these titles")
        close = difflib.get_close_matches(key, self._by_key, n=3, cutoff=0.75)
        hint = f"; closest titles: {'; '.join(self._by_key[k][0] for k in close)}" if close else ""
        raise ToolError(f"no article titled {query!r} in the offline Wikipedia summaries{hint}")


@functools.cache
def wiki_index() -> WikiIndex:
    """The index of the embedded summaries (the same cleaned text the default corpus trains on), built once."""
    return WikiIndex(read_wikipedia())


MAX_TITLE_CHARS = 200  # a longer "title" is not one, and would make the closest-title search slow


def wiki(title: str) -> str:
    """The summary of the article ``title`` names, whole (``run_tool`` cuts it to the budget)."""
    if len(title) > MAX_TITLE_CHARS:
        raise ToolError(f"title longer than {MAX_TITLE_CHARS} characters")
    return wiki_index().find(title).extract


# ------------------------------------------------------------------------------------------------------ calculator
MAX_EXPRESSION_CHARS = 200
MAX_INT_BITS = 1024  # about 308 digits: 2 ** 1000 works, 9 ** 9 ** 9 is refused before it is computed
# A budget of the evaluating thread's CPU time, checked between steps (the size limits already keep every step tiny).
# CPU time, not wall time, and no garbage collection during the walk: neither a busy machine nor a big heap may turn
# a valid calculation into an error (the default corpus's dialogues would then depend on them, and a chat user would
# get "takes too long" for 2 + 2).
CALCULATOR_CPU_SECONDS = 0.5
_TEXT_OPERATORS = {"^": "**", "×": "*", "÷": "/", "−": "-"}  # what people type -> Python's operators


def _check_int(value: int) -> int:
    if value.bit_length() > MAX_INT_BITS:
        raise ToolError(f"result too large (more than {MAX_INT_BITS} bits)")
    return value


def _check_number(value: Any) -> int | float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ToolError("the result is not a real number")
    if isinstance(value, int):
        return _check_int(value)
    if not math.isfinite(value):
        raise ToolError("the result is not a finite number (overflow)")
    return value


def _power(base: int | float, exponent: int | float) -> int | float:
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        # The result has about bits(base) * exponent bits: refuse before Python spends memory and time on it.
        if (abs(base).bit_length() - 1) * exponent > MAX_INT_BITS:
            raise ToolError(f"result too large (more than {MAX_INT_BITS} bits)")
    return base**exponent


def _multiply(left: int | float, right: int | float) -> int | float:
    if isinstance(left, int) and isinstance(right, int) and left.bit_length() + right.bit_length() > MAX_INT_BITS + 1:
        raise ToolError(f"result too large (more than {MAX_INT_BITS} bits)")
    return left * right


_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: _multiply,
    ast.Div: lambda a, b: a / b,
    ast.FloorDiv: lambda a, b: a // b,
    ast.Mod: lambda a, b: a % b,
    ast.Pow: _power,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.USub: lambda a: -a, ast.UAdd: lambda a: +a}


def _factorial(n: int | float) -> int:
    if isinstance(n, float) and n.is_integer():
        n = int(n)
    if not isinstance(n, int) or n < 0 or n > 170:
        raise ToolError("factorial takes a whole number from 0 to 170")
    return math.factorial(n)


def _round(x: int | float, digits: int | float = 0) -> int | float:
    if not isinstance(digits, int) or abs(digits) > 15:
        raise ToolError("round's second argument must be a whole number from -15 to 15")
    return round(x, digits) if digits else round(x)


CALCULATOR_FUNCTIONS: dict[str, Callable[..., int | float]] = {
    "sqrt": math.sqrt, "abs": abs, "round": _round, "floor": math.floor, "ceil": math.ceil,
    "exp": math.exp, "log": math.log, "log10": math.log10, "log2": math.log2,
    "sin": math.sin, "cos": math.cos, "tan": math.tan, "factorial": _factorial,
}
CALCULATOR_CONSTANTS: dict[str, float] = {"pi": math.pi, "e": math.e}


class _Evaluator:
    """Walks a parsed expression, allowing only numbers, arithmetic and the listed functions and constants."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline

    def value(self, node: ast.AST) -> int | float:
        if time.thread_time() > self.deadline:
            raise ToolError("expression takes too long")
        if isinstance(node, ast.Expression):
            return self.value(node.body)
        if isinstance(node, ast.Constant):
            if isinstance(node.value, bool) or not isinstance(node.value, int | float):
                raise ToolError(f"only numbers are allowed, not {node.value!r}")
            return _check_number(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = self.value(node.left), self.value(node.right)
            return _check_number(_BINARY[type(node.op)](left, right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _check_number(_UNARY[type(node.op)](self.value(node.operand)))
        if isinstance(node, ast.Name):
            if node.id in CALCULATOR_CONSTANTS:
                return CALCULATOR_CONSTANTS[node.id]
            raise ToolError(f"unknown name {node.id!r}; constants: {', '.join(CALCULATOR_CONSTANTS)}")
        if isinstance(node, ast.Call):
            name = node.func.id if isinstance(node.func, ast.Name) else None
            if name not in CALCULATOR_FUNCTIONS or node.keywords:
                raise ToolError(f"unknown function; functions: {', '.join(CALCULATOR_FUNCTIONS)}")
            arguments = [self.value(argument) for argument in node.args]
            return _check_number(CALCULATOR_FUNCTIONS[name](*arguments))
        raise ToolError(f"{type(node).__name__} is not allowed; use numbers, + - * / // % **, parentheses and "
                        f"functions ({', '.join(CALCULATOR_FUNCTIONS)})")


# No garbage collection inside a walk: a full collection of a big process's heap takes CPU time of its own (0.7 s for
# 8M objects), which is not the expression's; the walk allocates next to nothing. Walks run on several threads at
# once (the server's POST /tools/run), so the collector's switch is shared: the first walk to start turns it off
# (noting whether it was on) and the last to end turns it back on, under a lock.
_COLLECTION_LOCK = threading.Lock()
_collection = {"walks": 0, "was_enabled": False}


@contextlib.contextmanager
def _no_collection() -> Iterator[None]:
    with _COLLECTION_LOCK:
        if _collection["walks"] == 0:
            _collection["was_enabled"] = gc.isenabled()
            gc.disable()
        _collection["walks"] += 1
    try:
        yield
    finally:
        with _COLLECTION_LOCK:
            _collection["walks"] -= 1
            if _collection["walks"] == 0 and _collection["was_enabled"]:
                gc.enable()


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression, computed without ``eval``; raises ToolError for anything else."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    for typed, python in _TEXT_OPERATORS.items():
        expression = expression.replace(typed, python)
    if not expression.strip():
        raise ToolError("expression is empty")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as error:
        raise ToolError(f"cannot parse the expression ({type(error).__name__})") from None
    try:
        with _no_collection():
            return _Evaluator(time.thread_time() + CALCULATOR_CPU_SECONDS).value(tree)
    except ZeroDivisionError:
        raise ToolError("division by zero") from None
    except OverflowError:
        raise ToolError("the result is too large (overflow)") from None
    except (ValueError, TypeError) as error:  # math domain errors, wrong argument counts
        raise ToolError(f"invalid arguments: {error}") from None
    except RecursionError:
        raise ToolError("expression nested too deeply") from None


def calculator(expression: str) -> str:
    return format_number(evaluate(expression))


# -------------------------------------------------------------------------------------------------- convert_units
@dataclass(frozen=True)
class Unit:
    singular: str
    plural: str
    dimension: str
    factor: Fraction  # size in the dimension's base unit (metre, kilogram, ...); unused for temperatures


# (dimension, singular, plural, factor to the base unit as an exact decimal string, aliases). Factors are the
# international definitions (inch = 2.54 cm, pound = 0.45359237 kg, US gallon = 231 cubic inches); year = 365.25 days.
_UNIT_TABLE: tuple[tuple[str, str, str, str, tuple[str, ...]], ...] = (
    ("length", "metre", "metres", "1", ("m", "meter", "meters")),
    ("length", "kilometre", "kilometres", "1000", ("km", "kilometer", "kilometers")),
    ("length", "centimetre", "centimetres", "0.01", ("cm", "centimeter", "centimeters")),
    ("length", "millimetre", "millimetres", "0.001", ("mm", "millimeter", "millimeters")),
    ("length", "micrometre", "micrometres", "0.000001", ("um", "micrometer", "micrometers", "micron")),
    ("length", "nanometre", "nanometres", "0.000000001", ("nm", "nanometer", "nanometers")),
    ("length", "inch", "inches", "0.0254", ("in", "inches")),
    ("length", "foot", "feet", "0.3048", ("ft", "feet")),
    ("length", "yard", "yards", "0.9144", ("yd",)),
    ("length", "mile", "miles", "1609.344", ("mi",)),
    ("length", "nautical mile", "nautical miles", "1852", ("nmi",)),
    ("length", "astronomical unit", "astronomical units", "149597870700", ("au",)),
    ("length", "light-year", "light-years", "9460730472580800", ("ly", "lightyear")),
    ("mass", "kilogram", "kilograms", "1", ("kg", "kilo")),
    ("mass", "gram", "grams", "0.001", ("g", "gramme")),
    ("mass", "milligram", "milligrams", "0.000001", ("mg",)),
    ("mass", "microgram", "micrograms", "0.000000001", ("ug", "mcg")),
    ("mass", "tonne", "tonnes", "1000", ("t", "metric ton")),
    ("mass", "pound", "pounds", "0.45359237", ("lb",)),
    ("mass", "ounce", "ounces", "0.028349523125", ("oz",)),
    ("mass", "stone", "stone", "6.35029318", ("st",)),
    ("mass", "short ton", "short tons", "907.18474", ("us ton",)),
    ("mass", "long ton", "long tons", "1016.0469088", ("imperial ton",)),
    ("volume", "litre", "litres", "0.001", ("l", "liter", "liters")),
    ("volume", "millilitre", "millilitres", "0.000001", ("ml", "milliliter", "milliliters", "cc", "cm3")),
    ("volume", "cubic metre", "cubic metres", "1", ("m3", "cubic meter")),
    ("volume", "US gallon", "US gallons", "0.003785411784", ("gal", "gallon")),
    ("volume", "imperial gallon", "imperial gallons", "0.00454609", ("uk gallon",)),
    ("volume", "US quart", "US quarts", "0.000946352946", ("qt", "quart")),
    ("volume", "US pint", "US pints", "0.000473176473", ("pt", "pint")),
    ("volume", "US cup", "US cups", "0.0002365882365", ("cup",)),
    ("volume", "US fluid ounce", "US fluid ounces", "0.0000295735295625", ("fl oz", "floz", "fluid ounce")),
    ("volume", "tablespoon", "tablespoons", "0.00001478676478125", ("tbsp",)),
    ("volume", "teaspoon", "teaspoons", "0.00000492892159375", ("tsp",)),
    ("area", "square metre", "square metres", "1", ("m2", "sq m", "square meter")),
    ("area", "square kilometre", "square kilometres", "1000000", ("km2", "sq km", "square kilometer")),
    ("area", "square centimetre", "square centimetres", "0.0001", ("cm2", "sq cm", "square centimeter")),
    ("area", "hectare", "hectares", "10000", ("ha",)),
    ("area", "acre", "acres", "4046.8564224", ("ac",)),
    ("area", "square foot", "square feet", "0.09290304", ("ft2", "sq ft", "square feet")),
    ("area", "square inch", "square inches", "0.00064516", ("in2", "sq in", "square inches")),
    ("area", "square mile", "square miles", "2589988.110336", ("mi2", "sq mi")),
    ("time", "second", "seconds", "1", ("s", "sec")),
    ("time", "millisecond", "milliseconds", "0.001", ("ms",)),
    ("time", "minute", "minutes", "60", ("min",)),
    ("time", "hour", "hours", "3600", ("h", "hr")),
    ("time", "day", "days", "86400", ("d",)),
    ("time", "week", "weeks", "604800", ("wk",)),
    ("time", "year", "years", "31557600", ("yr",)),
    ("speed", "metre per second", "metres per second", "1", ("m/s", "meter per second", "mps")),
    ("speed", "kilometre per hour", "kilometres per hour", "5/18", ("km/h", "kph", "kmh", "kilometer per hour")),
    ("speed", "mile per hour", "miles per hour", "0.44704", ("mph", "mi/h")),
    ("speed", "foot per second", "feet per second", "0.3048", ("ft/s", "fps")),
    ("speed", "knot", "knots", "463/900", ("kn", "kt")),
    ("data", "bit", "bits", "1/8", ()),
    ("data", "byte", "bytes", "1", ("b",)),
    ("data", "kilobyte", "kilobytes", "1000", ("kb",)),
    ("data", "megabyte", "megabytes", "1000000", ("mb",)),
    ("data", "gigabyte", "gigabytes", "1000000000", ("gb",)),
    ("data", "terabyte", "terabytes", "1000000000000", ("tb",)),
    ("data", "kibibyte", "kibibytes", "1024", ("kib",)),
    ("data", "mebibyte", "mebibytes", "1048576", ("mib",)),
    ("data", "gibibyte", "gibibytes", "1073741824", ("gib",)),
    ("temperature", "degree Celsius", "degrees Celsius", "1", ("c", "celsius", "centigrade")),
    ("temperature", "degree Fahrenheit", "degrees Fahrenheit", "1", ("f", "fahrenheit")),
    ("temperature", "kelvin", "kelvins", "1", ("k",)),
)
_SYMBOLS = {"µ": "u", "μ": "u", "²": "2", "³": "3", "^": "", "°": " ", "-": " ", ".": " ", "_": " "}
_PLURALS = {"feet": "foot", "inches": "inch"}


def _singular(word: str) -> str:
    if word in _PLURALS:
        return _PLURALS[word]
    if len(word) >= 3 and word.endswith("s") and not word.endswith("ss"):
        return word[:-1]  # "miles" -> "mile", "lbs" -> "lb"; "celsius" -> "celsiu" on both sides, so it still matches
    return word


def unit_key(text: str) -> str:
    """What a unit lookup compares: case, plural "s", "degree(s)", "per", symbols like ° ² µ do not count."""
    text = text.casefold()
    for symbol, replacement in _SYMBOLS.items():
        text = text.replace(symbol, replacement)
    text = re.sub(r"\s+per\s+", "/", text)
    text = re.sub(r"\s*/\s*", "/", text)
    words = ["/".join(_singular(part) for part in word.split("/")) for word in text.split()]
    if len(words) > 1 and words[0] in ("degree", "deg"):
        words = words[1:]
    return " ".join(words)


def _build_units() -> dict[str, Unit]:
    units: dict[str, Unit] = {}
    for dimension, singular, plural, factor, aliases in _UNIT_TABLE:
        unit = Unit(singular, plural, dimension, Fraction(factor))
        for name in {singular, plural, *aliases}:
            key = unit_key(name)
            if key in units and units[key] != unit:
                raise ValueError(f"unit name {name!r} is ambiguous: {units[key].singular} or {singular}")
            units[key] = unit
    return units


UNITS: dict[str, Unit] = _build_units()
_KELVIN_OFFSET = Fraction("273.15")


def _to_kelvin(value: Fraction, unit: Unit) -> Fraction:
    if unit.singular == "degree Celsius":
        return value + _KELVIN_OFFSET
    if unit.singular == "degree Fahrenheit":
        return (value - 32) * Fraction(5, 9) + _KELVIN_OFFSET
    return value


def _from_kelvin(kelvin: Fraction, unit: Unit) -> Fraction:
    if unit.singular == "degree Celsius":
        return kelvin - _KELVIN_OFFSET
    if unit.singular == "degree Fahrenheit":
        return (kelvin - _KELVIN_OFFSET) * Fraction(9, 5) + 32
    return kelvin


MAX_UNIT_CHARS = 40


def find_unit(name: str, field: str) -> Unit:
    if len(name) > MAX_UNIT_CHARS:
        raise ToolError(f"{field}: unit name longer than {MAX_UNIT_CHARS} characters")
    unit = UNITS.get(unit_key(name))
    if unit is None:
        close = difflib.get_close_matches(unit_key(name), UNITS, n=3, cutoff=0.6)
        hint = f"; did you mean {', '.join(UNITS[k].singular for k in close)}?" if close else ""
        raise ToolError(f"{field}: unknown unit {name!r}{hint}")
    return unit


def convert(value: float, from_unit: str, to_unit: str) -> float:
    """``value`` in ``from_unit`` expressed in ``to_unit``, computed exactly in rationals, rounded once."""
    if isinstance(value, float) and not math.isfinite(value):  # ints are finite (and overflow isfinite)
        raise ToolError("value must be a finite number")
    source, target = find_unit(from_unit, "from_unit"), find_unit(to_unit, "to_unit")
    if source.dimension != target.dimension:
        raise ToolError(f"cannot convert {source.dimension} ({source.plural}) to {target.dimension} ({target.plural})")
    exact = Fraction(value)
    if source.dimension == "temperature":
        kelvin = _to_kelvin(exact, source)
        if kelvin < 0:
            raise ToolError(f"{format_number(value)} {source.plural} is below absolute zero")
        result = _from_kelvin(kelvin, target)
    else:
        result = exact * source.factor / target.factor
    try:
        return float(result)
    except OverflowError:
        raise ToolError("the result is too large") from None


def convert_units(value: float, from_unit: str, to_unit: str) -> str:
    result = convert(value, from_unit, to_unit)
    source, target = find_unit(from_unit, "from_unit"), find_unit(to_unit, "to_unit")

    def named(number: float, unit: Unit) -> str:
        return f"{format_number(number)} {unit.singular if number == 1 else unit.plural}"

    return f"{named(value, source)} = {named(result, target)}"


# -------------------------------------------------------------------------------------------------------- registry
# The schemas' descriptions are short on purpose: the system turn carries them, and the default model's context is
# 512 tokens, its SFT rows 384 (docs/tools.md has the token counts).
class Tool(NamedTuple):
    schema: dict
    function: Callable[..., str]


def _schema(name: str, description: str, properties: dict[str, dict], required: list[str]) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required,
                           "additionalProperties": False},
        },
    }


TOOLS: dict[str, Tool] = {
    "wiki": Tool(_schema(
        "wiki", "Look up an encyclopedia article by its title.",
        {"title": {"type": "string", "description": "e.g. \"Eiffel Tower\""}}, ["title"]), wiki),
    "calculator": Tool(_schema(
        "calculator", "Evaluate arithmetic: + - * / ** and sqrt, log, sin, cos, pi.",
        {"expression": {"type": "string", "description": "e.g. \"(17 + 5) * 3 / 4\""}}, ["expression"]), calculator),
    "convert_units": Tool(_schema(
        "convert_units", "Convert a quantity between units of length, mass, volume, area, time, speed, data size "
        "or temperature.",
        {"value": {"type": "number", "description": "the quantity to convert"},
         "from_unit": {"type": "string", "description": "the unit of value, e.g. \"miles\", \"kg\", \"°F\""},
         "to_unit": {"type": "string", "description": "the unit wanted, e.g. \"km\", \"pounds\", \"°C\""}},
        ["value", "from_unit", "to_unit"]), convert_units),
}

_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
}


def tool_schemas(names: Iterable[str] | None = None) -> list[dict]:
    """The schemas of the named tools (all by default), in the form OpenAI's ``tools`` parameter takes."""
    return [TOOLS[name].schema for name in (TOOLS if names is None else names)]


def check_arguments(name: str, arguments: Mapping[str, Any]) -> None:
    """Raise ToolError unless ``arguments`` has the schema's required fields, no others, of the right types."""
    parameters = TOOLS[name].schema["function"]["parameters"]
    properties = parameters["properties"]
    missing = [field for field in parameters["required"] if field not in arguments]
    if missing:
        raise ToolError(f"{name}: missing argument {', '.join(missing)}; arguments: {', '.join(properties)}")
    unknown = [field for field in arguments if field not in properties]
    if unknown:
        raise ToolError(f"{name}: unknown argument {', '.join(unknown)}; arguments: {', '.join(properties)}")
    for field, value in arguments.items():
        expected = properties[field]["type"]
        if not _JSON_TYPES[expected](value):
            raise ToolError(f"{name}: argument {field} must be a {expected}, got {type(value).__name__}")


def parse_arguments(arguments: Mapping[str, Any] | str) -> Mapping[str, Any]:
    """A call's arguments as a mapping: OpenAI sends them as a JSON string, MiniMind's data as an object. Either
    way they follow the project's strict JSON rules (dataset/json_text.py); ToolError names what is wrong."""
    try:
        if isinstance(arguments, str):
            arguments = read_json_field(arguments, "arguments") if arguments.strip() else {}
        elif isinstance(arguments, Mapping):
            check_json_value(arguments, "arguments")  # no lone surrogate may reach a tool (or its result)
    except ValueError as error:
        raise ToolError(str(error)) from None
    if not isinstance(arguments, Mapping):
        raise ToolError(f"arguments must be a JSON object, got {type(arguments).__name__}")
    return arguments


def run_tool(name: str, arguments: Mapping[str, Any] | str, budget: ResultBudget | None = None,
             offered: Collection[str] | None = None) -> str:
    """Run the tool ``name`` on ``arguments`` and return its result cut to ``budget``; never raises: unknown tools,
    bad arguments and failures come back as strings starting with ``ERROR_PREFIX``. ``offered``: the names a caller
    offers (GRPO's and PPO's --tools; None: every tool), a call to another is an unknown tool's."""
    budget = budget or ResultBudget()
    names = [tool for tool in TOOLS if offered is None or tool in offered]
    try:
        if name not in names:
            raise ToolError(f"unknown tool {name!r}; tools: {', '.join(names)}")
        parsed = parse_arguments(arguments)
        check_arguments(name, parsed)
        result = TOOLS[name].function(**parsed)
    except ToolError as error:
        result = ERROR_PREFIX + str(error)
    except Exception as error:  # a bug in a tool must not end the chat: the model gets a message instead
        result = f"{ERROR_PREFIX}{name} failed ({type(error).__name__})"
    return fit_text(result, budget)


def main(argv: list[str] | None = None) -> None:
    from trainer.cli import ToolParser, int_within

    parser = ToolParser(description="Run one built-in tool and print its result, or --schemas to print the schemas.")
    parser.add_argument("name", nargs="?", help=f"the tool: {', '.join(TOOLS)}")
    parser.add_argument("arguments", nargs="?", default="{}", help="its arguments as a JSON object")
    parser.add_argument("--schemas", action="store_true", help="print every tool's OpenAI-format schema")
    parser.add_argument("--max_chars", type=int_within(1), default=DEFAULT_RESULT_CHARS,
                        help="cut the result to this length")
    args = parser.parse_args(argv)
    if args.schemas:
        print(json.dumps(tool_schemas(), indent=2, ensure_ascii=False))
    elif args.name is None:
        parser.error("name a tool or pass --schemas")
    else:
        print(run_tool(args.name, args.arguments, ResultBudget(max_chars=args.max_chars)))


if __name__ == "__main__":
    from trainer.cli import run_main  # dataset/ imports trainer/ only inside functions: trainer/ imports dataset/

    run_main(main)
