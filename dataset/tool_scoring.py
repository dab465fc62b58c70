"""How a model's reply to a tool-use question is scored against the generated dialogue it was asked from.

Two questions per reply (eval/tool_eval.py prints them as a table):

- the right call: the model's first tool call names the dialogue's tool, and running it gives the dialogue's tool
  result (so "eiffel tower" for "Eiffel Tower" or "438+949" for "438 + 949" count, as the tool resolves them);
- the fact in the final answer: for ``wiki``, a run of ``SPAN_WORDS`` consecutive words of the summary's first sentence
  (all of them when it has fewer), both texts read without the words the question already holds (so the title and
  "is a" do not make a fact: "Tikal is the ruin of an ancient city" counts through "ruin of an ancient"); for
  ``calculator`` and
  ``convert_units``, the tool's value as a whole number in the answer (``1387`` in "438 + 949 = 1387.", not in
  "13870", "1387.5", "-1387" or "1,387,000").

Small talk (a chit-chat opening with every tool offered, ``SMALL_TALK``) is right when the model calls nothing; it
has no fact to find. A reply that opens a call (its ``<tool_call>`` token) that does not read as one (no closer, or
not a name and JSON arguments) made an *unreadable call*: no tool ran, and it is no right reply, to small talk either.

Where a wrong call goes wrong (``where_call_goes_wrong``): no call, an unreadable call, another tool, or the argument
copied from the question (``COPIED_ARGUMENT``) wrong from its first token or only later, or that argument right and
another wrong.
The first token has its own place because the measured wrong calls gather there and at other copies whose token
has no cue in the question (docs/tools.md, "Where the calls go wrong").
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dataset.tools import run_tool

SMALL_TALK = "small_talk"  # the kind of a question whose right reply calls no tool
SPAN_WORDS = 4  # a run this long of the first sentence's new words is a fact, not a coincidence of common words
_WORD = re.compile(r"\w+")
COPIED_ARGUMENT = {"wiki": "title", "calculator": "expression", "convert_units": "value"}  # what the question holds
WRONG_CALLS = ("no call", "unreadable call", "another tool", "first token", "later token", "another argument")


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


def is_right_reply(question: ToolQuestion, calls: Sequence[tuple[str, Mapping[str, Any]]],
                   unreadable: bool = False) -> bool:
    """Whether the reply's calls, ``(name, arguments)`` in order, are right: its first call is the question's tool with
    an argument that gives the question's result, or, for small talk, it makes none, and no unreadable one
    (`unreadable`: the reply opened a call that read as none)."""
    if question.kind == SMALL_TALK:
        return not calls and not unreadable
    if not calls:
        return False
    name, arguments = calls[0]
    return name == question.kind and run_tool(name, dict(arguments)) == question.result


def _whole_number(fact: str) -> re.Pattern:
    """`fact` as a number of its own: no digit, decimal point or minus sign (ASCII or U+2212) right before it, and
    no digit right after it, nor a decimal point or thousands separator followed by one ("5" is not in "5.5", "-5"
    or "5,000"; it is in "It is 5." and "5, then")."""
    return re.compile(rf"(?<![\d.\-\u2212]){re.escape(fact)}(?!\d|[.,]\d)")


def answer_has_fact(question: ToolQuestion, answer: str) -> bool:
    """Whether `answer` holds the question's fact (see the module's docstring); small talk has none."""
    if question.kind == SMALL_TALK:
        return False
    if question.kind != "wiki":
        return _whole_number(question.fact).search(answer) is not None
    asked = set(_words(question.question))
    sentence = [word for word in _words(question.fact) if word not in asked]
    length = min(SPAN_WORDS, len(sentence))
    if length == 0:
        return False
    return bool(_runs(sentence, length) & _runs([word for word in _words(answer) if word not in asked], length))


def where_call_goes_wrong(question: ToolQuestion, calls: Sequence[tuple[str, Mapping[str, Any]]],
                          tokenize: Callable[[str], Sequence[tuple[int, int]]], unreadable: bool = False) -> str | None:
    """None for a right reply (``is_right_reply``); else one of WRONG_CALLS for the first call (small talk with a
    call: ``another tool``; a reply whose only call did not read, `unreadable`: ``unreadable call``). For the copied
    argument, ``tokenize(text)`` gives each token of ``{"<name>": <value>}``
    as JSON as (token id, the offset of its first character): ``first token`` when the tokens already differ at the
    one that holds the value's first character (or before it), ``later token`` when they differ after it,
    ``another argument`` when the copied argument is right and another is wrong."""
    if is_right_reply(question, calls, unreadable):
        return None
    if not calls:
        return "unreadable call" if unreadable else "no call"
    name, arguments = calls[0]
    if name != question.kind:
        return "another tool"
    key = COPIED_ARGUMENT[name]
    wanted, given = question.arguments[key], arguments.get(key)
    if given == wanted:
        return "another argument"
    # the value's first character: after '{"key": ' and, for a string, its opening quote
    value_start = len(json.dumps({key: None})) - len("null}") + isinstance(wanted, str)
    wanted_tokens = list(tokenize(json.dumps({key: wanted}, ensure_ascii=False)))
    given_ids = [token for token, _ in tokenize(json.dumps({key: given}, ensure_ascii=False))]
    differs = next((i for i, (token, _) in enumerate(wanted_tokens) if i >= len(given_ids) or given_ids[i] != token),
                   len(wanted_tokens))
    if differs == len(wanted_tokens):  # the given value goes on after the wanted one
        return "later token"
    return "first token" if wanted_tokens[differs][1] <= value_start else "later token"
