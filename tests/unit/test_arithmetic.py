"""dataset/arithmetic.py: every problem's answer against the arithmetic its question states (computed here from
the question's words), the reward's reading of the worked solution, the split, and the default files built from
it (the SFT side in the corpus, the GRPO prompts)."""

from __future__ import annotations

import json
import re

import pytest

from dataset.arithmetic import (HELD_OUT_PROBLEMS, RL_PROBLEMS, SFT_PROBLEMS, SFT_VAL_PROBLEMS, is_held_out, problem,
                                problems, rl_problems, sft_problems)
from trainer.rewards import math_answer

QUESTION_FORMS = {  # kind -> (pattern over the question, the answer from its numbers)
    "add": (r"has (\d+) \w+ and gets (\d+) more\.", lambda a, b: a + b),
    "sub": (r"had (\d+) \w+ and gave (\d+) away\.", lambda a, b: a - b),
    "mul": (r"buys (\d+) boxes with (\d+) \w+ in each\.", lambda a, b: a * b),
    "add_sub": (r"has (\d+) \w+, buys (\d+) more and then gives (\d+) away\.", lambda a, b, c: a + b - c),
}


@pytest.mark.parametrize("index", range(400))
def test_the_answer_is_what_the_question_asks_and_the_reward_reads_it(index: int) -> None:
    item = problem(index)
    pattern, formula = QUESTION_FORMS[item.kind]
    numbers = [int(value) for value in re.search(pattern, item.question).groups()]
    assert item.answer == formula(*numbers) >= 0
    assert item.solution.endswith(f"The answer is {item.answer}.")
    row = item.prompt_row()
    assert row == {"prompt": item.question, "answer": item.answer}
    assert math_answer([row["prompt"]] * 2, [item.solution, f"The answer is {item.answer + 1}."],
                       answer=[row["answer"]] * 2) == [1.0, 0.0]
    assert item.conversation() == [{"role": "user", "content": item.question},
                                   {"role": "assistant", "content": item.solution}]
    assert problem(index) == item  # the stream is a function of (seed, index)


def test_every_kind_occurs_and_the_held_out_share_is_about_a_tenth() -> None:
    drawn = [problem(index) for index in range(4000)]
    assert {item.kind for item in drawn} == set(QUESTION_FORMS)
    assert [problem(index, seed=1) for index in range(50)] != drawn[:50]
    share = sum(is_held_out(item.split_key) for item in drawn) / len(drawn)
    assert 0.07 < share < 0.13


def test_default_sets_are_disjoint_where_they_must_be() -> None:
    sft_train, sft_val = sft_problems()
    rl_train, rl_val = rl_problems()
    assert (len(sft_train), len(sft_val), len(rl_train), len(rl_val)) == (SFT_PROBLEMS, SFT_VAL_PROBLEMS,
                                                                         RL_PROBLEMS, HELD_OUT_PROBLEMS)
    keys = {name: {item.split_key for item in items}
            for name, items in (("sft_train", sft_train), ("sft_val", sft_val), ("rl_train", rl_train),
                                ("rl_val", rl_val))}
    training = keys["sft_train"] | keys["rl_train"]
    assert not training & (keys["sft_val"] | keys["rl_val"])  # no held-out arithmetic is ever trained on
    assert not keys["sft_train"] & keys["rl_train"]  # GRPO's prompts are new to the SFT model
    assert keys["sft_val"] <= keys["rl_val"]
    assert len(keys["sft_train"]) == SFT_PROBLEMS  # each arithmetic once


def test_an_impossible_count_is_one_line(monkeypatch) -> None:
    import dataset.arithmetic

    monkeypatch.setattr(dataset.arithmetic, "MAX_FRUITLESS_DRAWS", 2000)  # the real bound takes seconds to hit
    with pytest.raises(ValueError, match=r"^count=100000 is not allowed: the stream gave only \d+ distinct "
                                         r"held-out problems$"):
        list(problems(100_000, held_out=True))


def test_the_built_files_hold_the_problems_on_their_sides(default_corpus, tmp_path) -> None:
    from dataset.post_training_data import ensure_post_training_data

    sft_train, sft_val = sft_problems()

    def arithmetic(path) -> list[list[dict]]:
        questions = {item.question for item in sft_train + sft_val}
        rows = [json.loads(line)["conversations"] for line in path.read_text(encoding="utf-8").splitlines()]
        return [row for row in rows if row[0]["content"] in questions]

    assert sorted(map(json.dumps, arithmetic(default_corpus.sft_train))) == \
        sorted(json.dumps(item.conversation()) for item in sft_train)
    assert sorted(map(json.dumps, arithmetic(default_corpus.sft_val))) == \
        sorted(json.dumps(item.conversation()) for item in sft_val)
    paths = ensure_post_training_data(tmp_path)
    rl_train, rl_val = rl_problems()
    for path, items in ((paths.grpo_train, rl_train), (paths.grpo_val, rl_val)):
        assert [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()] == \
            [item.prompt_row() for item in items]
