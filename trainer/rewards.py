"""Reward functions for the RL trainers: loading them from `--reward` specs, the built-in ones, and calling them
under a contract whose breaches stop a run with one line.

A reward function has TRL's signature: `function(prompts: list[str], completions: list[str], **columns) ->
list[float | None]`, one value per completion, where `columns` are the data rows' other fields, one list each,
aligned with the completions (e.g. `answer=[...]`); with --tools also `completion_messages`
(COMPLETION_MESSAGES: each completion's episode as OpenAI messages, its assistant turns read back and its tool
results, as TRL hands a tool-calling rollout to its rewards; the completion's text is the whole episode's). None
means "this function does not score this completion": it adds nothing to that completion's weighted sum, as TRL's
nansum does. A spec is `path/to/file.py:function` or the name of a built-in (BUILTIN).
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import inspect
import json
import math
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dataset.atomic_io import first_line, special_file_kind
from dataset.chat_format import THINK, THINK_END
from dataset.shown_value import shown_text, shown_value
from trainer.run_dir import resolve_input_path

RewardFunction = Callable[..., list]

# DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476), counted in characters (a reward sees text):
# 0 up to LENGTH_LIMIT - LENGTH_BUFFER, then falling linearly to -1 at LENGTH_LIMIT, -1 beyond.
LENGTH_LIMIT_CHARS = 512
LENGTH_BUFFER_CHARS = 128
REPETITION_NGRAM = 3  # the n of the repetition penalty's n-grams (words and punctuation marks)

_NUMBER = r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+"


class RewardError(ValueError):
    """A reward function broke the contract (raised, wrong count, NaN or not a number): one line naming it."""


def _to_number(text: str) -> float | None:
    """The number a text spells, or None; a number beyond a 64-bit float is none: every such number reads as the
    same infinity, so an answer of 400 digits would match any completion of 309 digits or more."""
    text = text.strip().replace(",", "").rstrip(".")
    try:
        if "/" in text:
            numerator, denominator = text.split("/")
            value = float(numerator) / float(denominator)
        else:
            value = float(text)
    except (ValueError, ZeroDivisionError):
        return None
    return value if math.isfinite(value) else None


def final_answer(completion: str) -> float | None:
    """The number a completion gives as its final answer: the last number inside its last \\boxed{...}, else after
    its last "####" (GSM8K's mark), else in the whole text; None when there is none."""
    for pattern in (r"\\boxed\{([^{}]*)\}", r"####([^\n]*)"):
        found = re.findall(pattern, completion)
        if found:
            completion = found[-1]
            break
    numbers = re.findall(_NUMBER, completion)
    return _to_number(numbers[-1]) if numbers else None


def answer_part(completion: str) -> str:
    """What a completion answers, split from its thinking by the chat format's rule (dataset/chat_format.py,
    parse_assistant_ids, which the chat and the server read replies with; it reads ids, a reward sees text): only a
    completion that opens with <think> thinks, its thought ends at the first </think> (any later one is the answer's
    text), and one cut before that is all thinking, answering nothing. Any other completion is all answer."""
    if not completion.startswith(THINK):
        return completion
    return completion[len(THINK):].partition(THINK_END)[2]


def answer_number(answer: Any) -> float | None:
    """The number a row's `answer` gives math_answer: a JSON number, or the final answer (final_answer) of a text
    such as GSM8K's "... #### 42"; None for anything else (null, true, an object, a list, a text without a number)."""
    if isinstance(answer, float):
        return answer  # its str() may have an exponent, which final_answer reads as two numbers
    if isinstance(answer, (int, str)) and not isinstance(answer, bool):
        return final_answer(str(answer))  # an int's digits: no overflow where float() would raise
    return None


def math_answer(prompts: list[str], completions: list[str], answer: Sequence, **columns) -> list[float]:
    """1.0 where the final answer (final_answer) of the completion's answer part (after its thinking, answer_part)
    equals the row's `answer` (answer_number: a number, or a text whose final answer is one, such as GSM8K's
    "... #### 42") numerically (relative tolerance 1e-6), else 0.0."""
    rewards = []
    for completion, expected in zip(completions, answer):
        got, want = final_answer(answer_part(completion)), answer_number(expected)
        rewards.append(float(got is not None and want is not None and math.isclose(got, want, rel_tol=1e-6,
                                                                                     abs_tol=1e-9)))
    return rewards


def length_penalty(prompts: list[str], completions: list[str], **columns) -> list[float]:
    """DAPO's soft overlong punishment in characters: 0 up to LENGTH_LIMIT_CHARS - LENGTH_BUFFER_CHARS, then
    linearly down to -1 at LENGTH_LIMIT_CHARS, and -1 beyond."""
    start = LENGTH_LIMIT_CHARS - LENGTH_BUFFER_CHARS
    return [max(-1.0, min(0.0, (start - len(completion)) / LENGTH_BUFFER_CHARS)) for completion in completions]


def repetition_penalty(prompts: list[str], completions: list[str], **columns) -> list[float]:
    """Minus the fraction of a completion's word n-grams (n = REPETITION_NGRAM; words and punctuation marks,
    lower-cased) that repeat an earlier one: 0 for text without repeats, toward -1 for a loop; 0 for text too
    short to hold an n-gram."""
    rewards = []
    for completion in completions:
        words = re.findall(r"\w+|[^\w\s]", completion.lower())
        grams = [tuple(words[i:i + REPETITION_NGRAM]) for i in range(len(words) - REPETITION_NGRAM + 1)]
        rewards.append(-(len(grams) - len(set(grams))) / len(grams) if grams else 0.0)
    return rewards


def think_format(prompts: list[str], completions: list[str], **columns) -> list[float]:
    """1.0 where the completion is a thinking block and then an answer, else 0.0 (DeepSeek-R1's format reward, on
    this project's template): it starts with <think> (nothing before it, not even whitespace), holds exactly one
    <think> and one </think>, in that order, with anything (or nothing) between them, and after </think> comes text
    that is not only whitespace. The tags are read as text: the completion's control tokens decoded
    (trainer/grpo.py, completion_text), or the same characters written in ordinary tokens."""
    rewards = []
    for completion in completions:
        _, closed, answer = completion.partition(THINK_END)
        rewards.append(float(completion.startswith(THINK) and bool(closed) and completion.count(THINK) == 1
                             and completion.count(THINK_END) == 1 and bool(answer.strip())))
    return rewards


COMPLETION_MESSAGES = "completion_messages"  # --tools: each completion's episode as messages (trainer/grpo.py)
TOOL_CALL_WEIGHT = 0.5  # tool_use's weight of the right call; the fact in the answer has the rest


def _tool_questions(prompts: Sequence[str], tool: Sequence, result: Sequence, fact: Sequence,
                    arguments: Sequence | None) -> list:
    """The rows' questions as dataset/tool_scoring.py scores them (the prompt is the question)."""
    from dataset.tool_scoring import ToolQuestion
    arguments = arguments if arguments is not None else [None] * len(prompts)
    return [ToolQuestion(kind, prompt, dict(given or {}), wanted, known)
            for prompt, kind, given, wanted, known in zip(prompts, tool, arguments, result, fact)]


def tool_call(prompts: list[str], completions: list[str], completion_messages: Sequence[Sequence[dict]],
              tool: Sequence, result: Sequence, fact: Sequence, arguments: Sequence | None = None,
              **columns) -> list[float]:
    """1.0 where the episode's first tool call is the row's `tool` with arguments that give the row's `result`
    (dataset/tool_scoring.py, is_right_reply: "eiffel tower" for "Eiffel Tower" counts), else 0.0. Reads the
    episode's messages (--tools: COMPLETION_MESSAGES)."""
    from dataset.tool_scoring import is_right_reply
    questions = _tool_questions(prompts, tool, result, fact, arguments)
    return [float(is_right_reply(question, [(call["name"], call["arguments"]) for message in messages
                                            if message["role"] == "assistant"
                                            for call in message.get("tool_calls", [])]))
            for question, messages in zip(questions, completion_messages)]


def tool_fact(prompts: list[str], completions: list[str], completion_messages: Sequence[Sequence[dict]],
              tool: Sequence, result: Sequence, fact: Sequence, arguments: Sequence | None = None,
              **columns) -> list[float]:
    """1.0 where the episode's final answer (its last assistant turn's content) holds the row's `fact`
    (dataset/tool_scoring.py, answer_has_fact: the summary's words, or the value as a whole number), else 0.0."""
    from dataset.tool_scoring import answer_has_fact
    questions = _tool_questions(prompts, tool, result, fact, arguments)
    answers = [next((m["content"] for m in reversed(messages) if m["role"] == "assistant"), "")
               for messages in completion_messages]
    return [float(answer_has_fact(question, answer)) for question, answer in zip(questions, answers)]


def tool_use(prompts: list[str], completions: list[str], completion_messages: Sequence[Sequence[dict]],
             tool: Sequence, result: Sequence, fact: Sequence, arguments: Sequence | None = None,
             **columns) -> list[float]:
    """TOOL_CALL_WEIGHT x tool_call + (1 - TOOL_CALL_WEIGHT) x tool_fact: the right call, then the fact in the final
    answer (0.5 + 0.5: the call alone is half the way). Its two parts are logged beside it (REWARD_PARTS)."""
    calls = tool_call(prompts, completions, completion_messages, tool, result, fact, arguments)
    facts = tool_fact(prompts, completions, completion_messages, tool, result, fact, arguments)
    return [TOOL_CALL_WEIGHT * call + (1 - TOOL_CALL_WEIGHT) * found for call, found in zip(calls, facts)]


BUILTIN: dict[str, RewardFunction] = {"math_answer": math_answer, "length_penalty": length_penalty,
                                      "repetition_penalty": repetition_penalty, "think_format": think_format,
                                      "tool_use": tool_use}
# Built-ins that read the rollouts' tool calls (COMPLETION_MESSAGES): only a GRPO or PPO run with --tools has them.
TOOL_REWARDS = ("tool_use",)
# A built-in's parts, scored beside it at weight 0 (logged as rewards/<part>, adding nothing to the reward).
REWARD_PARTS: dict[str, tuple[RewardFunction, ...]] = {"tool_use": (tool_call, tool_fact)}
REWARD_ARGUMENTS = ("prompts", "completions")  # what score passes every function by name: no column may be one
RESERVED_NAMES = (*REWARD_ARGUMENTS, COMPLETION_MESSAGES)  # and what --tools passes beside the columns


@dataclass(frozen=True)
class Column:
    """A data field a built-in reward reads on every row: `needs` says what it must hold (for the error line),
    `reads` is what the reward makes of it (None: nothing, so the reward could never score that row)."""
    name: str
    needs: str
    reads: Callable[[Any], Any]


def _tool_name(value: Any) -> str | None:
    from dataset.tools import TOOLS
    return value if isinstance(value, str) and value in TOOLS else None


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


REQUIRED_COLUMNS: dict[str, tuple[Column, ...]] = {
    "math_answer": (Column("answer", "a number or a number as text", answer_number),),
    # dataset/tool_prompts.py writes them: the question's tool, what the right call returns, the fact to answer with
    "tool_use": (Column("tool", "a built-in tool's name", _tool_name), Column("result", "a non-empty text", _text),
                 Column("fact", "a non-empty text", _text))}


def with_logged_parts(rewards: Sequence[Reward]) -> list[Reward]:
    """The rewards, then each built-in's parts (REWARD_PARTS) at weight 0: scored and logged, adding nothing."""
    parts = [Reward(part.__name__, part, 0.0) for reward in rewards for part in REWARD_PARTS.get(reward.name, ())]
    return [*rewards, *parts]


@dataclass(frozen=True)
class Reward:
    name: str                  # the spec it was loaded from: what its errors and logs call it
    function: RewardFunction
    weight: float = 1.0


def reward_file_spec(spec: str) -> tuple[str, str] | None:
    """A `path/to/file.py:function` spec's file and function; None for a built-in's name or any other text."""
    if spec in BUILTIN:
        return None
    path, _, name = spec.rpartition(":")
    return (path, name) if path.endswith(".py") and name else None


def load_reward(spec: str, weight: float = 1.0) -> Reward:
    """The reward function `spec` names: `path/to/file.py:function` or a built-in's name. A ValueError (one line)
    names the spec and what is wrong."""
    if spec in BUILTIN:
        return Reward(spec, BUILTIN[spec], weight)
    if (parts := reward_file_spec(spec)) is None:
        raise ValueError(f"--reward {shown_value(spec)}: expected path/to/file.py:function or a built-in "
                         f"({', '.join(BUILTIN)})")
    path, name = parts
    shown = f"--reward {shown_value(spec)}"  # the flag's value quoted cut; the file it names is named whole
    try:
        file = resolve_input_path(path)  # from here, else from the repo root, as every input flag's
    except OSError as error:  # a name the system will not look up (a component over 255 bytes): a traceback
        raise ValueError(f"{shown}: {error.strerror}") from None
    try:
        is_file, what = file.is_file(), special_file_kind(file)
    except OSError as error:  # a name the system will not look up (a component over 255 bytes): a traceback
        raise ValueError(f"{shown}: {error.strerror}") from None
    if what is not None:  # "no file" of a folder named x.py sent one looking for a file
        raise ValueError(f"{shown}: {file} is {what}, not a Python file")
    if not is_file:
        raise ValueError(f"{shown}: no file {file}")
    # Registered under its own name while it runs, as an import is: a @dataclass (or typing's get_type_hints) looks
    # its module up in sys.modules, and found none ("'NoneType' object has no attribute '__dict__'"). The name holds
    # the path's digest, so that two files of the same name do not take each other's place.
    digest = hashlib.sha256(str(file).encode("utf-8", "surrogateescape")).hexdigest()[:12]
    module_name = f"mininorm_reward_{digest}"
    module_spec = importlib.util.spec_from_file_location(module_name, file)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as error:  # any error of the user's module: one line, not its traceback
        sys.modules.pop(module_name, None)
        raise ValueError(f"{shown}: importing {file} raised {first_line(error, named=True)}") from None
    except SystemExit as error:
        # a script's `sys.exit(main())`: the trainer ended there with its code (0: a success that trained nothing)
        sys.modules.pop(module_name, None)
        raise ValueError(f"{shown}: importing {file} called sys.exit({error.code!r}); a reward file runs its own main "
                         f"only under `if __name__ == \"__main__\":`") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise ValueError(f"{shown}: {file} defines no function {shown_value(name)}")
    return Reward(spec, function, weight)


def column_problems(reward_names: Sequence[str], rows: Sequence[tuple[int, Mapping[str, Any]]],
                    source: str) -> dict[int, str]:
    """What the rewards named (built-ins by name, files by spec) make of each row of `source` (the data: its rows'
    line numbers and fields beside the prompt, dataset/prompt_dataset.py's): {line: reason} for a row with a field
    named as an argument every reward gets (RESERVED_NAMES), or that lacks a field a built-in reward reads or holds
    it in a form the reward cannot read; bad lines like any other (--skip_bad_lines skips them). A field that no row
    has is a ValueError (one line): the reward does not fit the data."""
    present = {name for _, row in rows for name in row}
    columns = [(name, column) for name in reward_names for column in REQUIRED_COLUMNS.get(name, ())]
    for name, column in columns:
        if column.name not in present:
            raise ValueError(f"--reward {name} reads the data's {column.name!r} field, which {source} lacks; give "
                             f"another --reward (a built-in or path/to/file.py:function)")
    problems = {}
    for line, row in rows:
        reserved = next((name for name in RESERVED_NAMES if name in row), None)
        if reserved is not None:
            problems[line] = (f'field "{reserved}" is reserved (reward functions receive the {reserved} under that '
                              f"name); rename it")
            continue
        reason = next((reason for name, column in columns if (reason := _value_problem(name, column, row))), None)
        if reason is not None:
            problems[line] = reason
    return problems


def _value_problem(reward: str, column: Column, row: Mapping[str, Any]) -> str | None:
    if column.name not in row:
        return f'"{column.name}" is missing; the {reward} reward needs {column.needs} on every row'
    if column.reads(row[column.name]) is None:
        return (f'"{column.name}" must be {column.needs} for the {reward} reward, got '
                f"{_described(row[column.name])}")
    return None


def _described(value: Any) -> str:
    """A JSON value as an error line names it: its kind, or a text (shortened) as JSON, on one line."""
    if isinstance(value, str):
        return "the text " + shown_text(json.dumps(value, ensure_ascii=False))  # as written, cut as every quote is
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    return {dict: "an object", list: "a list"}.get(type(value), type(value).__name__)


def _checked(reward: Reward, values, count: int) -> list[float]:
    """The values as floats (None -> NaN), or a RewardError naming the function and the breach."""
    try:
        iterator = iter(values)
    except TypeError:
        raise RewardError(f"reward {reward.name}: returned {type(values).__name__}, not a list of numbers") from None
    except Exception as error:  # the value's own __iter__ (user code)
        raise RewardError(f"reward {reward.name}: raised {first_line(error, named=True)}") from None
    try:
        values = list(iterator)
    except (Exception, SystemExit) as error:  # a generator's code runs here: its error is the function's own
        raise RewardError(f"reward {reward.name}: raised {first_line(error, named=True)}") from None
    if len(values) != count:
        raise RewardError(f"reward {reward.name}: returned {len(values)} values for {count} completions")
    checked = []
    for index, value in enumerate(values):
        if value is None:
            checked.append(math.nan)
            continue
        if not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
            raise RewardError(f"reward {reward.name}: returned {shown_value(value)} for completion {index}, not a "
                              f"number or None")
        try:
            number = float(value)
        except OverflowError:  # an int past 1.8e308
            raise RewardError(f"reward {reward.name}: returned a number beyond the float range for completion "
                              f"{index}, not a finite number") from None
        # the value's own __float__ (user code): an array of two numbers, a signaling-NaN Decimal ended in a
        # traceback or in a line without the reward's name
        except Exception as error:
            raise RewardError(f"reward {reward.name}: returned {shown_value(value)} for completion {index}, not a "
                              f"number or None (float() raised {first_line(error, named=True)})") from None
        if math.isnan(number):
            raise RewardError(f"reward {reward.name}: returned NaN for completion {index} (return None to leave a "
                              f"completion unscored)")
        if math.isinf(number):  # one infinite reward makes every advantage of its group NaN
            raise RewardError(f"reward {reward.name}: returned {number} for completion {index}, not a finite number")
        checked.append(number)
    return checked


def score(rewards: Sequence[Reward], prompts: list[str], completions: list[str],
          columns: dict[str, list]) -> tuple[list[float], list[list[float]]]:
    """(each completion's weighted sum of the rewards, each reward's values with None as NaN, in their order). A
    function that raises, returns another number of values than completions, NaN, an infinity, or something not a
    number raises RewardError (one line naming it). A completion no function scores gets 0 (GRPO's advantages
    leave it out: trainer/grpo.py). Each function is given copies of the lists, which it may change freely. An
    `async def` function (or one returning an awaitable) is awaited, all of a step's together, as TRL's GRPOTrainer
    gathers its async rewards: a function that waits on a judge or a sandbox does not hold up the others."""
    returned: list[Any] = []
    for reward in rewards:
        try:
            returned.append(_called(reward, prompts, completions, columns))
        except RewardError:  # the coroutines of the async functions before it are never awaited: closed unrun
            for value in returned:
                if inspect.iscoroutine(value):
                    value.close()
            raise
    pending = {index: value for index, value in enumerate(returned) if inspect.isawaitable(value)}
    if pending:
        for index, value in zip(pending, asyncio.run(_awaited(list(pending.values())))):
            returned[index] = value
    per_function: list[list[float]] = []
    for reward, values in zip(rewards, returned):
        if isinstance(values, _Raised):
            raise RewardError(f"reward {reward.name}: raised {first_line(values.error, named=True)}")
        per_function.append(_checked(reward, values, len(completions)))
    totals = [sum(reward.weight * values[i] for reward, values in zip(rewards, per_function)
                  if not math.isnan(values[i])) for i in range(len(completions))]
    return totals, per_function


@dataclass(frozen=True)
class _Raised:
    """What an awaited reward function raised, kept until the functions before it are checked (their order)."""
    error: BaseException


def _called(reward: Reward, prompts: list[str], completions: list[str], columns: dict[str, list]) -> Any:
    """What `reward`'s function returns for the step (an awaitable for an async one), or a RewardError."""
    try:
        # each function its own lists: one that cleared `completions` emptied the trainer's list and the next
        # function's (REWARD_ARGUMENTS)
        return reward.function(prompts=list(prompts), completions=list(completions),
                               **{name: list(column) for name, column in columns.items()})
    # the user's code: its failure is reported in one line; a sys.exit in it ended the trainer with its code
    except (Exception, SystemExit) as error:
        raise RewardError(f"reward {reward.name}: raised {first_line(error, named=True)}") from None


async def _awaited(awaitables: list[Any]) -> list[Any]:
    """The awaitables' results, awaited together, each error kept as _Raised (a sys.exit in one too: it would end
    the event loop and the trainer)."""
    async def result(awaitable: Any) -> Any:
        try:
            return await awaitable
        except (Exception, SystemExit) as error:
            return _Raised(error)
    return await asyncio.gather(*(result(awaitable) for awaitable in awaitables))
