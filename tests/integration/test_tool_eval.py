"""eval/tool_eval.py on a tiny model that has memorised the tool dialogues of a few held-out questions and one small
talk: asked those questions it makes the right calls and answers with the facts (every rate 100%) and answers the
small talk without a call; asked other held-out questions it repeats its memorised calls, which are wrong for them
(0%). The JSON report holds each transcript."""

from __future__ import annotations

import json

import pytest

from dataset.chat_format import normalize_messages
from dataset.tool_dialogues import small_talk_dialogues, tool_dialogues
from tests.memorized_model import memorized_model, supervised_row

pytestmark = pytest.mark.usefixtures("one_thread")

COUNTS = ["--wiki", "1", "--arithmetic", "1", "--conversions", "1", "--small_talk", "1"]


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory, tokenizer):
    rows = []
    for dialogue in tool_dialogues("held_out", 0, 1, 1, 1):
        messages = normalize_messages(dialogue["conversations"])
        rows.append(supervised_row(tokenizer, messages[:3]))  # the question -> the call
        rows.append(supervised_row(tokenizer, messages))  # ... the tool's result -> the answer
    (small_talk,) = small_talk_dialogues("held_out", 0, 1)
    rows.append(supervised_row(tokenizer, normalize_messages(small_talk["conversations"])[:3]))  # a reply, no call
    return memorized_model(tokenizer, rows, tmp_path_factory.mktemp("tool_eval") / "model", steps=150,
                           positions=512)


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
    table = capsys.readouterr().out
    assert "right call" in table and "100.0%" in table and "100.0% (none)" in table


def test_other_held_out_questions_get_the_memorised_wrong_calls(tool_model, tmp_path):
    report = run(tool_model, tmp_path, "--seed", "1")
    assert {row["tool"]: row["right_call"] for row in report["table"]}["all"] == 0.0


def test_negative_counts_are_refused(tool_model, capsys):
    from eval import tool_eval

    assert tool_eval.main(["--model_path", str(tool_model), "--wiki", "-1"]) != 0
    assert "--wiki, --arithmetic, --conversions and --small_talk must be >= 0" in capsys.readouterr().err
