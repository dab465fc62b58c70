"""Reward functions (trainer/rewards.py): TRL's contract (keyword call, extra columns, None leaves a completion
unscored, weights), the loader (a file's function, a built-in, one-line errors), the built-ins against values
worked out by hand, and the one-line errors for a function that raises, returns the wrong count, NaN or text."""

from __future__ import annotations

import gc
import math
import os
import warnings

import pytest

from dataset.chat_format import parse_assistant_ids
from dataset.shown_value import shown_value
from trainer.rewards import (BUILTIN, LENGTH_BUFFER_CHARS, LENGTH_LIMIT_CHARS, RewardError, answer_part, final_answer,
                             length_penalty, load_reward, math_answer, repetition_penalty, score, think_format)

USER_REWARDS = '''
def contains_word(prompts, completions, word, **columns):
    """1 if the row's word is in the completion; None (unscored) for an empty completion."""
    return [None if not c else float(w in c) for c, w in zip(completions, word)]

def seen(prompts, completions, **columns):
    seen.calls.append((list(prompts), list(completions), dict(columns)))
    return [0.5] * len(completions)
seen.calls = []

def raises(prompts, completions, **columns):
    raise KeyError("answer")

def too_few(prompts, completions, **columns):
    return [1.0]

def nan(prompts, completions, **columns):
    return [0.0, float("nan")]

def text(prompts, completions, **columns):
    return ["good", 1.0]

def inf(prompts, completions, **columns):
    return [1.0, float("inf")]

def minus_inf(prompts, completions, **columns):
    return [-float("inf"), 0.0]

def huge(prompts, completions, **columns):
    return [10 ** 400, 0.0]

def exits(prompts, completions, **columns):
    raise SystemExit(0)

def arrays(prompts, completions, **columns):
    import numpy
    return [numpy.array([1.0, 2.0]), 0.0]

class NoNumber:
    def __float__(self):
        raise ValueError("no number here")

    def __repr__(self):
        return "NoNumber()"

def float_raises(prompts, completions, **columns):
    return [0.0, NoNumber()]

def clears(prompts, completions, answer, **columns):
    rewards = [1.0] * len(completions)
    prompts.clear(), completions.clear(), answer.pop()
    return rewards

def lazy_raises(prompts, completions, **columns):
    for completion in completions:
        yield 1 / 0

import asyncio
import sys
import types

# Each sets its event and waits for the other's: awaited one after the other, the first would wait its whole timeout.
# Each --reward loads the file as a module of its own: the two events are kept where both find them.
EVENTS = sys.modules.setdefault(f"events of {__file__}", types.SimpleNamespace(ping=asyncio.Event(),
                                                                                 pong=asyncio.Event()))
ping_ready, pong_ready = EVENTS.ping, EVENTS.pong

async def ping(prompts, completions, **columns):
    ping_ready.set()
    await asyncio.wait_for(pong_ready.wait(), 30)
    return [1.0] * len(completions)

async def pong(prompts, completions, **columns):
    pong_ready.set()
    await asyncio.wait_for(ping_ready.wait(), 30)
    return [float(len(c)) for c in completions]

async def awaits_and_raises(prompts, completions, **columns):
    await asyncio.sleep(0)
    raise KeyError("judge")

async def awaits_too_few(prompts, completions, **columns):
    return [1.0]
'''


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(USER_REWARDS)
    return path


def test_a_users_function_gets_prompts_completions_and_the_rows_other_columns(user_file):
    reward = load_reward(f"{user_file}:seen")
    columns = {"answer": ["4", "5"], "word": ["cat", "dog"]}
    totals, per_function = score([reward], ["p1", "p2"], ["c1", "c2"], columns)
    assert totals == [0.5, 0.5] and per_function == [[0.5, 0.5]]
    assert reward.function.calls == [(["p1", "p2"], ["c1", "c2"], columns)]


def test_none_leaves_a_completion_unscored_and_weights_multiply(user_file):
    rewards = [load_reward(f"{user_file}:contains_word", weight=2.0), load_reward("length_penalty", weight=0.5)]
    long = "x" * LENGTH_LIMIT_CHARS  # the length penalty's -1
    totals, per_function = score(rewards, ["a", "b", "c"], ["a cat", "", long], {"word": ["cat", "cat", "cat"]})
    assert per_function[0][:1] == [1.0] and math.isnan(per_function[0][1]) and per_function[0][2] == 0.0
    assert totals == [2.0 * 1.0 + 0.0, 0.5 * 0.0, 2.0 * 0.0 + 0.5 * -1.0]


@pytest.mark.parametrize("name, message", [
    ("raises", "reward {spec}: raised KeyError: 'answer'"),
    ("too_few", "reward {spec}: returned 1 values for 2 completions"),
    ("nan", "reward {spec}: returned NaN for completion 1 (return None to leave a completion unscored)"),
    ("text", "reward {spec}: returned 'good' for completion 0, not a number or None"),
    ("inf", "reward {spec}: returned inf for completion 1, not a finite number"),
    ("minus_inf", "reward {spec}: returned -inf for completion 0, not a finite number"),
    ("huge", "reward {spec}: returned a number beyond the float range for completion 0, not a finite number"),
    # the trainer ended there, with the function's exit code: 0 read as a finished run
    ("exits", "reward {spec}: raised SystemExit: 0"),
    # float() of the value raised: a TypeError traceback for an array of two numbers, a line without the reward's
    # name for a value whose __float__ raised
    ("arrays", "reward {spec}: returned <ndarray of shape (2,), float64> for completion 0, not a number or None "
               "(float() raised TypeError: only 0-dimensional arrays can be converted to Python scalars)"),
    ("float_raises", "reward {spec}: returned NoNumber() for completion 1, not a number or None (float() raised "
                     "ValueError: no number here)"),
    # a generator raises as its values are read: it was a ZeroDivisionError traceback
    ("lazy_raises", "reward {spec}: raised ZeroDivisionError: division by zero"),
])
def test_a_broken_reward_function_is_one_line_naming_it(name, message, user_file):
    spec = f"{user_file}:{name}"
    with pytest.raises(RewardError) as error:
        score([load_reward(spec)], ["p", "q"], ["a", "b"], {})
    assert str(error.value) == message.format(spec=spec)


def test_async_rewards_are_awaited_together_beside_the_plain_ones(user_file):
    """TRL's GRPOTrainer takes `async def` rewards and gathers them: each of ping and pong waits for the other to
    have started, so awaited one after the other the first would end in its 30 s timeout (a RewardError). It was
    refused (the coroutine it returned was no list of numbers)."""
    rewards = [load_reward(f"{user_file}:ping", weight=2.0), load_reward(f"{user_file}:seen"),
               load_reward(f"{user_file}:pong", weight=0.5)]
    totals, per_function = score(rewards, ["p1", "p2"], ["ab", "abcd"], {})
    assert per_function == [[1.0, 1.0], [0.5, 0.5], [2.0, 4.0]]
    assert totals == [2.0 + 0.5 + 1.0, 2.0 + 0.5 + 2.0]


@pytest.mark.parametrize("name, message", [
    ("awaits_and_raises", "reward {spec}: raised KeyError: 'judge'"),
    ("awaits_too_few", "reward {spec}: returned 1 values for 2 completions")])
def test_a_broken_async_reward_is_one_line_naming_it(name, message, user_file):
    spec = f"{user_file}:{name}"
    with pytest.raises(RewardError) as error:
        score([load_reward(f"{user_file}:seen"), load_reward(spec)], ["p", "q"], ["a", "b"], {})
    assert str(error.value) == message.format(spec=spec)


def test_a_plain_reward_that_raises_after_an_async_one_leaves_no_coroutine_unawaited(user_file):
    """The async function's coroutine, made before the plain one raised, is closed: Python's 'coroutine ... was
    never awaited' RuntimeWarning would follow the error line."""
    rewards = [load_reward(f"{user_file}:awaits_too_few"), load_reward(f"{user_file}:raises")]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(RewardError, match="raised KeyError"):
            score(rewards, ["p", "q"], ["a", "b"], {})
        gc.collect()
    assert [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)] == []


def test_a_reward_that_mutates_its_arguments_changes_nothing_outside_it(user_file):
    """Each function gets lists of its own: one that cleared `completions` left the trainer's list empty (GRPO's
    completion statistics then ended in a ZeroDivisionError traceback) and the next function scoring nothing."""
    rewards = [load_reward(f"{user_file}:clears"), load_reward(f"{user_file}:seen")]
    prompts, completions, columns = ["p1", "p2"], ["c1", "c2"], {"answer": ["4", "5"]}
    totals, _ = score(rewards, prompts, completions, columns)
    assert totals == [1.5, 1.5]
    assert (prompts, completions, columns) == (["p1", "p2"], ["c1", "c2"], {"answer": ["4", "5"]})
    assert rewards[1].function.calls[-1] == (["p1", "p2"], ["c1", "c2"], {"answer": ["4", "5"]})


def test_the_loader_refuses_bad_specs_in_one_line(user_file, tmp_path):
    assert load_reward("math_answer").function is BUILTIN["math_answer"]
    cases = {"nonsense": "expected path/to/file.py:function or a built-in (math_answer, length_penalty, "
                         "repetition_penalty, think_format, tool_use)",
             f"{tmp_path}/missing.py:f": f"no file {tmp_path}/missing.py",
             f"{user_file}:absent": f"{user_file} defines no function 'absent'"}
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_module_anywhere\n")
    cases[f"{broken}:f"] = "raised ModuleNotFoundError: No module named 'not_a_module_anywhere'"
    # a script's `sys.exit(main())` without the __main__ guard ended the trainer there, exit code 0, nothing trained
    script = tmp_path / "script.py"
    script.write_text("import sys\ndef f(prompts, completions, **columns):\n    return [0.0] * len(completions)\n"
                      "sys.exit(0)\n")
    cases[f"{script}:f"] = (f"importing {script} called sys.exit(0); a reward file runs its own main only under "
                            f"`if __name__ == \"__main__\":`")
    # a folder or a FIFO of that name was "no file"; now it is named as what it is (atomic_io's special_file_kind)
    (tmp_path / "folder.py").mkdir()
    cases[f"{tmp_path}/folder.py:f"] = f"{tmp_path}/folder.py is a folder, not a Python file"
    os.mkfifo(tmp_path / "pipe.py")
    cases[f"{tmp_path}/pipe.py:f"] = f"{tmp_path}/pipe.py is a FIFO (a pipe), not a Python file"
    for spec, message in cases.items():
        with pytest.raises(ValueError) as error:
            load_reward(spec)
        # the spec quoted as every flag's value is (dataset/shown_value.py: cut at 60 characters), the file whole
        assert str(error.value).startswith(f"--reward {shown_value(spec)}: ") and message in str(error.value)
        assert "\n" not in str(error.value)



def test_a_reward_files_relative_path_is_read_from_here_else_from_the_repo_root(user_file, monkeypatch):
    """--reward FILE.py:function as every input flag: FILE.py from the current directory when it is there, else
    from the repo root (it used to be read from the current directory only: `cd trainer && python
    train_grpo.py --reward trainer/rewards.py:...` said no file trainer/rewards.py). Where it is in neither, the
    error names it from the repo root."""
    repo = user_file.parent / "repo"  # a repo root apart from the current directory
    (repo / "rewards").mkdir(parents=True)
    (repo / "rewards" / "at_the_root.py").write_text("def tenth(prompts, completions, **columns):\n"
                                                      "    return [0.1] * len(completions)\n")
    monkeypatch.setattr("trainer.run_dir.REPO_ROOT", repo)
    monkeypatch.chdir(user_file.parent)
    assert load_reward(f"{user_file.name}:seen").function(["p"], ["c"]) == [0.5]
    assert load_reward("rewards/at_the_root.py:tenth").function(["p"], ["c"]) == [0.1]
    with pytest.raises(ValueError, match=f"^--reward 'absent.py:f': no file {repo / 'absent.py'}$"):
        load_reward("absent.py:f")

@pytest.mark.parametrize("completion, number", [
    ("The answer is 42.", 42.0), ("3 apples and 4 pears: 7", 7.0), ("so x = -2.5", -2.5),
    ("1,234 in total", 1234.0), ("half: 1/2", 0.5), ("\\boxed{12} and then 13", 12.0),
    ("steps 5 + 6 #### 11\nmore text 99", 11.0), ("no number here", None),
])
def test_final_answer(completion, number):
    assert final_answer(completion) == number


def test_math_answer_compares_numerically_with_the_rows_answer():
    completions = ["It is 12.", "It is 12.0", "It is 13", "I do not know", "#### 0.5", "so 7"]
    answers = ["12", 12, "12", "12", "1/2", "Tom has 3 + 4 = 7 apples #### 7"]
    assert math_answer([""] * 6, completions, answer=answers) == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0]


def test_math_answer_takes_no_number_beyond_a_float_for_an_answer():
    """Every number of 309 digits or more reads as the same infinity: an answer of 400 digits matched any completion
    that long (1.0 for 2 * 10**400 against 10**400), and the row passed the data check."""
    from trainer.rewards import column_problems

    big = "1" + "0" * 400
    assert final_answer(big) is None and final_answer("1" + "0" * 400 + "/3") is None
    assert math_answer([""] * 2, ["2" + "0" * 400, big], answer=[big, int(big)]) == [0.0, 0.0]
    assert column_problems(["math_answer"], [(3, {"answer": big})], "data.jsonl") == {
        3: f'"answer" must be a number or a number as text for the math_answer reward, got the text "{big[:56]}...'}
    # a text quoted as every refusal quotes one (dataset/shown_value.py: its newline escaped, the quote mark and 56
    # more of its 60 characters, then "..."), not by a cut of its own
    assert column_problems(["math_answer"], [(4, {"answer": "é\n" + "y" * 10_000})], "data.jsonl") == {
        4: f'"answer" must be a number or a number as text for the math_answer reward, got the text "é\\n{"y" * 53}...'}
    assert math_answer([""], ["1" + "0" * 300], answer=[10**300]) == [1.0]  # within a float: compared as before


def test_math_answer_reads_the_answer_after_the_thinking():
    completions = ["<think>\n3 + 4 = 7? no, 8\n</think>\n\nIt is 7.", "<think>\nit is 7\n</think>\n\nno idea",
                   "no thinking: 7"]
    assert math_answer([""] * 3, completions, answer=[7, 7, 7]) == [1.0, 0.0, 1.0]


def test_math_answer_splits_the_thinking_as_the_chat_format_does():
    """The thought ends at the first </think>, and only a completion that opens with <think> thinks (the rule of
    the chat's and the server's reply parser); the answer was taken after the last </think>, so both scored 0."""
    completions = ["<think>\nit is 8? no\n</think>\n\nIt is 7.</think>", "It is 7.</think>\n\nI think"]
    assert math_answer([""] * 2, completions, answer=[7, 7]) == [1.0, 1.0]


@pytest.mark.parametrize("completion, answer", [
    ("<think>\nsum\n</think>\n\nIt is 7.", "\n\nIt is 7."),  # TRL's convention: the answer after the thinking
    ("<think>a</think>It is 7.</think>", "It is 7.</think>"),  # the thought ends at the first </think>
    ("It is 7, I think</think>no", "It is 7, I think</think>no"),  # no opening <think>: no thinking
    (" <think>x</think>7", " <think>x</think>7"),  # something before <think>: no thinking either
    ("<think>cut off at 7", ""),  # cut before </think>: all thinking, no answer
    ("plain 7", "plain 7"),
])
def test_answer_part_is_the_content_the_reply_parser_reads(tokenizer, completion, answer):
    assert answer_part(completion) == answer
    # The same completion's ids, as the chat and the server read them (the parser strips the format's newlines).
    assert parse_assistant_ids(tokenizer, tokenizer(completion)["input_ids"]).content == answer.strip("\n")


@pytest.mark.parametrize("completion, expected", [
    ("<think>\nadd them\n</think>\n\n7", 1.0),
    ("<think></think>7", 1.0),                     # empty thinking is allowed, the answer is what counts
    ("<think>\n\n</think>\n\nThe answer is 7.", 1.0),  # the template's empty block
    ("<think>\nadd them\n</think>\n\n", 0.0),     # no answer after the thinking
    ("<think>\nadd them\n</think> \n\t", 0.0),     # only whitespace after it
    ("<think>\nadd them, 7", 0.0),                 # never closed
    ("7</think>", 0.0),                             # no opening tag
    (" <think>x</think>7", 0.0),                    # something before <think>
    ("<think>a</think>b</think>7", 0.0),            # two closing tags
    ("<think>a<think>b</think>7", 0.0),             # two opening tags
    ("</think>x<think>7", 0.0),                     # the wrong order
    ("", 0.0),
])
def test_think_format_by_hand(completion, expected):
    assert think_format(["p"], [completion]) == [expected]
    assert load_reward("think_format").function is think_format


def test_length_penalty_by_hand():
    start = LENGTH_LIMIT_CHARS - LENGTH_BUFFER_CHARS
    lengths = [0, start, start + LENGTH_BUFFER_CHARS // 4, LENGTH_LIMIT_CHARS, LENGTH_LIMIT_CHARS + 50]
    assert length_penalty([], ["y" * n for n in lengths]) == [0.0, 0.0, -0.25, -1.0, -1.0]


def test_repetition_penalty_by_hand():
    # "a b c a b c": trigrams abc, bca, cab, abc -> 1 of 4 repeats; "the the the the the": 3 trigrams, 2 repeat.
    completions = ["a b c a b c", "The the THE the the", "all different words here", "too short"]
    assert repetition_penalty([], completions) == [-0.25, -2 / 3, 0.0, 0.0]


def test_math_answer_on_data_without_an_answer_field_is_refused_in_one_line():
    from trainer.rewards import column_problems
    assert column_problems(["math_answer", "length_penalty"], [(1, {"answer": 3, "level": 1})], "data.jsonl") == {}
    assert column_problems(["length_penalty"], [(1, {})], "data.jsonl") == {}
    with pytest.raises(ValueError) as refused:
        column_problems(["length_penalty", "math_answer"], [(1, {"level": 1}), (2, {"level": 2})], "data.jsonl")
    assert str(refused.value) == ("--reward math_answer reads the data's 'answer' field, which data.jsonl lacks; "
                                  "give another --reward (a built-in or path/to/file.py:function)")


def _episode(calls: list[dict], answer: str) -> list[dict]:
    """An episode as GRPO --tools hands it to the rewards: the call turn and its results, then the answer."""
    messages = [{"role": "assistant", "content": "", "tool_calls": calls},
                *({"role": "tool", "content": "..."} for _ in calls)] if calls else []
    return messages + [{"role": "assistant", "content": answer}]


def test_tool_use_scores_the_right_call_and_the_fact_in_hand_written_episodes():
    """0.5 for a first call of the row's tool whose result is the row's, 0.5 for the row's fact in the last turn's
    answer (each part worked out by hand; a spelling the tool resolves counts, a number inside another does not)."""
    from trainer.rewards import tool_call, tool_fact, tool_use

    def calc(expression: str) -> dict:
        return {"name": "calculator", "arguments": {"expression": expression}}

    convert = {"value": 5, "from_unit": "miles", "to_unit": "kilometres"}
    rows = [  # (question, tool, result, fact, episode, right call, fact found)
        ("What is 2 + 3?", "calculator", "5", "5", _episode([calc("2 + 3")], "2 + 3 = 5."), 1, 1),
        ("What is 2 + 3?", "calculator", "5", "5", _episode([calc("2+3")], "It is 55."), 1, 0),
        ("What is 2 + 3?", "calculator", "5", "5", _episode([{"name": "wiki", "arguments": {"title": "5"}}], "5"),
         0, 1),
        ("What is 2 + 3?", "calculator", "5", "5", _episode([], "I do not know."), 0, 0),
        ("What is 2 + 3?", "calculator", "5", "5", _episode([calc("2 * 3"), calc("2 + 3")], "5."), 0, 1),
        ("Convert 5 miles to kilometres.", "convert_units", "5 miles = 8.04672 kilometres", "8.04672",
         _episode([{"name": "convert_units", "arguments": convert}], "That is 8.04672 kilometres."), 1, 1),
        ("What is the Eiffel Tower?", "wiki", "The Eiffel Tower is a lattice tower on the Champ de Mars in Paris, "
         "France. It is named after the engineer Gustave Eiffel, whose company designed and built the tower from 1887 "
         "to 1889.", "The Eiffel Tower is a lattice tower on the Champ de Mars in Paris, France.",
         _episode([{"name": "wiki", "arguments": {"title": "eiffel tower"}}],
                  "It is a lattice tower on the Champ de Mars."), 1, 1),
    ]
    prompts, tools, results, facts, episodes, calls, found = (list(column) for column in zip(*rows))
    columns = {"completion_messages": episodes, "tool": tools, "result": results, "fact": facts}
    completions = [""] * len(rows)
    assert tool_call(prompts, completions, **columns) == calls
    assert tool_fact(prompts, completions, **columns) == found
    assert tool_use(prompts, completions, **columns) == [0.5 * c + 0.5 * f for c, f in zip(calls, found)]


def test_tool_use_needs_its_columns_and_the_tools_flag(capsys):
    """A row without the fact is a bad line (named); --reward tool_use without --tools is refused in one line."""
    from trainer.args import parse_args
    from trainer.rewards import column_problems

    rows = [(1, {"tool": "calculator", "result": "5", "fact": "5"}), (2, {"tool": "calculator", "result": "5"}),
            (3, {"tool": "search", "result": "5", "fact": "5"})]
    problems = column_problems(["tool_use"], rows, "tools.jsonl")
    assert sorted(problems) == [2, 3]
    assert problems[2].startswith('"fact" is missing; the tool_use reward needs')
    assert problems[3].startswith('"tool" must be a built-in tool\'s name for the tool_use reward')
    with pytest.raises(SystemExit):
        parse_args("grpo", ["--reward", "tool_use"])
    assert capsys.readouterr().err.splitlines()[0] == ("error: --reward='tool_use' is not allowed; it reads the "
                                                       "rollouts' tool calls: give --tools with it")
    with pytest.raises(SystemExit):
        parse_args("grpo", ["--tools", "calculator,search"])
    assert capsys.readouterr().err.splitlines()[0].endswith(
        "give built-in tools, comma-separated, each once: wiki, calculator, convert_units")
    for task in ("grpo", "ppo"):  # PPO's rollouts call tools as GRPO's
        assert parse_args(task, ["--tools", "calculator", "--reward", "tool_use", "--max_tool_rounds", "3"]).tools


def test_a_reward_file_with_a_dataclass_and_postponed_annotations_loads(tmp_path):
    """A reward file is run as a module is imported: one that defines a @dataclass under `from __future__ import
    annotations` (dataclasses look the module up in sys.modules) failed to load with "'NoneType' object has no
    attribute '__dict__'". Two files of the same name in two folders stay two modules."""
    for folder, value in (("a", 1.0), ("b", 2.0)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "rewards.py").write_text(
            "from __future__ import annotations\nfrom dataclasses import dataclass\n\n\n@dataclass\nclass Score:\n"
            f"    value: float = {value}\n\n\ndef scored(prompts, completions, **columns):\n"
            "    return [Score().value for _ in completions]\n")
    first, second = (load_reward(f"{tmp_path / folder / 'rewards.py'}:scored") for folder in ("a", "b"))
    assert first.function(["p"], ["c"]) == [1.0] and second.function(["p"], ["c"]) == [2.0]
