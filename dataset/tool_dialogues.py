"""Deterministic tool-use dialogues in MiniMind's SFT format, for teaching a small model to look up and compute.

Each dialogue is ``{"conversations": [system, user, assistant call, tool, assistant answer]}``:

- the system message carries the schemas of every built-in tool as a JSON string in ``tools`` (as MiniMind's data
  does) and no other text: exactly the system turn ``eval/chat.py`` and the server's page give a model by default;
- the assistant's first message has empty content and ``tool_calls``, a JSON string
  ``[{"name": ..., "arguments": {...}}]``;
- the ``tool`` message holds what ``run_tool`` returns for that call (cut to the result budget);
- the final answer is taken from the tool result: the summary's first sentence, ``<expression> = <result>.``, or the
  conversion's ``<value> <unit> = <value> <unit>.``;
- one dialogue in THINKING_EVERY carries ``reasoning_content`` on both assistant turns (what ``--think`` shows).

Three kinds: "What is X?" -> ``wiki(X)`` over the embedded Wikipedia summaries, arithmetic questions (in symbols or
words) -> ``calculator``, and unit questions -> ``convert_units``. Held-out entities are the corpus's own validation
articles (so they appear nowhere in training: not in pretraining text, not in the QA SFT data, not here); held-out
problems are chosen by a hash of the problem with its operands in canonical order, so "3 + 5" and "5 + 3" fall on
the same side (conversions by a hash of value and units). The same seed gives the same dialogues.

A fourth kind teaches when not to call: small talk under the same system turn, answered without a call
(``small_talk_dialogues``: the opening window of a chit-chat conversation, held out as the corpus holds it out).

A chat goes on: ``after_other_exchanges`` puts a small-talk exchange before the question of one tool
dialogue in MULTI_TURN_EVERY, and a tool exchange (question, call, result, answer) before one small talk in
MULTI_TURN_EVERY. Without them a model learns that a question after small talk is small talk: the README's chat
model made the right call for 6% of the held-out questions asked after one exchange of small talk, 78% asked first;
with them 69% and 77% (docs/tools.md, "A chat that goes on"; 62-75% and 66-82% on three pretraining seeds of four).
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from dataset.sources import (Dialog, WikiArticle, conversation_text, dialog_windows, normalized_text, read_chitchat,
                             read_wikipedia)
from dataset.chat_format import split_exchanges
from dataset.splits import dialog_split_key, is_validation, wiki_split_key
from dataset.tools import TOOLS, ResultBudget, is_tool_error, run_tool, tool_schemas
from dataset.wiki_qa import PERSON_QUESTIONS, question_for, split_sentences

Split = Literal["train", "held_out"]
SPLITS: tuple[Split, ...] = ("train", "held_out")
HELD_OUT_PROBLEMS_PER_MILLE = 100  # 10 % of arithmetic problems and conversions are kept for evaluation
THINKING_EVERY = 5  # one dialogue in five thinks aloud before the call and before the answer
MULTI_TURN_EVERY = 3  # one dialogue in three of each kind comes after an exchange of the other kind

# operator -> (its symbol in the expression, the words a question may use instead)
OPERATORS: dict[str, tuple[str, tuple[str, ...]]] = {
    "+": ("+", ("plus", "added to")),
    "-": ("-", ("minus",)),
    "*": ("*", ("times", "multiplied by")),
    "/": ("/", ("divided by",)),
}
ARITHMETIC_QUESTIONS = (
    "What is {a} {op} {b}?",
    "Calculate {a} {op} {b}.",
    "How much is {a} {op} {b}?",
    "Compute {a} {op} {b}.",
    "What's {a} {op} {b}?",
    "Can you work out {a} {op} {b}?",
)


# (from_unit, to_unit) pairs a user asks about, in the words the tool's result uses
CONVERSIONS = (
    ("miles", "kilometers"), ("kilometers", "miles"), ("pounds", "kilograms"), ("kilograms", "pounds"),
    ("feet", "meters"), ("meters", "feet"), ("inches", "centimeters"), ("gallons", "liters"), ("liters", "gallons"),
    ("degrees Fahrenheit", "degrees Celsius"), ("degrees Celsius", "degrees Fahrenheit"), ("hours", "minutes"),
    ("ounces", "grams"), ("acres", "square meters"), ("megabytes", "kilobytes"),
)
CONVERSION_QUESTIONS = (
    "How many {to} is {value} {source}?",
    "Convert {value} {source} to {to}.",
    "What is {value} {source} in {to}?",
    "How much is {value} {source} in {to}?",
)


@dataclass(frozen=True)
class ArithmeticProblem:
    question: str
    expression: str
    key: str  # the problem with commutative operands sorted: what the held-out split hashes


@dataclass(frozen=True)
class Conversion:
    question: str
    arguments: dict  # convert_units' value, from_unit, to_unit
    key: str  # what the held-out split hashes


def is_held_out_article(article: WikiArticle) -> bool:
    """Held-out entities are exactly the default corpus's validation articles."""
    return is_validation(wiki_split_key(article))


def is_held_out_problem(problem: ArithmeticProblem | Conversion) -> bool:
    digest = hashlib.sha256(f"tool_dialogues\x00{problem.key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % 1000 < HELD_OUT_PROBLEMS_PER_MILLE


def arithmetic_problem(rng: random.Random) -> ArithmeticProblem:
    """One two-operand problem; divisions come out whole three times in four."""
    operator = rng.choice(list(OPERATORS))
    if operator == "*":
        a, b = rng.randint(2, 99), rng.randint(2, 99)
    elif operator == "/":
        b = rng.randint(2, 50)
        a = b * rng.randint(2, 50) if rng.random() < 0.75 else rng.randint(10, 999)
    else:
        a, b = rng.randint(1, 999), rng.randint(1, 999)
    symbol, words = OPERATORS[operator]
    spoken = symbol if rng.random() < 0.5 else rng.choice(words)
    question = rng.choice(ARITHMETIC_QUESTIONS).format(a=a, op=spoken, b=b)
    operands = sorted((a, b)) if operator in "+*" else [a, b]
    return ArithmeticProblem(question, f"{a} {symbol} {b}", f"{operands[0]} {operator} {operands[1]}")


def conversion(rng: random.Random) -> Conversion:
    """One unit question; values are whole numbers, or one decimal one time in four."""
    source, to = rng.choice(CONVERSIONS)
    value: int | float = rng.randint(1, 500) if rng.random() < 0.75 else rng.randint(1, 999) / 10
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # 5.0 is the problem 5 is: one key, one side of the split
    question = rng.choice(CONVERSION_QUESTIONS).format(value=value, source=source, to=to)
    return Conversion(question, {"value": value, "from_unit": source, "to_unit": to}, f"{value} {source} -> {to}")


def system_message() -> dict[str, str]:
    """Every built-in tool and no prompt text: what a chat model is given when the user sets no system prompt."""
    return {"role": "system", "content": "", "tools": json.dumps(tool_schemas(TOOLS), ensure_ascii=False)}


def _dialogue(question: str, tool: str, arguments: dict, answer_of, budget: ResultBudget,
              thinking: tuple[str, str] | None = None, may_fail: bool = False) -> dict | None:
    """The five-turn dialogue, or None when a lookup that ``may_fail`` does not come back; a generated calculation
    that fails is a bug in the generator, and it says so rather than silently leaving a problem out."""
    result = run_tool(tool, arguments, budget)
    if is_tool_error(result):
        if not may_fail:
            raise ValueError(f"the generated problem {question!r} fails: {tool}({arguments}) -> {result}")
        return None
    answer = answer_of(result)
    if not answer:
        return None
    call = {"role": "assistant", "content": "", "tool_calls": json.dumps([{"name": tool, "arguments": arguments}],
                                                                          ensure_ascii=False)}
    final = {"role": "assistant", "content": answer}
    if thinking is not None:
        call["reasoning_content"], final["reasoning_content"] = thinking
    return {"conversations": [system_message(), {"role": "user", "content": question}, call,
                              {"role": "tool", "content": result}, final]}


def first_sentence(result: str) -> str:
    """The answer to a lookup: the result's first whole sentence (never the cut tail of a truncated one)."""
    sentences = split_sentences(result)
    return sentences[0] if sentences and sentences[0].endswith((".", "!", "?")) else ""


def wiki_dialogue(article: WikiArticle, budget: ResultBudget | None = None, thinks: bool = False,
                  variant: int = 0) -> dict | None:
    """"What is X?" (the phrasing `variant` of dataset/wiki_qa.py's question_for) -> wiki(X) -> the summary -> its
    first sentence; None when the lookup does not come back whole (an ambiguous title, a first sentence longer than
    the budget)."""
    thinking = (f"The user asks about {article.title}. I will look it up.",
                "The article's first sentence answers the question.") if thinks else None
    return _dialogue(question_for(article, variant), "wiki", {"title": article.title}, first_sentence,
                     budget or ResultBudget(), thinking, may_fail=True)


def arithmetic_dialogue(problem: ArithmeticProblem, budget: ResultBudget | None = None,
                        thinks: bool = False) -> dict | None:
    """A question -> calculator(expression) -> the value -> "<expression> = <value>."."""
    thinking = (f"This is arithmetic: {problem.expression}. I will use the calculator.",
                "The calculator gave the value.") if thinks else None
    return _dialogue(problem.question, "calculator", {"expression": problem.expression},
                     lambda value: f"{problem.expression} = {value}.", budget or ResultBudget(), thinking)


def conversion_dialogue(problem: Conversion, budget: ResultBudget | None = None, thinks: bool = False) -> dict | None:
    """A unit question -> convert_units(value, from_unit, to_unit) -> "<value> <unit> = <value> <unit>" -> it, with a
    full stop."""
    thinking = (f"This converts {problem.arguments['from_unit']} to {problem.arguments['to_unit']}. I will use "
                "the converter.", "The converter gave the value.") if thinks else None
    return _dialogue(problem.question, "convert_units", problem.arguments, lambda result: f"{result}.",
                     budget or ResultBudget(), thinking)


MAX_PROBLEM_DRAWS = 2_000_000  # draws before a count is called more than the split holds (~8 s at worst)


class TooFewProblems(ValueError):
    """More distinct problems of one tool asked for than the split yields within MAX_PROBLEM_DRAWS; `available` is
    how many it did yield (with this seed), so a caller can name its own flag and the real maximum."""

    def __init__(self, tool: str, split: str, count: int, available: int) -> None:
        super().__init__(f"cannot draw {count} distinct {split} {tool} problems: at most {available}")
        self.tool, self.available = tool, available


def _distinct(split: Split, count: int, draw, make, tool: str) -> list[dict]:
    """``count`` dialogues ``make(problem)`` of distinct problems ``draw()`` on the split's side of the hash."""
    held_out = split == "held_out"
    seen: set[str] = set()
    dialogues: list[dict] = []
    attempts = 0
    while len(dialogues) < count:
        attempts += 1
        # A cap that does not depend on `count`: every count up to `available` is drawn, and no count above it.
        if attempts > MAX_PROBLEM_DRAWS:
            raise TooFewProblems(tool, split, count, len(dialogues))
        problem = draw()
        if problem.key in seen or is_held_out_problem(problem) != held_out:
            continue
        seen.add(problem.key)
        dialogue = make(problem)
        if dialogue is not None:
            dialogues.append(dialogue)
    return dialogues


def tool_dialogues(split: Split, seed: int, wiki_count: int, arithmetic_count: int, conversion_count: int = 0,
                   articles: Sequence[WikiArticle] | None = None, budget: ResultBudget | None = None,
                   questions_per_article: int = 1) -> list[dict]:
    """``wiki_count`` lookup dialogues, ``arithmetic_count`` calculator dialogues and ``conversion_count`` unit
    dialogues of one split, shuffled; fewer lookups when the split has fewer usable articles. Each article is asked
    about in ``questions_per_article`` phrasings (at most 7: people have 7). Deterministic in (split, seed, counts,
    articles, questions_per_article)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    if not 1 <= questions_per_article <= len(PERSON_QUESTIONS):
        raise ValueError(f"questions_per_article must be in 1..{len(PERSON_QUESTIONS)}, got {questions_per_article}")
    if min(wiki_count, arithmetic_count, conversion_count) < 0:
        raise ValueError(f"counts must be >= 0, got wiki_count={wiki_count}, arithmetic_count={arithmetic_count}, "
                         f"conversion_count={conversion_count}")
    held_out = split == "held_out"
    rng = random.Random(f"tool_dialogues\x00{split}\x00{seed}")
    budget = budget or ResultBudget()

    def thinks() -> bool:
        return rng.randrange(THINKING_EVERY) == 0

    pool = sorted((a for a in (read_wikipedia() if articles is None else articles)
                   if is_held_out_article(a) == held_out), key=lambda a: a.title)
    rng.shuffle(pool)
    dialogues: list[dict] = []
    for article, variant in ((a, v) for a in pool for v in range(questions_per_article)):
        if len(dialogues) == wiki_count:
            break
        dialogue = wiki_dialogue(article, budget, thinks(), variant)
        if dialogue is not None:
            dialogues.append(dialogue)
    dialogues += _distinct(split, arithmetic_count, lambda: arithmetic_problem(rng),
                           lambda problem: arithmetic_dialogue(problem, budget, thinks()), "calculator")
    dialogues += _distinct(split, conversion_count, lambda: conversion(rng),
                           lambda problem: conversion_dialogue(problem, budget, thinks()), "convert_units")
    rng.shuffle(dialogues)
    return dialogues


def small_talk_dialogues(split: Split, seed: int, count: int, dialogs: Sequence[Dialog] | None = None) -> list[dict]:
    """``count`` chit-chat conversations of one split (fewer when it has fewer) with every tool offered and none
    called: the system turn of the tool dialogues, then the conversation's opening window as the SFT files hold it,
    no two the same up to case and spacing. Held-out conversations are the corpus's validation dialogs.
    Deterministic in (split, seed, count, dialogs)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    held_out = split == "held_out"
    pool = sorted((d for d in (read_chitchat() if dialogs is None else dialogs)
                   if is_validation(dialog_split_key(d)) == held_out), key=dialog_split_key)
    random.Random(f"small_talk\x00{split}\x00{seed}").shuffle(pool)
    dialogues: list[dict] = []
    seen: set[str] = set()
    for dialog in pool:
        if len(dialogues) == count:
            break
        windows = dialog_windows(dialog.turns)
        text = normalized_text(conversation_text(windows[0])) if windows else ""
        if text and text not in seen:
            seen.add(text)
            dialogues.append({"conversations": [system_message(), *windows[0]]})
    return dialogues


def first_exchange(dialogue: dict) -> list[dict]:
    """A dialogue's first exchange after its system turn: the user message and everything up to the next one."""
    return split_exchanges(dialogue["conversations"][1:])[0]


def after_other_exchanges(tool_use: Sequence[dict], small_talk: Sequence[dict], seed: int,
                          every: int = MULTI_TURN_EVERY) -> tuple[list[dict], list[dict]]:
    """The two lists with one dialogue in ``every`` of each continuing a chat: a tool dialogue gets the first
    exchange of a small-talk dialogue before its question, a small-talk dialogue the exchange of a tool dialogue
    before its opening. The exchanges come from the other list (the same split), the system turn stays
    first; the rest is unchanged. Deterministic in (lists, seed, every)."""
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    if not tool_use or not small_talk:
        return list(tool_use), list(small_talk)
    rng = random.Random(f"after_other\x00{seed}")

    def continued(dialogues: Sequence[dict], others: Sequence[dict]) -> list[dict]:
        out = []
        for dialogue in dialogues:
            if rng.randrange(every) == 0:
                system, *rest = dialogue["conversations"]
                before = first_exchange(others[rng.randrange(len(others))])
                dialogue = {**dialogue, "conversations": [system, *before, *rest]}
            out.append(dialogue)
        return out

    return continued(tool_use, small_talk), continued(small_talk, tool_use)
