"""The scoring of tool-use replies (dataset/tool_scoring.py): the right call as the tool resolves it, the fact as a run
of the first sentence's words beyond the question's own, values as whole numbers, no call for small talk."""

from __future__ import annotations

from functools import partial

import pytest

from dataset.sources import Dialog
from dataset.tokenization import token_starts
from dataset.tool_dialogues import small_talk_dialogues, tool_dialogues
from dataset.tool_scoring import (SMALL_TALK, SPAN_WORDS, WRONG_CALLS, ToolQuestion, answer_has_fact, is_right_reply,
                                  where_call_goes_wrong)


@pytest.fixture(scope="module")
def questions() -> dict[str, ToolQuestion]:
    dialogues = tool_dialogues("held_out", seed=0, wiki_count=5, arithmetic_count=5, conversion_count=5)
    by_kind: dict[str, ToolQuestion] = {}
    for dialogue in dialogues:
        question = ToolQuestion.from_dialogue(dialogue)
        by_kind.setdefault(question.kind, question)
    return by_kind


def test_questions_keep_the_dialogue_call_result_and_fact(questions):
    wiki, calculator, units = questions["wiki"], questions["calculator"], questions["convert_units"]
    assert set(wiki.arguments) == {"title"} and wiki.result.startswith(wiki.fact) and wiki.fact.endswith(".")
    assert calculator.fact == calculator.result
    assert units.result.split(" = ")[1].startswith(units.fact + " ")
    float(units.fact)


def test_a_call_is_right_when_the_tool_resolves_it_to_the_same_result(questions):
    wiki, calculator = questions["wiki"], questions["calculator"]
    assert is_right_reply(wiki, [("wiki", wiki.arguments)])
    assert is_right_reply(wiki, [("wiki", {"title": wiki.arguments["title"].upper() + "!"})])  # the forgiving lookup
    assert not is_right_reply(wiki, [("calculator", {"expression": "1 + 1"})])
    assert not is_right_reply(wiki, [("wiki", {"title": "Eiffel Tower"})])
    assert not is_right_reply(wiki, [("calculator", {"expression": "1 + 1"}), ("wiki", wiki.arguments)])  # the first
    assert not is_right_reply(wiki, [])
    spaced = calculator.arguments["expression"]
    assert is_right_reply(calculator, [("calculator", {"expression": spaced.replace(" ", "")})])
    assert not is_right_reply(calculator, [("calculator", {"expression": spaced + " + 1"})])
    assert not is_right_reply(calculator, [("calculator", {"text": spaced})])  # bad arguments: an error result


def test_small_talk_is_right_without_a_call():
    dialogs = [Dialog("chitchat", str(i), ("Hi! How are you?", f"Fine, thanks ({i}).", "Good.")) for i in range(200)]
    dialogues = small_talk_dialogues("held_out", seed=0, count=3, dialogs=dialogs)
    assert len(dialogues) == 3  # 200 keys hold about 4 held-out ones
    same = [Dialog("chitchat", str(i), ("Hi! How are you?", "Fine.")) for i in range(200)]
    assert len(small_talk_dialogues("held_out", seed=0, count=3, dialogs=same)) == 1  # no opening twice
    (system, user, reply) = dialogues[0]["conversations"]
    assert "tools" in system and "tool_calls" not in reply and user == {"role": "user", "content": "Hi! How are you?"}
    question = ToolQuestion.from_dialogue(dialogues[0])
    assert (question.kind, question.question) == (SMALL_TALK, "Hi! How are you?")
    assert is_right_reply(question, []) and not is_right_reply(question, [("wiki", {"title": "Hi"})])
    assert not answer_has_fact(question, "Fine, thanks.")


def test_wiki_fact_is_a_run_of_the_first_sentence_beyond_the_question():
    question = ToolQuestion("wiki", "What is the Mirror Lake State Park?", {"title": "Mirror Lake"}, "",
                            "Mirror Lake State Park is a park in Wisconsin near the city of Baraboo.")
    assert answer_has_fact(question, question.fact)
    assert answer_has_fact(question, "It is a park in Wisconsin near the city, I read.")
    assert not answer_has_fact(question, "Mirror Lake State Park is a lake.")  # the question's own words
    assert not answer_has_fact(question, "The park in Wisconsin is nice.")  # SPAN_WORDS - 1 new words in a row
    assert answer_has_fact(question, "A park in Wisconsin near Baraboo")
    assert SPAN_WORDS == 4
    short = ToolQuestion("wiki", "What is X?", {"title": "X"}, "", "X is big.")
    assert answer_has_fact(short, "Well, x is big!") and not answer_has_fact(short, "X is large.")


def test_values_count_as_whole_numbers(questions):
    calculator = ToolQuestion("calculator", "What is 438 + 949?", {"expression": "438 + 949"}, "1387", "1387")
    assert answer_has_fact(calculator, "438 + 949 = 1387.")
    assert not answer_has_fact(calculator, "438 + 949 = 13870.")
    assert not answer_has_fact(calculator, "It is 21387.")
    decimal = ToolQuestion("calculator", "", {}, "2.5", "2.5")
    assert answer_has_fact(decimal, "5 / 2 = 2.5") and not answer_has_fact(decimal, "12.5") \
        and not answer_has_fact(decimal, "2.55")


def _first_changed(text: str) -> str:
    """`text` with another first character: a digit for a digit, else "Q"."""
    first = ("9" if text[0] != "9" else "8") if text[0].isdigit() else "Q"
    return first + text[1:]


@pytest.mark.parametrize("tokens", ["characters", "model"])
def test_a_wrong_call_is_placed_at_the_copied_arguments_first_token_or_later(questions, tokenizer, tokens):
    tokenize = (lambda text: [(ord(c), i) for i, c in enumerate(text)]) if tokens == "characters" else \
        partial(token_starts, tokenizer)
    wiki, calculator, units = questions["wiki"], questions["calculator"], questions["convert_units"]
    where = lambda question, calls: where_call_goes_wrong(question, calls, tokenize)  # noqa: E731
    assert where(wiki, [("wiki", wiki.arguments)]) is None and where(wiki, []) == "no call"
    assert where(wiki, [("calculator", calculator.arguments)]) == "another tool"
    title = wiki.arguments["title"]
    assert where(wiki, [("wiki", {"title": _first_changed(title)})]) == "first token"  # "Qereford cattle"
    assert where(wiki, [("wiki", {"title": title + " Qq"})]) == "later token"
    expression = calculator.arguments["expression"]
    assert where(calculator, [("calculator", {"expression": _first_changed(expression)})]) \
        == "first token"
    assert where(calculator, [("calculator", {"expression": expression + " + 1"})]) == "later token"
    value = str(units.arguments["value"])
    assert where(units, [("convert_units", {**units.arguments, "value": float(_first_changed(value))})]) \
        == "first token"  # 326 -> 926
    assert where(units, [("convert_units", {**units.arguments, "value": float(value + "1")})]) == "later token"
    other_unit = "miles" if units.arguments["to_unit"] != "miles" else "feet"
    assert where(units, [("convert_units", {**units.arguments, "to_unit": other_unit})]) == "another argument"
    small_talk = ToolQuestion(SMALL_TALK, "Hi!", {}, "", "")
    assert where(small_talk, []) is None and where(small_talk, [("wiki", {"title": "Hi"})]) == "another tool"
    # a reply that opened a call that read as none: no tool ran, and it is no right reply (it was "no call", and
    # small talk answered so was right)
    assert where_call_goes_wrong(wiki, [], tokenize, unreadable=True) == "unreadable call"
    assert where_call_goes_wrong(small_talk, [], tokenize, unreadable=True) == "unreadable call"
    assert not is_right_reply(small_talk, [], unreadable=True)
    assert set(WRONG_CALLS) == {"no call", "unreadable call", "another tool", "first token", "later token",
                                "another argument"}


@pytest.mark.parametrize("answer, found", [
    ("It is 5.", True), ("5", True), ("It is 5, I think.", True), ("(5)", True), ("x=5!", True),
    ("It is 5.5.", False), ("It is -5.", False), ("It is 5,000.", False), ("It is 2.5", False), ("15", False),
    ("It is \u22125.", False),
])
def test_a_value_is_found_only_as_that_whole_number(answer, found):
    """'5' is not in '5.5', '-5' or '5,000': a decimal point or a thousands separator before a digit, or a minus
    sign, make another number; a sentence's full stop or comma after it do not."""
    question = ToolQuestion("calculator", "What is 2 + 3?", {"expression": "2 + 3"}, "5", "5")
    assert answer_has_fact(question, answer) is found


def test_tool_eval_counts_a_reply_that_opened_a_call_it_never_wrote_right(tokenizer):
    """A 30-step SFT model began every reply with a broken `<tool_call>{": "arguments"...`: tool_eval.py showed
    "called a tool 0.0%" and its small talk "right call 100.0% (none)"."""
    from eval.tool_eval import ask, table
    from model.chat_session import Reply, ToolRound

    class OneReply:  # the chat session's surface ask() uses: what the model said, as the tool loop read it back
        def __init__(self, unread: int) -> None:
            self.history: list[dict] = []
            self.unread = unread

        def reset(self) -> None:
            self.history = []

        def reply(self, text: str) -> Reply:
            content = '<tool_call>{": "arguments"' if self.unread else "Fine, thanks."
            return Reply(text=content, new_tokens=5, seconds=0.1, stopped_at_eos=True, token_ids=[],
                         rounds=[ToolRound("", content, [], [], self.unread)], fit=None)

    tokenize = partial(token_starts, tokenizer)
    small_talk = ToolQuestion(SMALL_TALK, "Hi!", {}, "", "")
    lookup = ToolQuestion("wiki", "Who was X?", {"title": "X"}, "X is a y.", "X is a y.")
    outcomes = [ask(OneReply(unread), question, [], tokenize) for question in (small_talk, lookup)
                for unread in (1, 0)]
    assert [(o.unreadable_call, o.right_call, o.wrong_at) for o in outcomes] == [
        (True, False, "unreadable call"), (False, True, None), (True, False, "unreadable call"),
        (False, False, "no call")]
    rows = {row["tool"]: row for row in table(outcomes)}
    assert (rows[SMALL_TALK]["unreadable_call"], rows[SMALL_TALK]["right_call"]) == (0.5, 0.5)
    assert (rows["wiki"]["unreadable_call"], rows["wiki"]["called_a_tool"]) == (0.5, 0.0)
