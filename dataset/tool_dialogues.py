"""Deterministic tool-use dialogues in MiniMind's SFT format, for teaching a small model to look up and compute.

Each dialogue is ``{"conversations": [system, user, assistant call, tool, assistant answer]}``:

- the system message carries the offered tools' schemas as a JSON string in ``tools`` (as MiniMind's data does);
- the assistant's first message has empty content and ``tool_calls``, a JSON string
  ``[{"name": ..., "arguments": {...}}]``;
- the ``tool`` message holds what ``run_tool`` returns for that call (cut to the result budget);
- the final answer is taken from the tool result: the summary's first sentence, or ``<expression> = <result>``.

Two kinds: "What is X?" -> ``wiki(X)`` over the embedded Wikipedia summaries, and arithmetic questions (in symbols or
words) -> ``calculator``. Held-out entities are the corpus's own validation articles (so they appear nowhere in
training: not in pretraining text, not in the QA SFT data, not here); held-out problems are chosen by a hash of the
problem with its operands in canonical order, so "3 + 5" and "5 + 3" fall on the same side. The same seed gives the
same dialogues.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from dataset.corpus import is_validation, wiki_split_key
from dataset.sources import WikiArticle, read_wikipedia
from dataset.tools import ResultBudget, is_tool_error, run_tool, tool_schemas
from dataset.wiki_qa import question_for, split_sentences

Split = Literal["train", "held_out"]
SPLITS: tuple[Split, ...] = ("train", "held_out")
DIALOGUE_TOOLS = ("wiki", "calculator")  # the tools every generated system turn offers
TOOL_SYSTEM_PROMPT = "You are a helpful assistant. Use the tools to look facts up and to calculate."
HELD_OUT_PROBLEMS_PER_MILLE = 100  # 10 % of arithmetic problems are kept for evaluation

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


@dataclass(frozen=True)
class ArithmeticProblem:
    question: str
    expression: str
    key: str  # the problem with commutative operands sorted: what the held-out split hashes


def is_held_out_article(article: WikiArticle) -> bool:
    """Held-out entities are exactly the default corpus's validation articles."""
    return is_validation(wiki_split_key(article))


def is_held_out_problem(problem: ArithmeticProblem) -> bool:
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


def system_message(tool_names: Sequence[str] = DIALOGUE_TOOLS) -> dict[str, str]:
    return {"role": "system", "content": TOOL_SYSTEM_PROMPT,
            "tools": json.dumps(tool_schemas(tool_names), ensure_ascii=False)}


def _dialogue(question: str, tool: str, arguments: dict, answer_of, budget: ResultBudget) -> dict | None:
    result = run_tool(tool, arguments, budget)
    if is_tool_error(result):
        return None
    answer = answer_of(result)
    if not answer:
        return None
    call = json.dumps([{"name": tool, "arguments": arguments}], ensure_ascii=False)
    return {"conversations": [
        system_message(),
        {"role": "user", "content": question},
        {"role": "assistant", "content": "", "tool_calls": call},
        {"role": "tool", "content": result},
        {"role": "assistant", "content": answer},
    ]}


def first_sentence(result: str) -> str:
    """The answer to a lookup: the result's first whole sentence (never the cut tail of a truncated one)."""
    sentences = split_sentences(result)
    return sentences[0] if sentences and sentences[0].endswith((".", "!", "?")) else ""


def wiki_dialogue(article: WikiArticle, budget: ResultBudget | None = None) -> dict | None:
    """"What is X?" -> wiki(X) -> the summary -> its first sentence; None when the lookup does not come back whole
    (an ambiguous title, a first sentence longer than the budget)."""
    return _dialogue(question_for(article), "wiki", {"title": article.title}, first_sentence, budget or ResultBudget())


def arithmetic_dialogue(problem: ArithmeticProblem, budget: ResultBudget | None = None) -> dict | None:
    """A question -> calculator(expression) -> the value -> "<expression> = <value>."."""
    return _dialogue(problem.question, "calculator", {"expression": problem.expression},
                     lambda value: f"{problem.expression} = {value}.", budget or ResultBudget())


def tool_dialogues(split: Split, seed: int, wiki_count: int, arithmetic_count: int,
                   articles: Sequence[WikiArticle] | None = None, budget: ResultBudget | None = None) -> list[dict]:
    """``wiki_count`` lookup dialogues and ``arithmetic_count`` calculator dialogues of one split, shuffled; fewer
    lookups when the split has fewer usable articles. Deterministic in (split, seed, counts, articles)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    if wiki_count < 0 or arithmetic_count < 0:
        raise ValueError(f"counts must be >= 0, got wiki_count={wiki_count}, arithmetic_count={arithmetic_count}")
    held_out = split == "held_out"
    rng = random.Random(f"tool_dialogues\x00{split}\x00{seed}")
    pool = sorted((a for a in (read_wikipedia() if articles is None else articles)
                   if is_held_out_article(a) == held_out), key=lambda a: a.title)
    rng.shuffle(pool)
    dialogues: list[dict] = []
    for article in pool:
        if len(dialogues) == wiki_count:
            break
        dialogue = wiki_dialogue(article, budget)
        if dialogue is not None:
            dialogues.append(dialogue)
    seen: set[str] = set()
    attempts = 0
    arithmetic: list[dict] = []
    while len(arithmetic) < arithmetic_count:
        attempts += 1
        if attempts > 100 * (arithmetic_count + 10):
            raise ValueError(f"cannot draw {arithmetic_count} distinct {split} arithmetic problems")
        problem = arithmetic_problem(rng)
        if problem.key in seen or is_held_out_problem(problem) != held_out:
            continue
        seen.add(problem.key)
        dialogue = arithmetic_dialogue(problem, budget)
        if dialogue is not None:
            arithmetic.append(dialogue)
    dialogues += arithmetic
    rng.shuffle(dialogues)
    return dialogues
