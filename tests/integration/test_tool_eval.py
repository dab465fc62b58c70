"""eval/tool_eval.py on a tiny model that has memorised the tool dialogues of a few held-out questions and one small
talk (tests/tool_model.py's tool_eval_rows, in the model the tool tests share): asked those questions it makes the right
calls and answers with the facts (every rate 100%) and answers the small talk without a call; asked other held-out
questions it makes no right call (0%, each counted where it goes wrong, alike in the outcomes and the counts; where each
kind of wrong call goes wrong is tested in tests/unit/test_tool_scoring.py). With --after_other each question comes
after an exchange of the other kind, which the model memorised too. The JSON report holds each transcript."""

from __future__ import annotations

import json
import re

import pytest

from dataset.chat_format import normalize_messages
from dataset.tool_dialogues import small_talk_dialogues, tool_dialogues

pytestmark = pytest.mark.usefixtures("one_thread")

COUNTS = ["--wiki", "1", "--arithmetic", "1", "--conversions", "1", "--small_talk", "1"]


def run(model, tmp_path, *flags: str) -> dict:
    from eval import tool_eval

    report = tmp_path / "tools.json"
    assert tool_eval.main(["--model_path", str(model), *COUNTS, "--threads", "1", "--json", str(report),
                           *flags]) == 0
    return json.loads(report.read_text(encoding="utf-8"))


def test_memorised_questions_score_every_call_and_fact(tool_model, tmp_path, capsys):
    report = run(tool_model, tmp_path)
    rows = {row["tool"]: row for row in report["table"]}
    assert set(rows) == {"wiki", "calculator", "convert_units", "all", "small_talk"}
    talk = rows.pop("small_talk")
    assert (talk["called_a_tool"], talk["right_call"], talk["fact_in_answer"]) == (0.0, 1.0, None)
    for row in rows.values():
        assert (row["called_a_tool"], row["right_call"], row["fact_in_answer"]) == (1.0, 1.0, 1.0), row
    assert [len(outcome["calls"]) for outcome in report["outcomes"]] == [1, 1, 1, 0]
    assert [outcome["wrong_at"] for outcome in report["outcomes"]] == [None] * 4
    assert all(n == 0 for counts in report["wrong_calls"].values() for n in counts.values())
    # every answer ended its turn (the cut ones: test_answers_cut_by_max_new_tokens_count_as_never_ended)
    assert [row["never_ended"] for row in report["table"]] == [0.0] * 5
    assert all(outcome["ended"] for outcome in report["outcomes"])
    table = capsys.readouterr().out
    assert "right call" in table and "100.0%" in table and "100.0% (none)" in table


def test_other_held_out_questions_get_no_right_call(tool_model, tmp_path, capsys):
    report = run(tool_model, tmp_path, "--seed", "1")
    assert {row["tool"]: row["right_call"] for row in report["table"]}["all"] == 0.0
    # How a memorised model goes wrong on questions it never saw is its own (a lookup opened that reads as none on one
    # CPU, no call at all on another: the last bits of its products differ; small talk it never saw may get a call or
    # not); what the report must hold is where each goes wrong, told alike in the outcomes and in the counts, the
    # unreadable flag where the call does not read, and small talk right exactly where it made no call at all
    outcomes = report["outcomes"]
    assert sorted(o["kind"] for o in outcomes[:3]) == ["calculator", "convert_units", "wiki"]
    assert outcomes[3]["kind"] == "small_talk"
    assert all(o["wrong_at"] is not None for o in outcomes[:3])
    talk = outcomes[3]
    assert talk["right_call"] == (talk["wrong_at"] is None) == (not talk["calls"] and not talk["unreadable_call"])
    assert all(o["unreadable_call"] == (o["wrong_at"] == "unreadable call") for o in outcomes)
    assert {kind: {where: n for where, n in counts.items() if n} for kind, counts in report["wrong_calls"].items()} \
        == {o["kind"]: {o["wrong_at"]: 1} for o in outcomes[:3]}
    assert "wrong calls, by where they go wrong" in capsys.readouterr().out


def test_after_other_each_question_comes_after_an_exchange_of_the_other_kind(tool_model, tmp_path, capsys):
    report = run(tool_model, tmp_path, "--after_other")
    for row in report["table"]:
        assert row["right_call"] == 1.0 and row["fact_in_answer"] in (1.0, None), row
    (talk,) = small_talk_dialogues("held_out", 0, 1)
    first_tool = tool_dialogues("held_out", 0, 1, 1, 1)[0]
    tools_before = [normalize_messages(talk["conversations"])[1:3]] * 3
    talk_before = [normalize_messages(first_tool["conversations"])[1:]]
    assert [outcome["before"] for outcome in report["outcomes"]] == tools_before + talk_before
    talk = normalize_messages(talk["conversations"])
    assert report["outcomes"][-1]["answer"].strip() == talk[4]["content"].strip() != talk[2]["content"].strip()
    # the transcript shows the earlier call as JSON, as the report holds it (it printed Python's repr of the list)
    shown = [line.split(": ", 1)[1] for line in capsys.readouterr().out.splitlines()
             if line.startswith("  before, assistant: ")]
    (call,) = [message for message in talk_before[0] if message.get("tool_calls")]
    assert json.dumps(call["tool_calls"], ensure_ascii=False) in shown, shown


def test_negative_counts_are_refused(tool_model, capsys):
    from eval import tool_eval

    with pytest.raises(SystemExit) as exit_info:  # the flags' own type: before the model loads
        tool_eval.main(["--model_path", str(tool_model), "--wiki", "-1"])
    assert exit_info.value.code == 2 and "argument --wiki: -1 is not an integer >= 0" in capsys.readouterr().err


def test_after_other_without_small_talk_is_refused(tool_model, capsys):
    from eval import tool_eval

    assert tool_eval.main(["--model_path", str(tool_model), "--small_talk", "0", "--after_other"]) != 0
    assert "--after_other needs small talk and tool questions" in capsys.readouterr().err


def test_penalties_reach_the_decoding(tool_model, tmp_path, capsys):
    """transformers' repetition penalty counts the prompt too: dividing the logits of every prompt token by 100
    breaks the memorised calls, which copy their argument from the question."""
    report = run(tool_model, tmp_path, "--repetition_penalty", "100")
    assert report["decoding"] == {"repetition_penalty": 100.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
    assert {row["tool"]: row["right_call"] for row in report["table"]}["all"] < 1.0
    assert "greedy, repetition_penalty 100\n" in capsys.readouterr().out


@pytest.mark.parametrize("flag, value, message", [("--frequency_penalty", "2.5", "2.5 is outside -2 .. 2"),
                                                  ("--presence_penalty", "nan", "nan is outside -2 .. 2"),
                                                  ("--repetition_penalty", "0", "0 is outside 1e-05 .. 100000"),
                                                  ("--repetition_penalty", "x", "'x' is not a number")])
def test_penalties_out_of_range_are_refused_in_one_line(tool_model, capsys, flag, value, message):
    from eval import tool_eval

    with pytest.raises(SystemExit) as exit_:
        tool_eval.main(["--model_path", str(tool_model), flag, value])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[0] == f"error: argument {flag}: {message}"


def test_answers_cut_by_max_new_tokens_count_as_never_ended(tool_model, tmp_path):
    """The same questions, whose answers end their turns uncut (test_memorised_questions_score_every_call_and_fact),
    each cut at 3 tokens."""
    cut = run(tool_model, tmp_path, "--max_new_tokens", "3")
    assert [row["never_ended"] for row in cut["table"]] == [1.0] * 5
    assert not any(outcome["ended"] for outcome in cut["outcomes"])


def test_the_table_counts_unended_answers_and_repeated_trigrams_by_hand():
    from eval.tool_eval import Outcome, table

    def outcome(kind: str, answer: str, ended: bool) -> Outcome:
        return Outcome(kind, "q", [], True, answer, False, [], None, ended, False)

    # "the cat sat the cat sat": 4 word trigrams, the last repeats the first (1/4); "Fine." has none (0).
    rows = {row["tool"]: row for row in table([outcome("wiki", "Fine.", True),
                                               outcome("wiki", "the cat sat the cat sat", False),
                                               outcome("small_talk", "Hi, hi, hi, hi", True)])}
    assert (rows["wiki"]["never_ended"], rows["wiki"]["repeated_trigrams"]) == (0.5, 0.125)
    # "hi , hi , hi , hi": 7 tokens, 5 trigrams, 3 repeat ("hi , hi" and ", hi ," again)
    assert (rows["small_talk"]["never_ended"], rows["small_talk"]["repeated_trigrams"]) == (0.0, 0.6)
    # None repeated: 0.0%, not "-0.0%" (the mean of the negated penalties)
    none = table([outcome("wiki", "Fine.", True)])[0]["repeated_trigrams"]
    assert f"{none:.1%}" == "0.0%"


@pytest.mark.parametrize("flags, message", [
    (["--seed", "-1"], "argument --seed: -1 is not an integer in 0 .. 4294967295"),
    (["--max_new_tokens", "0"], "argument --max_new_tokens: 0 is not an integer >= 1"),
    (["--show", "-1"], "argument --show: -1 is not an integer >= 0"),
    (["--json", ""], "argument --json: expected a path, got an empty value"),
    (["--json", "."], "argument --json: . is a directory, expected a file"),
])
def test_bad_flags_are_one_line_naming_the_flag(flags, message, capsys):
    from eval import tool_eval

    with pytest.raises(SystemExit) as exit_:
        tool_eval.build_parser().parse_args(flags)
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[0] == f"error: {message}"


@pytest.mark.parametrize("flag, value", [("--conversions", "20000"), ("--wiki", "100000"), ("--small_talk", "1000")])
def test_a_count_above_the_held_out_questions_names_the_flag_and_its_maximum(tiny_models, monkeypatch, capsys, flag,
                                                                             value):
    """--conversions 20000 was a ValueError traceback; --wiki 100000 silently ran the 181 there are."""
    import dataset.tool_dialogues
    from eval import tool_eval

    monkeypatch.setattr(dataset.tool_dialogues, "MAX_PROBLEM_DRAWS", 100_000)  # the same refusal, sooner
    assert tool_eval.main(["--model_path", str(tiny_models.sft), flag, value]) == 2
    err = capsys.readouterr().err.strip()
    assert re.fullmatch(rf"error: {flag} {value}: the held-out questions hold at most \d+( \(--seed 0\))?", err), err


def test_a_model_too_short_for_the_tools_schemas_is_one_line(tiny_models, tokenizer, capsys):
    """The 128-position tiny SFT model cannot hold a question with the three tools' schemas: that was a
    MessageTooLong traceback; it is one line naming the question, its tokens against the context, and what to do."""
    from dataset.chat_format import encode_chatml
    from dataset.tool_scoring import ToolQuestion
    from dataset.tools import tool_schemas
    from eval import tool_eval

    (question,) = [ToolQuestion.from_dialogue(d) for d in tool_dialogues("held_out", 0, 1, 0, 0)]
    tokens = len(encode_chatml(tokenizer, [{"role": "user", "content": question.question}],
                               add_generation_prompt=True, tools=tool_schemas()).input_ids)
    assert tokens > 128  # the schemas alone are longer than the context
    code = tool_eval.main(["--model_path", str(tiny_models.sft), "--wiki", "1", "--arithmetic", "0",
                           "--conversions", "0", "--small_talk", "0", "--threads", "1"])
    captured = capsys.readouterr()
    err = [line for line in captured.err.splitlines() if not line.startswith("threads: ")]
    assert code == 2 and captured.out == "" and err == [
        f"error: question 1 of 1 (wiki: {question.question!r}) takes {tokens} tokens in the chat format, the tools' "
        "schemas included, over the model's context of 128; every question is asked with every tool's schema: "
        "evaluate a model with more positions (max_position_embeddings)"], captured.err


def test_after_other_whose_exchange_does_not_fit_beside_max_new_tokens_is_one_line(tool_model, tokenizer, capsys):
    """--max_new_tokens 600 on the 512-position model: the prompt fitter left the --after_other exchange out to
    make room, and the question was scored as asked after it (the report's "before" showing an exchange the model
    never saw). Now the run stops at the first such question, once its reply says its first round left the exchange
    out (the answer's generation, after a long tool result, losing it is counted: the next test)."""
    from dataset.tool_scoring import ToolQuestion
    from eval import tool_eval

    first = ToolQuestion.from_dialogue(tool_dialogues("held_out", 0, 1, 1, 1)[0])
    code = tool_eval.main(["--model_path", str(tool_model), *COUNTS, "--threads", "1", "--after_other",
                           "--max_new_tokens", "600"])
    captured = capsys.readouterr()
    err = [line for line in captured.err.splitlines() if not line.startswith("threads: ")]
    assert code == 2 and captured.out == "" and err == [
        f"error: question 1 of 4 ({first.kind}: {first.question!r}) would leave its --after_other exchange out of "
        "the prompt: with it, the prompt and --max_new_tokens 600 do not fit the model's context of 512; lower "
        "--max_new_tokens or evaluate a model with more positions (max_position_embeddings)"], captured.err


def test_after_other_whose_answer_round_leaves_the_exchange_out_is_counted_and_named(tool_model, tokenizer,
                                                                                    tmp_path, capsys):
    """--after_other checked only the call's prompt: after the lookup's long result the answer's prompt left the
    small talk before it out, silently, and the question was scored as asked after it. --max_new_tokens is chosen from
    the prompts' lengths counted here: every call's prompt (and the small talk's) fits with its exchange, only the
    lookup's answer does not. That question is named in one note on stderr, flagged in its outcome and counted."""
    from dataset.chat_format import encode_chatml
    from dataset.tools import tool_schemas

    (talk,) = small_talk_dialogues("held_out", 0, 1)
    talk = normalize_messages(talk["conversations"])
    dialogues = [normalize_messages(d["conversations"]) for d in tool_dialogues("held_out", 0, 1, 1, 1)]

    def tokens(messages: list[dict]) -> int:
        return len(encode_chatml(tokenizer, messages, add_generation_prompt=True, tools=tool_schemas()).input_ids)

    calls = [tokens(talk[1:3] + d[1:2]) for d in dialogues] + [tokens(dialogues[0][1:] + talk[1:2])]
    answers = [tokens(talk[1:3] + d[1:4]) for d in dialogues]  # the question, the call and the tool's result
    lookup = [d[2]["tool_calls"][0]["name"] for d in dialogues].index("wiki")
    max_new_tokens = 512 - max(calls + answers[:lookup] + answers[lookup + 1:])
    assert answers[lookup] + max_new_tokens > 512  # the lookup's answer alone cannot keep the small talk
    report = run(tool_model, tmp_path, "--after_other", "--max_new_tokens", str(max_new_tokens))
    assert [outcome["history_left_out"] for outcome in report["outcomes"]] == [i == lookup for i in range(4)]
    assert report["outcomes"][lookup]["right_call"]  # the call saw the small talk
    captured = capsys.readouterr()
    question = dialogues[lookup][1]["content"]
    assert [line for line in captured.err.splitlines() if line.startswith("note: ")] == [
        f"note: question {lookup + 1} of 4 (wiki: {question!r}) was answered without its --after_other exchange: "
        f"after the tool's result, the prompt and --max_new_tokens {max_new_tokens} did not fit the model's context "
        "of 512 beside it (the call saw it); scored as asked after it, counted as history left out"]
    assert "history left out: 1 of 4 answers were generated without their --after_other exchange" in captured.out


@pytest.mark.parametrize("failing", [2, 3])
def test_the_question_that_does_not_fit_is_named_by_its_own_number_and_text(monkeypatch, failing):
    """ask_all names the question that did not fit, whichever it is: the end-to-end cases stop at question 1 (every
    question there is as long), so a message naming the first question for any would pass them."""
    from dataset.tool_scoring import ToolQuestion
    from eval import tool_eval
    from model.chat_session import MessageTooLong

    questions = [ToolQuestion.from_dialogue(dialogue) for dialogue in tool_dialogues("held_out", 0, 1, 1, 1)]
    assert len({question.question for question in questions}) == len(questions) == 3
    asked = []

    def ask(session, question, history, tokenize):
        asked.append(question)
        if len(asked) == failing:
            raise MessageTooLong(300, 128, True) if failing == 2 else tool_eval.HistoryLeftOut("would leave it out")
        return tool_eval.Outcome(question.kind, question.question, [], False, "", False, [], "no call", True, False)

    monkeypatch.setattr(tool_eval, "ask", ask)
    with pytest.raises(tool_eval.ModelTooShort) as refused:
        tool_eval.ask_all(None, questions, [[] for _ in questions], None)
    which = questions[failing - 1]
    assert str(refused.value).startswith(f"question {failing} of 3 ({which.kind}: {which.question!r}) "
                                         + ("takes 300 tokens" if failing == 2 else "would leave it out"))


@pytest.mark.parametrize(("template", "why"), [
    ("{% if %}", "the tokenizer's chat_template does not render: "),
    ("", "the tokenizer has no chat_template; "),
])
def test_a_damaged_chat_template_is_one_line_naming_the_model(tiny_models, tmp_path, capsys, template, why):
    """Every question goes through the chat template: an edited chat_template.jinja that does not parse (or an
    empty one) was a ValueError traceback at the first question; it is one line naming the model folder."""
    import shutil

    from eval import tool_eval

    model = tmp_path / "model"
    shutil.copytree(tiny_models.sft, model)
    (model / "chat_template.jinja").write_text(template, encoding="utf-8")
    code = tool_eval.main(["--model_path", str(model), "--wiki", "1", "--arithmetic", "0", "--conversions", "0",
                           "--small_talk", "0", "--threads", "1"])
    captured = capsys.readouterr()
    err = [line for line in captured.err.splitlines() if not line.startswith("threads: ")]
    assert code == 2 and captured.out == "" and len(err) == 1, captured.err
    assert err[0].startswith(f"error: {model}: {why}"), err
