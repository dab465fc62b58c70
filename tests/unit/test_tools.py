"""The built-in tools (dataset/tools.py): the calculator against Python's own arithmetic and against hostile input,
wiki lookups against the embedded Wikipedia summaries, unit conversions against the units' legal definitions, the
schemas against JSON Schema itself, and run_tool's error strings."""

from __future__ import annotations

import json
import math
import random

import jsonschema
import pytest

from dataset.sources import read_wikipedia
from dataset.tools import (
    DEFAULT_RESULT_CHARS,
    ELLIPSIS,
    ERROR_PREFIX,
    TOOLS,
    UNITS,
    ResultBudget,
    Tool,
    convert,
    fit_text,
    is_tool_error,
    run_tool,
    tool_schemas,
)


def calc(expression: str) -> str:
    return run_tool("calculator", {"expression": expression})


# ------------------------------------------------------------------------------------------------------ calculator
def random_expression(rng: random.Random, depth: int) -> str:
    """A random arithmetic expression in Python syntax: ints, floats, the seven operators, unary minus, brackets."""
    if depth == 0 or rng.random() < 0.25:
        if rng.random() < 0.6:
            return str(rng.randint(0, 60))
        return f"{rng.uniform(0, 100):.{rng.randint(1, 4)}f}"
    kind = rng.random()
    if kind < 0.1:
        return f"-({random_expression(rng, depth - 1)})"
    if kind < 0.2:
        return f"({random_expression(rng, depth - 1)})"
    if kind < 0.3:  # small powers keep the results in range
        return f"({random_expression(rng, 0)}) ** {rng.choice(['0', '1', '2', '3', '0.5', '-1', '-2'])}"
    operator = rng.choice(["+", "-", "*", "/", "//", "%"])
    return f"({random_expression(rng, depth - 1)}) {operator} ({random_expression(rng, depth - 1)})"


def test_calculator_matches_python_arithmetic():
    rng = random.Random(7)
    checked = errors = 0
    for _ in range(2000):
        expression = random_expression(rng, 4)
        try:
            expected = eval(expression, {"__builtins__": {}}, {})  # the reference: Python's own fp64 arithmetic
        except (ZeroDivisionError, OverflowError):
            expected = None
        result = calc(expression)
        if expected is None or isinstance(expected, complex):
            assert is_tool_error(result), (expression, result)
            errors += 1
        elif isinstance(expected, int):
            assert result == str(expected), (expression, result, expected)
        else:
            assert math.isclose(float(result), expected, rel_tol=1e-11, abs_tol=1e-300), (expression, result, expected)
        checked += 1
    assert checked == 2000 and 0 < errors < 400  # the random mix reaches the error paths, but rarely


@pytest.mark.parametrize("expression, expected", [
    ("2 + 3 * 4", "14"), ("(2 + 3) * 4", "20"), ("-3 ** 2", "-9"), ("(-3) ** 2", "9"), ("2 ** -1", "0.5"),
    ("10 / 4", "2.5"), ("10 / 2", "5"), ("7 // 2", "3"), ("-7 // 2", "-4"), ("-7 % 3", "2"), ("0.1 + 0.2", "0.3"),
    ("2^10", "1024"), ("6 × 7", "42"), ("9 ÷ 4", "2.25"), ("5 − 8", "-3"), ("2 ** 1000", str(2**1000)),
    ("sqrt(16)", "4"), ("sqrt(2)", "1.41421356237"), ("abs(-4.5)", "4.5"), ("round(2.567, 2)", "2.57"),
    ("round(2.5)", "2"), ("floor(-2.5)", "-3"), ("ceil(2.1)", "3"), ("log(8, 2)", "3"), ("log10(1000)", "3"),
    ("factorial(10)", "3628800"), ("2 * pi", "6.28318530718"), ("e", "2.71828182846"), ("1_000 * 3", "3000"),
    ("  1 +\t1  ", "2"), ("(" * 90 + "1" + ")" * 90, "1"), ("-" * 150 + "1", "1"),
])
def test_calculator_examples(expression, expected):
    assert calc(expression) == expected


def test_calculator_refuses_huge_powers_before_computing_them():
    import tracemalloc

    tracemalloc.start()
    try:
        results = [calc("2 ** 2 ** 24"), calc("3 ** 3 ** 14"), calc("(2 ** 1000) ** 1000")]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert all("more than 1024 bits" in result for result in results), results
    assert peak < 1_000_000  # computing any of them would hold a megabyte-sized integer


HOSTILE = [
    "9**9**9", "10**10**10", "2**100000", "(2**1000)**1000", "9**99999999999", "2.0 ** 5000", "1.5 ** 10 ** 20",
    "10**300 * 10**300", "factorial(1000)", "exp(1000)", "1e309", "1" * 201, "1+" * 100 + "1",
    "(1).__class__", "().__class__.__bases__[0].__subclasses__()", "__import__('os').system('true')",
    "lambda: 1", "x", "open('/etc/passwd')", "sqrt.__call__(4)", "[1, 2]", "'a' * 10", "1 if 1 else 0", "1 < 2",
    "True + 1", "1j", "[x for x in (1, 2)]", "f'{1}'", "sqrt(*[4])", "abs(x=1)", "print(1)", "eval('1')",
    "1; 2", "", "   ", "((((", "(" * 120 + "1" + ")" * 120, "sqrt(-1)", "log(0)", "1/0", "5 % 0", "5 // 0.0",
    "0 ** -1", "(-8) ** 0.5", "factorial(-1)", "factorial(2.5)", "round(1, 99)", "abs()", "pi = 3",
]


@pytest.mark.parametrize("expression", HOSTILE)
def test_calculator_refuses_hostile_input_with_an_error_string(expression):
    result = calc(expression)
    assert is_tool_error(result), result
    assert "failed (" not in result  # refused on purpose, with a reason, not caught as a crash inside the tool
    assert len(result) <= DEFAULT_RESULT_CHARS



def test_calculator_time_budget_counts_its_own_work_only(monkeypatch):
    """A stall of the whole process (a loaded machine, here a sleep inside a step) and a garbage collection that a
    step's allocations would start (here one made slow) leave 24 * 26 a valid calculation, so the default corpus's
    dialogues do not depend on the load or the heap; the expression's own work past the budget is refused."""
    import gc
    import time

    import dataset.tools as tools

    def spend_cpu(seconds: float) -> None:
        until = time.thread_time() + seconds
        while time.thread_time() < until:
            pass

    def stalled_sqrt(x: float) -> float:
        time.sleep(2 * tools.CALCULATOR_CPU_SECONDS)  # wall time passes, the thread's CPU time does not
        return math.sqrt(x)

    def allocating_sqrt(x: float) -> float:
        _ = [[] for _ in range(10 * gc.get_threshold()[0])]  # enough new containers to start a collection
        return math.sqrt(x)

    def slow_collection(phase: str, info: dict) -> None:
        if phase == "start":
            spend_cpu(2 * tools.CALCULATOR_CPU_SECONDS)

    monkeypatch.setitem(tools.CALCULATOR_FUNCTIONS, "sqrt", stalled_sqrt)
    assert calc("sqrt(16) + 24 * 26") == "628"
    monkeypatch.setitem(tools.CALCULATOR_FUNCTIONS, "sqrt", allocating_sqrt)
    gc.callbacks.append(slow_collection)
    try:
        assert calc("sqrt(16) + 24 * 26") == "628"
    finally:
        gc.callbacks.remove(slow_collection)
    assert gc.isenabled()

    def busy_sqrt(x: float) -> float:
        spend_cpu(2 * tools.CALCULATOR_CPU_SECONDS)
        return math.sqrt(x)

    monkeypatch.setattr(tools, "CALCULATOR_CPU_SECONDS", 0.05)
    monkeypatch.setitem(tools.CALCULATOR_FUNCTIONS, "sqrt", busy_sqrt)
    assert calc("sqrt(16) + 1") == f"{ERROR_PREFIX}expression takes too long"


# ------------------------------------------------------------------------------------------------------------ wiki
@pytest.fixture(scope="module")
def extracts() -> dict[str, str]:
    return {article.title: article.extract for article in read_wikipedia()}


def wiki(title: str, budget: ResultBudget | None = None) -> str:
    return run_tool("wiki", {"title": title}, ResultBudget(max_chars=100_000) if budget is None else budget)


@pytest.mark.parametrize("query, title", [
    ("Eiffel Tower", "Eiffel Tower"), ("the eiffel tower!", "Eiffel Tower"), ("  EIFFEL\ttower ", "Eiffel Tower"),
    ("les miserables", "Les Misérables"), ("Musee d’Orsay", "Musée d'Orsay"), ("musee dorsay", "Musée d'Orsay"),
    ("casablanca", "Casablanca"), ("jaws", "Jaws (film)"), ("horn", "Horn (instrument)"),
    ("Horn (Instrument)", "Horn (instrument)"),
    ("encyclopaedia britannica", "Encyclopædia Britannica"),
    ("Good, the Bad & the Ugly", "The Good, the Bad and the Ugly"),
    ("fermats last theorem", "Fermat's Last Theorem"), ("bird of paradise", "Bird-of-paradise"),
    ("20th century classical music", "20th-century classical music"), ("Great Gatsby", "The Great Gatsby"),
])
def test_wiki_forgiving_match_returns_the_real_summary(extracts, query, title):
    assert wiki(query) == extracts[title]


def test_wiki_every_title_found_through_case_and_punctuation_noise(extracts):
    rng = random.Random(3)
    for title in rng.sample(sorted(extracts), 300):
        noisy = f"  {title.upper()} ?! "
        result = wiki(noisy)
        # A title that differs from another only in case or punctuation is reported as ambiguous, by name.
        assert result == extracts[title] or (is_tool_error(result) and title in result), (title, result)


def test_wiki_ambiguous_and_missing_titles_are_clear_errors():
    result = wiki("Mercury")
    assert is_tool_error(result) and "Mercury (element)" in result and "Mercury (planet)" in result
    result = wiki("Xyzzy Plugh Quux")
    assert is_tool_error(result) and "no article" in result and "Xyzzy Plugh Quux" in result
    result = wiki("Eifel Towr")
    assert is_tool_error(result) and "Eiffel Tower" in result  # the closest title is suggested
    assert is_tool_error(wiki("?!")) and is_tool_error(wiki(""))
    assert "title longer than 200 characters" in wiki("Eiffel Tower " * 100_000)


LONG = "20th-century classical music"  # a summary of about 950 characters, first sentence about 100


def test_wiki_result_cut_to_whole_sentences_within_a_character_budget(extracts):
    full = extracts[LONG]
    for max_chars in (150, 300, DEFAULT_RESULT_CHARS):
        result = wiki(LONG, ResultBudget(max_chars=max_chars))
        assert len(result) <= max_chars < len(full)
        assert result.endswith(" " + ELLIPSIS)
        kept = result[: -len(ELLIPSIS) - 1]
        assert full.startswith(kept) and kept.endswith(".")
    assert run_tool("wiki", {"title": LONG}) == wiki(LONG, ResultBudget())


def test_wiki_result_cut_to_a_token_budget(extracts, tokenizer):
    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    for max_tokens in (8, 40, 90):
        result = wiki(LONG, ResultBudget(max_chars=10_000, max_tokens=max_tokens, count_tokens=count))
        assert 0 < count(result) <= max_tokens
        assert extracts[LONG].startswith(result.removesuffix(ELLIPSIS).strip())


def test_fit_text_falls_back_to_words_then_characters():
    budget = ResultBudget(max_chars=12)
    assert fit_text("short", budget) == "short"
    assert fit_text("one two three four five", budget) == "one two…"
    assert fit_text("abcdefghijklmnopqrstuvwxyz", budget) == "abcdefghijk…"
    with pytest.raises(ValueError, match="max_chars"):
        ResultBudget(max_chars=0)
    with pytest.raises(ValueError, match="count_tokens"):
        ResultBudget(max_tokens=10)


# --------------------------------------------------------------------------------------------------- convert_units
@pytest.mark.parametrize("value, source, target, expected", [
    (1, "mile", "km", 1.609344), (1, "inch", "cm", 2.54), (3, "feet", "metres", 0.9144), (1, "yd", "ft", 3),
    (1, "nautical mile", "m", 1852), (1, "lb", "g", 453.59237), (16, "oz", "lbs", 1), (1, "stone", "pounds", 14),
    (1, "US gallon", "L", 3.785411784), (1, "gallon", "pints", 8), (1, "imperial gallon", "litres", 4.54609),
    (1, "acre", "m²", 4046.8564224), (1, "hectare", "acres", 10000 / 4046.8564224),
    (1, "sq mi", "km2", 2.589988110336),
    (60, "mph", "km/h", 96.56064), (1, "knot", "kilometres per hour", 1.852), (10, "m/s", "kph", 36),
    (1, "day", "minutes", 1440), (2, "weeks", "hours", 336), (1, "GiB", "bytes", 2**30), (1, "MB", "bits", 8e6),
    (100, "°C", "°F", 212), (-40, "degrees Fahrenheit", "Celsius", -40), (0, "K", "C", -273.15),
    (98.6, "F", "kelvin", 310.15), (20, "celsius", "K", 293.15),
])
def test_unit_conversions_match_the_definitions(value, source, target, expected):
    assert math.isclose(convert(value, source, target), expected, rel_tol=1e-12)
    result = run_tool("convert_units", {"value": value, "from_unit": source, "to_unit": target})
    assert math.isclose(float(result.split(" = ")[1].split()[0]), expected, rel_tol=1e-11), result


def test_unit_conversion_round_trips_and_text():
    by_dimension: dict[str, list] = {}
    for unit in set(UNITS.values()):
        by_dimension.setdefault(unit.dimension, []).append(unit)
    for units in by_dimension.values():
        for a in units:
            for b in units:
                there = convert(37.5, a.singular, b.singular)
                assert math.isclose(convert(there, b.singular, a.singular), 37.5, rel_tol=1e-12), (a, b)
    assert run_tool("convert_units", {"value": 1, "from_unit": "ft", "to_unit": "m"}) == "1 foot = 0.3048 metres"
    assert run_tool("convert_units", json.dumps({"value": 100, "from_unit": "C", "to_unit": "F"})) == \
        "100 degrees Celsius = 212 degrees Fahrenheit"


@pytest.mark.parametrize("arguments, message", [
    ({"value": 5, "from_unit": "kg", "to_unit": "m"}, "cannot convert mass"),
    ({"value": 5, "from_unit": "furlongs", "to_unit": "m"}, "from_unit: unknown unit 'furlongs'"),
    ({"value": 5, "from_unit": "m", "to_unit": "parsecs"}, "to_unit: unknown unit 'parsecs'"),
    ({"value": 5, "from_unit": "metrs", "to_unit": "km"}, "did you mean metre"),
    ({"value": -500, "from_unit": "F", "to_unit": "C"}, "below absolute zero"),
    ({"value": 1e308, "from_unit": "light-years", "to_unit": "nm"}, "too large"),
    ({"value": 1, "from_unit": "m" * 10_000, "to_unit": "nm"}, "from_unit: unit name longer than 40 characters"),
    ({"value": 10**400, "from_unit": "km", "to_unit": "mm"}, "too large"),
    ({"value": float("nan"), "from_unit": "km", "to_unit": "mm"}, "value must be a finite number"),
    ({"value": float("-inf"), "from_unit": "C", "to_unit": "K"}, "value must be a finite number"),
])
def test_unit_conversion_errors(arguments, message):
    result = run_tool("convert_units", arguments)
    assert is_tool_error(result) and message in result, result


# ---------------------------------------------------------------------------------------------- schemas, run_tool
def test_schemas_are_openai_function_tools_with_valid_json_schema_parameters():
    assert [s["function"]["name"] for s in tool_schemas()] == list(TOOLS) == ["wiki", "calculator", "convert_units"]
    for name, tool in TOOLS.items():
        assert isinstance(tool, Tool) and callable(tool.function)
        schema = tool.schema
        assert set(schema) == {"type", "function"} and schema["type"] == "function"
        function = schema["function"]
        assert set(function) == {"name", "description", "parameters"} and function["name"] == name
        assert isinstance(function["description"], str) and function["description"]
        parameters = function["parameters"]
        jsonschema.Draft202012Validator.check_schema(parameters)
        assert parameters["type"] == "object" and set(parameters["required"]) <= set(parameters["properties"])
        json.dumps(schema)  # serialisable as the system turn renders it


CALLS = [
    ("wiki", {"title": "Eiffel Tower"}), ("wiki", {}), ("wiki", {"title": 5}), ("wiki", {"title": None}),
    ("wiki", {"title": "Paris", "lang": "en"}), ("calculator", {"expression": "1+1"}), ("calculator", {"expr": "1"}),
    ("calculator", {"expression": ["1"]}), ("convert_units", {"value": 1, "from_unit": "m", "to_unit": "ft"}),
    ("convert_units", {"value": 1.5, "from_unit": "m", "to_unit": "ft"}),
    ("convert_units", {"value": "1", "from_unit": "m", "to_unit": "ft"}),
    ("convert_units", {"value": True, "from_unit": "m", "to_unit": "ft"}),
    ("convert_units", {"value": 1, "from_unit": "m"}),
]


@pytest.mark.parametrize("name, arguments", CALLS)
def test_run_tool_accepts_exactly_what_the_schema_accepts(name, arguments):
    valid = jsonschema.Draft202012Validator(TOOLS[name].schema["function"]["parameters"]).is_valid(arguments)
    result = run_tool(name, arguments)
    if valid:
        assert not is_tool_error(result), result
    else:
        assert result.startswith(f"{ERROR_PREFIX}{name}: ") and "argument" in result, result
    assert run_tool(name, json.dumps(arguments)) == result  # OpenAI's JSON-string arguments mean the same


@pytest.mark.parametrize("name, arguments, message", [
    ("search", {"q": "x"}, "unknown tool 'search'; tools: wiki, calculator, convert_units"),
    ("calculator", '{"expression": "1+1"', "arguments is not valid JSON (Expecting"),
    ("calculator", "[1, 2]", "arguments must be a JSON object, got list"),
    ("calculator", '"1+1"', "arguments must be a JSON object, got str"),
    ("calculator", "", "calculator: missing argument expression"),
    ("convert_units", {"value": "1", "from_unit": "m", "to_unit": "ft"}, "argument value must be a number, got str"),
    ("wiki", {"title": "x", "lang": "en"}, "wiki: unknown argument lang; arguments: title"),
])
def test_run_tool_errors_name_the_problem(name, arguments, message):
    result = run_tool(name, arguments)
    assert result.startswith(ERROR_PREFIX) and message in result, result


def test_run_tool_never_raises_when_a_tool_fails(monkeypatch):
    def broken(expression: str) -> str:
        raise RuntimeError("bug")

    monkeypatch.setitem(TOOLS, "calculator", Tool(TOOLS["calculator"].schema, broken))
    assert run_tool("calculator", {"expression": "1"}) == f"{ERROR_PREFIX}calculator failed (RuntimeError)"


def test_command_line_runs_a_tool_and_prints_the_schemas(capsys):
    from dataset.tools import main

    main(["calculator", '{"expression": "2^10"}'])
    main(["wiki", '{"title": "the eiffel tower"}', "--max_chars", "60"])
    calculator_line, wiki_line = capsys.readouterr().out.splitlines()
    assert calculator_line == "1024" and wiki_line.startswith("The Eiffel Tower is") and len(wiki_line) <= 60
    main(["--schemas"])
    assert json.loads(capsys.readouterr().out) == tool_schemas()
    with pytest.raises(SystemExit) as exit_info:
        main([])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines()[0] == "error: name a tool or pass --schemas"



# ------------------------------------------------------------------------------------------- arguments as JSON text
@pytest.mark.parametrize("arguments, message", [
    ('{"expression": ' + "1" * 5000 + "}", "arguments is not valid JSON (an integer of more than 4300 digits)"),
    ("[" * 5000, "arguments is nested too deeply (more than 100 levels of arrays and objects)"),
    ('{"expression": ' + "[" * 101 + "]" * 101 + "}", "arguments is nested too deeply"),
    ('{"expression": "1", "expression": "2"}', 'arguments has a duplicate key "expression"'),
    ('{"expression": "1+\\ud800"}', 'arguments["expression"] holds a lone surrogate (U+D800 at character 2)'),
    ({"expression": "1+\ud800"}, 'arguments["expression"] holds a lone surrogate (U+D800 at character 2)'),
])
def test_hostile_argument_text_is_a_tool_error(arguments, message):
    """What the arguments' JSON text may hold is the project's one strict reader's rule (dataset/json_text.py):
    an error naming the problem, never a crash inside parse_arguments."""
    from dataset.tools import ToolError, parse_arguments

    with pytest.raises(ToolError) as caught:
        parse_arguments(arguments)
    assert message in str(caught.value) and "\n" not in str(caught.value)
    assert run_tool("calculator", arguments) == ERROR_PREFIX + str(caught.value)


def test_overlapping_calculations_keep_the_collector_off_until_the_last_ends(monkeypatch):
    """The calculator turns the garbage collector off during its walk (test above) and run_tool runs on several
    threads at once (the server's POST /tools/run): the collector stays off while any walk is in progress and is on
    again once the last one ends, whatever the order they start and end in."""
    import gc
    import threading

    import dataset.tools as tools

    entered = {1.0: threading.Event(), 4.0: threading.Event()}
    release = {1.0: threading.Event(), 4.0: threading.Event()}

    def blocking_sqrt(x: float) -> float:
        entered[x].set()
        release[x].wait(30)
        return math.sqrt(x)

    monkeypatch.setitem(tools.CALCULATOR_FUNCTIONS, "sqrt", blocking_sqrt)
    results: dict[float, str] = {}
    threads = {x: threading.Thread(target=lambda x=x: results.__setitem__(x, calc(f"sqrt({x})"))) for x in entered}
    assert gc.isenabled()
    try:
        threads[1.0].start()
        assert entered[1.0].wait(30)
        threads[4.0].start()
        assert entered[4.0].wait(30)
        assert not gc.isenabled()
        release[1.0].set()
        threads[1.0].join(30)
        assert not gc.isenabled()  # the other walk is still in progress
        release[4.0].set()
        threads[4.0].join(30)
        assert gc.isenabled() and results == {1.0: "1", 4.0: "2"}
    finally:
        for event in release.values():
            event.set()
        for thread in threads.values():
            thread.join(30)
        gc.enable()


def test_concurrent_calculations_never_leave_the_collector_off():
    """Many threads calculating at once, switching as often as the interpreter allows (the race between reading the
    collector's state and turning it off showed within a few rounds): it is on once they are done."""
    import gc
    import sys
    import threading

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(50):
            threads = [threading.Thread(target=lambda: [calc("(17 + 5) * 3 / 4") for _ in range(300)])
                       for _ in range(4)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert gc.isenabled()
    finally:
        sys.setswitchinterval(interval)
        gc.enable()
