"""How a model's reply to a tool-use question is scored against the generated dialogue it was asked from.

Two questions per reply (eval/tool_eval.py prints them as a table):

- the right call: the model's first tool call names the dialogue's tool, and running it gives the dialogue's tool
  result (so "eiffel tower" for "Eiffel Tower" or "438+949" for "438 + 949" count, as the tool resolves them);
- the fact in the final answer: for ``wiki``, a run of ``SPAN_WORDS`` consecutive words of the summary's first sentence
  (all of them when it has fewer), both texts read without the words the question already holds (so the title and
  "is a" do not make a fact: "Tikal is the ruin of an ancient city" counts through "ruin of an ancient"); for
  ``calculator`` and
  ``convert_units``, the tool's value as a whole number in the answer (``1387`` in "438 + 949 = 1387.", not in
  "13870").
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dataset.tools import run_tool

SPAN_WORDS = 4  # a run this long of the first sentence's new words is a fact, not a coincidence of common words
_WORD = re.compile(r"\w+")


@dataclass(frozen=True)
class ToolQuestion:
    """A held-out question and what a right reply does: call ``tool`` with ``arguments`` (which returns ``result``)
    and answer with ``fact`` in it."""

    kind: str  # the tool's name
    question: str
    arguments: dict
    result: str
    fact: str  # wiki: the first sentence; calculator, convert_units: the value

    @classmethod
    def from_dialogue(cls, dialogue: Mapping[str, Any]) -> ToolQuestion:
        """The question of a dataset.tool_dialogues dialogue: system, user, call, tool result, answer."""
        _, user, call, tool, answer = dialogue["conversations"]
        (first,) = json.loads(call["tool_calls"])
        kind = first["name"]
        if kind == "wiki":
            fact = answer["content"]
        elif kind == "calculator":
            fact = tool["content"]
        else:  # convert_units: "5 miles = 8.04672 kilometers"
            fact = tool["content"].split(" = ", 1)[1].split(" ", 1)[0]
        return cls(kind, user["content"], first["arguments"], tool["content"], fact)


def _words(text: str) -> list[str]:
    return _WORD.findall(text.casefold())


def _runs(words: Sequence[str], length: int) -> set[tuple[str, ...]]:
    return {tuple(words[i:i + length]) for i in range(len(words) - length + 1)}


def is_right_call(question: ToolQuestion, name: str, arguments: Mapping[str, Any]) -> bool:
    return name == question.kind and run_tool(name, dict(arguments)) == question.result


def answer_has_fact(question: ToolQuestion, answer: str) -> bool:
    if question.kind != "wiki":
        return re.search(rf"(?<![\d.]){re.escape(question.fact)}(?![\d])", answer) is not None
    asked = set(_words(question.question))
    sentence = [word for word in _words(question.fact) if word not in asked]
    length = min(SPAN_WORDS, len(sentence))
    if length == 0:
        return False
    return bool(_runs(sentence, length) & _runs([word for word in _words(answer) if word not in asked], length))
