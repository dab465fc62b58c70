"""Arithmetic word problems: the embedded, verifiable task of the default pipeline pretrain -> SFT -> GRPO.

Problem i of a seed is drawn from its own `random.Random(f"{seed}:{i}")`, so the stream is the same on every
machine and any problem can be regenerated alone. Four kinds, small numbers (a tiny model has to be able to learn
them): addition, subtraction (never below zero), multiplication (one-digit factors) and a two-step
add-then-subtract. Each problem has a worked solution ending in "The answer is N." (what `math_answer`'s
final-number rule reads) and a split key made of its kind and numbers only: the held-out problems' arithmetic never
appears in training under another name or item, so the held-out accuracy measures arithmetic, not recall.

Rows: the SFT conversation (user: question, assistant: worked solution; MiniMind's format) and the RL prompt row
`{"prompt": question, "answer": N}` that `trainer/train_grpo.py` and `trainer/rewards.py`'s `math_answer` read.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from dataclasses import dataclass

DEFAULT_SEED = 0
SPLIT_NAMESPACE = "arithmetic"
HELD_OUT_PER_MILLE = 100  # the share of the distinct arithmetic (kind, numbers) kept for evaluation
MAX_FRUITLESS_DRAWS = 100_000  # draws in a row without a new problem before the stream is judged exhausted
# How the default data uses the stream: the first SFT_PROBLEMS training-side problems teach the format in SFT
# (dataset/corpus.py), the next RL_PROBLEMS are GRPO's prompts (dataset/post_training_data.py); the first
# HELD_OUT_PROBLEMS held-out ones are GRPO's evaluation set, and the first SFT_VAL_PROBLEMS of those join sft_val.
SFT_PROBLEMS = 3000
RL_PROBLEMS = 5000
HELD_OUT_PROBLEMS = 300
SFT_VAL_PROBLEMS = 60

NAMES = ("Anna", "Ben", "Chen", "Dara", "Emil", "Fatima", "Hugo", "Ines", "Jonas", "Kemal", "Lena", "Mateo",
         "Nora", "Omar", "Priya", "Sam")
ITEMS = ("apple", "book", "coin", "pencil", "marble", "card", "cookie", "shell", "stamp", "ticket", "egg", "flower")


@dataclass(frozen=True)
class Problem:
    kind: str          # add | sub | mul | add_sub
    numbers: tuple[int, ...]
    question: str
    solution: str      # the worked answer, ending "The answer is N."
    answer: int
    split_key: str     # the kind and the numbers: what decides train or held-out

    def conversation(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": self.question}, {"role": "assistant", "content": self.solution}]

    def prompt_row(self) -> dict[str, object]:
        return {"prompt": self.question, "answer": self.answer}


def problem(index: int, seed: int = DEFAULT_SEED) -> Problem:
    """Problem `index` of the stream of `seed`."""
    rng = random.Random(f"{seed}:{index}")
    kind = rng.choice(("add", "sub", "mul", "add_sub"))
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    items = item + "s"
    if kind == "add":
        a, b = rng.randint(2, 50), rng.randint(2, 50)
        numbers, answer = (a, b), a + b
        question = f"{name} has {a} {items} and gets {b} more. How many {items} does {name} have now?"
        steps = f"{a} + {b} = {answer}."
    elif kind == "sub":
        a = rng.randint(5, 60)
        b = rng.randint(1, a - 1)
        numbers, answer = (a, b), a - b
        question = f"{name} had {a} {items} and gave {b} away. How many {items} are left?"
        steps = f"{a} - {b} = {answer}."
    elif kind == "mul":
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        numbers, answer = (a, b), a * b
        question = f"{name} buys {a} boxes with {b} {items} in each. How many {items} is that?"
        steps = f"{a} x {b} = {answer}."
    else:
        a, b = rng.randint(2, 30), rng.randint(2, 30)
        c = rng.randint(1, a + b - 1)
        numbers, answer = (a, b, c), a + b - c
        question = f"{name} has {a} {items}, buys {b} more and then gives {c} away. How many {items} are left?"
        steps = f"{a} + {b} = {a + b}, and {a + b} - {c} = {answer}."
    split_key = f"{SPLIT_NAMESPACE}\x00{kind}\x00" + ",".join(map(str, numbers))
    return Problem(kind=kind, numbers=numbers, question=question, solution=f"{steps} The answer is {answer}.",
                   answer=answer, split_key=split_key)


def is_held_out(split_key: str) -> bool:
    """Deterministic assignment of a problem's arithmetic to the held-out side (HELD_OUT_PER_MILLE of them)."""
    digest = hashlib.sha256(split_key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % 1000 < HELD_OUT_PER_MILLE


def problems(count: int, held_out: bool, seed: int = DEFAULT_SEED) -> Iterator[Problem]:
    """The first `count` problems of the stream on one side of the split, each arithmetic (kind and numbers)
    once. ValueError when the stream cannot give that many (the kinds hold about 30,000 distinct ones)."""
    seen: set[str] = set()
    index = fruitless = 0
    while fruitless < MAX_FRUITLESS_DRAWS:
        candidate = problem(index, seed)
        index += 1
        if is_held_out(candidate.split_key) != held_out or candidate.split_key in seen:
            fruitless += 1
            continue
        fruitless = 0
        seen.add(candidate.split_key)
        yield candidate
        if len(seen) == count:
            return
    raise ValueError(f"count={count} is not allowed: the stream gave only {len(seen)} distinct "
                     f"{'held-out' if held_out else 'training'} problems")


def sft_problems() -> tuple[list[Problem], list[Problem]]:
    """(training, held-out) problems of the default SFT data."""
    return list(problems(SFT_PROBLEMS, held_out=False)), list(problems(SFT_VAL_PROBLEMS, held_out=True))


def rl_problems() -> tuple[list[Problem], list[Problem]]:
    """(training, held-out) problems of the default RL data: training prompts SFT has not seen."""
    train = list(problems(SFT_PROBLEMS + RL_PROBLEMS, held_out=False))[SFT_PROBLEMS:]
    return train, list(problems(HELD_OUT_PROBLEMS, held_out=True))
