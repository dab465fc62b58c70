"""GRPO/PPO prompt data (dataset/prompt_dataset.py) against what the reward functions need (trainer/rewards.py):
every row's `answer` readable by math_answer, no column that collides with the reward call's own arguments, and
prompt messages held to SFT's rules (normalize_messages) with their tools, tool calls and reasoning kept."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest

from dataset.chat_format import encode_chatml
from dataset.prompt_dataset import PromptDataset
from trainer.rewards import RESERVED_NAMES, REWARD_ARGUMENTS, Reward, column_problems, math_answer, score

GOOD_ROWS = [{"prompt": "What is 1 + 1?", "answer": 2}, {"prompt": "Half of 1?", "answer": 0.5},
             {"prompt": "GSM8K style", "answer": "3 + 4 = 7\n#### 7"}, {"prompt": "A fraction", "answer": "1/2"}]


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def _load_for(rewards: list[str], path: Path, tokenizer, skip_bad_lines: bool = False) -> PromptDataset:
    """The data as a run with these --reward functions loads it (trainer/data.py): their column check inside."""
    return PromptDataset(path, tokenizer, max_seq_len=64, skip_bad_lines=skip_bad_lines,
                         column_check=partial(column_problems, rewards))


def _load_for_math_answer(path: Path, tokenizer, skip_bad_lines: bool = False) -> PromptDataset:
    return _load_for(["length_penalty", "math_answer"], path, tokenizer, skip_bad_lines)


def test_math_answer_accepts_numbers_and_texts_holding_one(tokenizer, tmp_path):
    assert len(_load_for_math_answer(_write(tmp_path / "p.jsonl", GOOD_ROWS), tokenizer)) == len(GOOD_ROWS)


MISSING = '"answer" is missing; the math_answer reward needs a number or a number as text on every row'
WRONG = '"answer" must be a number or a number as text for the math_answer reward, got '


@pytest.mark.parametrize("row, reason", [
    ({"prompt": "q"}, MISSING),
    ({"prompt": "q", "answer": None}, WRONG + "null"),
    ({"prompt": "q", "answer": {"value": 3}}, WRONG + "an object"),
    ({"prompt": "q", "answer": [3]}, WRONG + "a list"),
    ({"prompt": "q", "answer": True}, WRONG + "true"),
    ({"prompt": "q", "answer": "seven\nhundred"}, WRONG + 'the text "seven\\nhundred"'),
    # cut as every quote is (dataset/shown_value.py: the quote mark and 56 more of its 60 characters, "...")
    ({"prompt": "q", "answer": "x" * 100}, WRONG + f'the text "{"x" * 56}...'),
])
def test_math_answer_refuses_a_row_whose_answer_it_cannot_read_naming_its_line(row, reason, tokenizer, tmp_path):
    path = _write(tmp_path / "p.jsonl", [*GOOD_ROWS, row, GOOD_ROWS[0]])
    with pytest.raises(ValueError) as refused:
        _load_for_math_answer(path, tokenizer)
    assert str(refused.value) == f"{path}:5: {reason} (pass --skip_bad_lines to skip bad lines)"


def test_skip_bad_lines_skips_the_rows_a_reward_cannot_read_and_names_them(tokenizer, tmp_path, caplog):
    """The row check was run on the loaded data, after --skip_bad_lines had had its say: a row without the answer
    math_answer reads stopped the run with the flag given."""
    rows = [GOOD_ROWS[0], {"prompt": "q"}, GOOD_ROWS[1], {"prompt": "q", "answer": [3]}, GOOD_ROWS[2]]
    path = _write(tmp_path / "p.jsonl", rows)
    with caplog.at_level("WARNING"):
        data = _load_for_math_answer(path, tokenizer, skip_bad_lines=True)
    assert [line for line, _ in data.rows] == [1, 3, 5] and data.stats["skipped_lines"] == 2
    assert [sample["columns"]["answer"] for sample in data] == [2, 0.5, "3 + 4 = 7\n#### 7"]
    messages = [record.getMessage() for record in caplog.records]
    assert messages == [f"{path}:2: {MISSING} (skipped)", f"{path}:4: {WRONG}a list (skipped)",
                        f"{path}: skipped 2 bad line(s), loading the 3 good one(s)"]


def test_a_reward_that_reads_no_answer_accepts_any_answer(tokenizer, tmp_path):
    path = _write(tmp_path / "p.jsonl", [*GOOD_ROWS, {"prompt": "q", "answer": {"free": "form"}}, {"prompt": "q"}])
    assert len(_load_for(["length_penalty"], path, tokenizer)) == 6


def test_math_answer_reads_a_json_number_as_that_number():
    # str(1e20) is "1e+20", whose last number is 20; str(1e-07) is "1e-07", whose last number is -7.
    completions = ["100000000000000000000", "20", "0.0000001", "-7"]
    assert math_answer([""] * 4, completions, [1e20, 1e20, 1e-07, 1e-07]) == [1.0, 0.0, 1.0, 0.0]


def test_the_reserved_names_are_exactly_the_reward_calls_own_arguments():
    seen = []

    def record(**kwargs):
        seen.append(set(kwargs))
        return [0.0]

    score([Reward("record", record)], ["p"], ["c"], {})
    assert seen == [set(REWARD_ARGUMENTS)]


@pytest.mark.parametrize("name", RESERVED_NAMES)  # GRPO --tools's completion_messages too
def test_a_field_named_like_a_reward_argument_is_refused_before_training(name, tokenizer, tmp_path):
    """Whatever the rewards (a function of the user's gets the columns too): it was a TypeError after the first
    rollout, naming no file."""
    path = _write(tmp_path / "p.jsonl", [*GOOD_ROWS, {"prompt": "q", "answer": 1, name: ["x"]}])
    with pytest.raises(ValueError) as refused:
        _load_for(["length_penalty"], path, tokenizer)
    assert str(refused.value) == (f'{path}:5: field "{name}" is reserved (reward functions receive the {name} under '
                                  f"that name); rename it (pass --skip_bad_lines to skip bad lines)")


@pytest.mark.parametrize("message, reason", [
    ({"role": "assistant", "content": None, "tool_calls": "[{"}, "messages[1].tool_calls is not valid JSON"),
    ({"role": "assistant", "content": "a", "reasoning_content": 7},
     "messages[1].reasoning_content must be a string, got int"),
    ({"role": "user", "content": "a", "reasoning_content": "why"},
     "messages[1].reasoning_content: only assistant messages think, this one is 'user'"),
    ({"role": "user", "content": "a", "tool_calls": [{"name": "f", "arguments": {}}]},
     "messages[1].tool_calls: only assistant messages call tools, this one is 'user'"),
    ({"role": "system", "content": "s", "tools": [{"type": "function", "function": {"name": "f"}}]},
     "messages[1].tools: only the first message, a system one, may carry tools"),
    ({"role": 7, "content": "a"}, 'messages[1] has no "role" string'),
    ({"role": "", "content": "a"}, 'messages[1] has no "role" string'),
    ({"role": "human", "content": "a"}, "messages[1].role is 'human'; a role is one of system, user, assistant, tool"),
    ({"role": "user", "content": ["a"]}, 'messages[1] has no "content" string'),
    ({"role": "user"}, 'messages[1] has no "content" string'),
    ("hi", "messages[1] is not an object"),
    # Arguments within the bound as their own text are deeper inside the call: the encoder, which reads the calls
    # again, refused them after every line had passed, naming no file or line.
    ({"role": "assistant", "content": None,
      "tool_calls": [{"function": {"name": "f", "arguments": '{"a": ' + "[" * 99 + "]" * 99 + "}"}}]},
     "messages[1].tool_calls is nested too deeply (more than 100 levels"),
])
def test_a_malformed_prompt_message_is_refused_naming_its_field(message, reason, tokenizer, tmp_path):
    row = {"messages": [{"role": "user", "content": "q"}, message, {"role": "user", "content": "q2"}], "answer": 1}
    path = _write(tmp_path / "p.jsonl", [GOOD_ROWS[0], row])
    with pytest.raises(ValueError) as refused:
        PromptDataset(path, tokenizer, max_seq_len=256)
    assert str(refused.value).startswith(f"{path}:2: {reason}")
    assert str(refused.value).endswith("(pass --skip_bad_lines to skip bad lines)") and "\n" not in str(refused.value)


WEATHER = {"type": "function", "function": {"name": "weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TOOL_CONVERSATION = [
    {"role": "system", "content": "You help.", "tools": json.dumps([WEATHER])},  # MiniMind's JSON-string form
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "reasoning_content": "I should look it up.",
     "tool_calls": json.dumps([{"name": "weather", "arguments": {"city": "Oslo"}}])},
    {"role": "tool", "content": "rain, 4 C"},
    {"role": "user", "content": "And <|im_end|> tomorrow?"},
    {"role": "assistant", "content": ""},  # rlaif's empty answer turn: the policy writes it
]


@pytest.mark.parametrize("field", ["messages", "conversations"])
def test_a_prompt_keeps_its_tools_tool_calls_and_reasoning(field, tokenizer, tmp_path):
    path = _write(tmp_path / "p.jsonl", [{field: TOOL_CONVERSATION, "answer": 4}])
    data = PromptDataset(path, tokenizer, max_seq_len=512)
    expected = encode_chatml(tokenizer, TOOL_CONVERSATION[:-1], add_generation_prompt=True).input_ids
    plain = [{"role": m["role"], "content": m["content"] or ""} for m in TOOL_CONVERSATION[:-1]]
    bare = encode_chatml(tokenizer, plain, add_generation_prompt=True).input_ids
    assert expected != bare  # the tools, the call and the thinking are in the prompt
    assert data[0]["input_ids"].tolist() == expected
    assert data[0]["prompt"] == "And <|im_end|> tomorrow?" and data[0]["columns"] == {"answer": 4}
    text = tokenizer.decode(expected)
    assert "weather(city: string)" in text and '"city": "Oslo"' in text and "I should look it up." in text


def test_the_tools_flag_offers_its_tools_in_place_of_the_rows(tokenizer, tmp_path):
    """GRPO --tools calculator: the prompt's system turn lists the calculator alone, whatever tools the row's system
    message carries (the rollouts run only those), rendered as the template renders a request's tools."""
    from dataset.tools import tool_schemas

    path = _write(tmp_path / "p.jsonl", [{"messages": TOOL_CONVERSATION, "answer": 4}])
    data = PromptDataset(path, tokenizer, max_seq_len=512, tools=("calculator",))
    expected = encode_chatml(tokenizer, TOOL_CONVERSATION[:-1], add_generation_prompt=True,
                             tools=tool_schemas(["calculator"])).input_ids
    assert data[0]["input_ids"].tolist() == expected
    text = tokenizer.decode(expected)
    assert "calculator(expression: string)" in text and "weather(" not in text and "wiki(" not in text


def test_a_row_with_two_prompt_fields_is_prompted_by_the_first_and_hands_the_other_to_the_rewards(tokenizer,
                                                                                                 tmp_path):
    """TRL's GRPOTrainer prompts with the "prompt" column alone and hands every other column to its reward functions,
    a "messages" one too: so does a row here with "prompt" and "messages" (its "messages" was dropped, reaching no
    reward), and one with "messages" and "conversations" is prompted by "messages"."""
    said = [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}]
    asked = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": ""}]
    rows = [{"prompt": "What is 1 + 1?", "messages": said, "answer": 2},
            {"conversations": asked, "messages": said, "answer": 4}]
    data = PromptDataset(_write(tmp_path / "p.jsonl", rows), tokenizer, max_seq_len=256)
    first = encode_chatml(tokenizer, [{"role": "user", "content": "What is 1 + 1?"}], add_generation_prompt=True)
    second = encode_chatml(tokenizer, said[:1], add_generation_prompt=True)
    assert [sample["input_ids"].tolist() for sample in data] == [first.input_ids, second.input_ids]
    assert [sample["prompt"] for sample in data] == ["What is 1 + 1?", "Say hi."]
    assert [sample["columns"] for sample in data] == [{"messages": said, "answer": 2},
                                                      {"conversations": asked, "answer": 4}]
    seen = []

    def recorder(prompts, completions, **columns):
        seen.append(columns)
        return [0.0] * len(completions)

    batch = PromptDataset.collate([data[0], data[1]])
    score([Reward("recorder", recorder)], batch["prompts"], ["a", "b"], batch["columns"])
    assert seen == [{"answer": [2, 4], "conversations": [None, asked], "messages": [said, None]}]


@pytest.mark.parametrize("lines, skip, reason", [
    ("\n\n", False, "no prompt records in the file; refusing to train on nothing"),
    ('{"nothing": 1}\n', True, "no prompt records in the file (1 bad lines skipped); refusing to train on nothing"),
    ('{"prompt": "' + "word " * 100 + '", "answer": 1}\n', False,
     "no prompt of at most --max_seq_len=64 tokens (all 1 are longer); raise --max_seq_len"),
])
def test_a_file_without_a_usable_prompt_says_why(lines, skip, reason, tokenizer, tmp_path):
    """An empty file was told "no prompt of at most --max_seq_len tokens", as if its prompts were too long."""
    path = tmp_path / "p.jsonl"
    path.write_text(lines, encoding="utf-8")
    with pytest.raises(ValueError) as refused:
        PromptDataset(path, tokenizer, max_seq_len=64, skip_bad_lines=skip)
    assert str(refused.value) == f"{path}: {reason}"


def test_skipped_lines_are_logged_by_line_and_counted(tokenizer, tmp_path, caplog):
    """A GRPO/PPO validation file's skipped lines are in no printed stats: they were skipped without a word."""
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(GOOD_ROWS[0]) + "\nnot json\n" + json.dumps({"prompt": 3}) + "\n", encoding="utf-8")
    with caplog.at_level("WARNING", logger="dataset.prompt_dataset"):
        data = PromptDataset(path, tokenizer, max_seq_len=64, skip_bad_lines=True)
    assert len(data) == 1 and data.stats["skipped_lines"] == 2
    messages = [record.getMessage() for record in caplog.records]
    assert f"{path}:2: invalid JSON (Expecting value at column 1) (skipped)" in messages
    assert f"{path}:3: field 'prompt' must be a non-empty string or a list of messages (skipped)" in messages
    assert f"{path}: skipped 2 bad line(s), loading the 1 good one(s)" in messages


def test_a_prompt_of_exactly_max_seq_len_tokens_is_kept_and_an_empty_one_refused(tokenizer, tmp_path):
    """--max_seq_len bounds the prompt's tokens (the generation prompt included), so a prompt of exactly that many is
    kept and one more drops it; an empty "prompt" is a bad line naming the field, as a non-string one is."""
    row = {"prompt": "What is 1 + 1?", "answer": 2}
    length = len(encode_chatml(tokenizer, [{"role": "user", "content": row["prompt"]}],
                               add_generation_prompt=True).input_ids)
    path = _write(tmp_path / "p.jsonl", [row, {"prompt": "What is 1 + 1? " * 20, "answer": 2}])
    data = PromptDataset(path, tokenizer, max_seq_len=length)
    assert len(data) == 1 and len(data[0]["input_ids"]) == length and data.stats["dropped_too_long"] == 1
    with pytest.raises(ValueError, match=r"no prompt of at most --max_seq_len=\d+ tokens \(all 2 are longer\)"):
        PromptDataset(path, tokenizer, max_seq_len=length - 1)
    empty = _write(tmp_path / "e.jsonl", [row, {"prompt": "", "answer": 1}])
    with pytest.raises(ValueError, match=rf"^{empty}:2: field 'prompt' must be a non-empty string or a list of "
                                           r"messages \(pass "):
        PromptDataset(empty, tokenizer, max_seq_len=64)


def test_a_batch_keeps_the_padding_mark_of_a_validation_shards_copy(tokenizer, tmp_path):
    """A copy that pads a validation shard (trainer/data.py) carries padding=True, which GRPO's and PPO's validation
    reads from the batch to leave it uncounted; a real prompt's flag is False, and every column is listed."""
    data = PromptDataset(_write(tmp_path / "p.jsonl", GOOD_ROWS[:2]), tokenizer, max_seq_len=64)
    batch = PromptDataset.collate([data[0], {**data[1], "padding": True}])
    assert batch["padding"] == [False, True] and batch["columns"] == {"answer": [2, 0.5]}
    assert batch["prompts"] == ["What is 1 + 1?", "Half of 1?"]
