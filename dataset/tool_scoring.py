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

Small talk (a chit-chat opening with every tool offered, ``SMALL_TALK``) is right when the model calls nothing; it
has no fact to find.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dataset.tools import run_tool

SMALL_TALK = "small_talk"  # the kind of a question whose right reply calls no tool
SPAN_WORDS = 4  # a run this long of the first sentence's new words is a fact, not a coincidence of common words
_WORD = re.compile(r"\w+")


@dataclass(frozen=True)
class ToolQuestion:
    """A held-out question and what a right reply does: call ``tool`` with ``arguments`` (which returns ``result``)
    and answer with ``fact`` in it."""

    kind: str  # the tool's name, or SMALL_TALK
    question: str
    arguments: dict
    result: str
    fact: str  # wiki: the first sentence; calculator, convert_units: the value

    @classmethod
    def from_dialogue(cls, dialogue: Mapping[str, Any]) -> ToolQuestion:
        """The question of a dataset.tool_dialogues dialogue: system, user, call, tool result, answer; or system, user,
        assistant, ... (small talk: the first user turn is the question)."""
        conversation = dialogue["conversations"]
        if not any("tool_calls" in message for message in conversation):
            return cls(SMALL_TALK, conversation[1]["content"], {}, "", "")
        _, user, call, tool, answer = conversation
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


def is_right_reply(question: ToolQuestion, calls: Sequence[tuple[str, Mapping[str, Any]]]) -> bool:
    """Whether the reply's calls, ``(name, arguments)`` in order, are right: its first call is the question's tool with
    an argument that gives the question's result, or, for small talk, it makes none."""
    if question.kind == SMALL_TALK:
        return not calls
    if not calls:
        return False
    name, arguments = calls[0]
    return name == question.kind and run_tool(name, dict(arguments)) == question.result


def answer_has_fact(question: ToolQuestion, answer: str) -> bool:
    if question.kind == SMALL_TALK:
        return False
    if question.kind != "wiki":
        return re.search(rf"(?<![\d.]){re.escape(question.fact)}(?![\d])", answer) is not None
    asked = set(_words(question.question))
    sentence = [word for word in _words(question.fact) if word not in asked]
    length = min(SPAN_WORDS, len(sentence))
    if length == 0:
        return False
    return bool(_runs(sentence, length) & _runs([word for word in _words(answer) if word not in asked], length))
