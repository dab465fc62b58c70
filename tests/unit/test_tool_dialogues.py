"""The tool-use dialogue generator (dataset/tool_dialogues.py): MiniMind's SFT shape, answers taken from real tool
results, determinism, and held-out entities and problems that never reach training."""

from __future__ import annotations

import json
import math

import pytest

from dataset.sources import read_wikipedia
from dataset.chat_format import encode_chatml
from dataset.tool_dialogues import (MULTI_TURN_EVERY, TooFewProblems, after_other_exchanges, small_talk_dialogues,
                                    tool_dialogues)
from dataset.tools import TOOLS, run_tool, tool_schemas

ROLES = ["system", "user", "assistant", "tool", "assistant"]


@pytest.fixture(scope="module")
def extracts() -> dict[str, str]:
    return {article.title: article.extract for article in read_wikipedia()}


@pytest.fixture(scope="module")
def chitchat() -> list:
    """The chit-chat corpus's dialogs, which small_talk_dialogues reads by default: read once for the module
    (about 2 s a read), given to it as `dialogs`."""
    from dataset.sources import read_chitchat

    return list(read_chitchat())


@pytest.fixture(scope="module")
def train():
    return tool_dialogues("train", seed=0, wiki_count=150, arithmetic_count=400, conversion_count=60)


@pytest.fixture(scope="module")
def held_out():
    return tool_dialogues("held_out", seed=0, wiki_count=150, arithmetic_count=100, conversion_count=40)


def call_of(dialogue: dict) -> tuple[str, dict]:
    (call,) = json.loads(dialogue["conversations"][2]["tool_calls"])
    assert set(call) == {"name", "arguments"}
    return call["name"], call["arguments"]


def canonical_problem(expression: str) -> tuple:
    """An independent canonical form: operands sorted for the commutative operators."""
    a, operator, b = expression.split()
    return (operator, *sorted((int(a), int(b)))) if operator in "+*" else (operator, int(a), int(b))


def test_dialogues_have_minimind_tool_shape_and_answers_from_the_result(train, held_out, extracts):
    for dialogue in train + held_out:
        messages = dialogue["conversations"]
        assert [m["role"] for m in messages] == ROLES
        tools = json.loads(messages[0]["tools"])
        assert [t["function"]["name"] for t in tools] == list(TOOLS) and messages[0]["content"] == ""
        assert messages[2]["content"] == ""
        name, arguments = call_of(dialogue)
        assert messages[3]["content"] == run_tool(name, arguments)  # the real tool result, as the chat loop gets it
        answer = messages[4]["content"]
        if name == "wiki":
            summary = extracts[arguments["title"]]
            assert answer and summary.startswith(answer) and answer in messages[3]["content"]
            assert answer.endswith((".", "!", "?"))
        elif name == "convert_units":
            assert answer == messages[3]["content"] + "."
            assert str(arguments["value"]) in messages[1]["content"]
            assert arguments["from_unit"] in messages[1]["content"] and arguments["to_unit"] in messages[1]["content"]
        else:
            expression = arguments["expression"]
            value = eval(expression, {"__builtins__": {}}, {})  # the reference: Python's own arithmetic
            shown = answer.removeprefix(f"{expression} = ").removesuffix(".")
            assert answer == f"{expression} = {messages[3]['content']}."
            assert math.isclose(float(shown), value, rel_tol=1e-11)
            a, _, b = expression.split()
            assert a in messages[1]["content"] and b in messages[1]["content"]


def test_counts_and_mix(train, held_out):
    for dialogues, arithmetic, conversions in ((train, 400, 60), (held_out, 100, 40)):
        names = [call_of(d)[0] for d in dialogues]
        assert names.count("wiki") == 150 and names.count("calculator") == arithmetic
        assert names.count("convert_units") == conversions
        assert names[:20].count("wiki") not in (0, 20)  # shuffled together, not one block after the other


def test_the_system_turn_is_the_one_chat_gives_by_default(train):
    """A generated dialogue's prompt is token for token what eval/chat.py sends: the tools, no system prompt."""
    from transformers import AutoTokenizer

    from tests.paths import REPO

    tokenizer = AutoTokenizer.from_pretrained(REPO / "model")
    messages = train[0]["conversations"]
    as_trained = encode_chatml(tokenizer, messages[:2], add_generation_prompt=True).input_ids
    as_chat = encode_chatml(tokenizer, messages[1:2], add_generation_prompt=True, tools=tool_schemas()).input_ids
    assert as_trained == as_chat


def test_some_dialogues_think_on_both_assistant_turns(train):
    thinking = [d for d in train if "reasoning_content" in d["conversations"][2]]
    assert 0.1 < len(thinking) / len(train) < 0.3
    for dialogue in thinking:
        assert dialogue["conversations"][4]["reasoning_content"]


def test_same_seed_same_dialogues_other_seed_other_dialogues(train):
    assert tool_dialogues("train", seed=0, wiki_count=150, arithmetic_count=400, conversion_count=60) == train
    other = tool_dialogues("train", seed=1, wiki_count=150, arithmetic_count=400, conversion_count=60)
    assert other != train and len(other) == len(train)


def test_each_article_is_asked_in_distinct_phrasings():
    """questions_per_article=2: every article's lookup twice, in two different questions that both hold the title and
    call wiki with it; one phrasing gives the first of them."""
    one = tool_dialogues("train", seed=0, wiki_count=60, arithmetic_count=0)
    two = tool_dialogues("train", seed=0, wiki_count=120, arithmetic_count=0, questions_per_article=2)
    questions: dict[str, list[str]] = {}
    for dialogue in two:
        _, arguments = call_of(dialogue)
        questions.setdefault(arguments["title"], []).append(dialogue["conversations"][1]["content"])
    assert len(two) == 120 and len(questions) == 60
    for title, asked in questions.items():
        assert len(asked) == 2 and len(set(asked)) == 2 and all(title in question for question in asked), asked
    assert {d["conversations"][1]["content"] for d in one} < {q for asked in questions.values() for q in asked}
    with pytest.raises(ValueError, match="questions_per_article"):
        tool_dialogues("train", seed=0, wiki_count=1, arithmetic_count=0, questions_per_article=8)


def test_held_out_entities_and_problems_never_appear_in_training(train, held_out, default_corpus, extracts):
    train_titles = {call_of(d)[1]["title"] for d in train if call_of(d)[0] == "wiki"}
    held_out_titles = {call_of(d)[1]["title"] for d in held_out if call_of(d)[0] == "wiki"}
    assert len(held_out_titles) == 150 and not train_titles & held_out_titles
    # Nor anywhere else in training: the held-out summaries are in no pretraining or SFT training line.
    training_text = default_corpus.pretrain_train.read_text(encoding="utf-8") + \
        default_corpus.sft_train.read_text(encoding="utf-8")
    for title in held_out_titles:
        first_sentence = extracts[title].split(". ")[0]
        assert json.dumps(first_sentence, ensure_ascii=False)[1:-1] not in training_text, title
    train_problems = {canonical_problem(call_of(d)[1]["expression"]) for d in train if call_of(d)[0] == "calculator"}
    held_out_problems = {canonical_problem(call_of(d)[1]["expression"]) for d in held_out
                         if call_of(d)[0] == "calculator"}
    assert len(train_problems) == 400 and len(held_out_problems) == 100
    assert not train_problems & held_out_problems
    conversions = {split: {json.dumps(call_of(d)[1], sort_keys=True) for d in dialogues
                           if call_of(d)[0] == "convert_units"} for split, dialogues in (("train", train),
                                                                                       ("held_out", held_out))}
    assert len(conversions["train"]) == 60 and len(conversions["held_out"]) == 40
    assert not conversions["train"] & conversions["held_out"]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="split must be one of train, held_out, got 'test'"):
        tool_dialogues("test", seed=0, wiki_count=1, arithmetic_count=1)
    with pytest.raises(ValueError, match="counts must be >= 0"):
        tool_dialogues("train", seed=0, wiki_count=-1, arithmetic_count=1)


def test_a_generated_calculation_that_fails_stops_the_build_instead_of_vanishing(monkeypatch):
    """A failing lookup (an ambiguous title) is left out; a failing calculation or conversion is a bug, so the build
    names it rather than quietly training on fewer (and load-dependent) dialogues."""
    from dataset.tools import Tool

    def broken(expression: str) -> str:
        raise RuntimeError("bug")

    monkeypatch.setitem(TOOLS, "calculator", Tool(TOOLS["calculator"].schema, broken))
    with pytest.raises(ValueError, match=r"the generated problem .* fails: calculator\(.*calculator failed"):
        tool_dialogues("train", seed=0, wiki_count=0, arithmetic_count=3)


def test_a_third_of_each_kind_continues_a_chat_after_the_other_kinds_first_exchange(train, chitchat):
    """after_other_exchanges: about one dialogue in MULTI_TURN_EVERY of each kind gets, after the system turn, the
    first exchange (user .. up to the next user) of a dialogue of the other kind; the rest is the dialogue as it
    was; the same seed gives the same lists, another seed others."""
    talk = small_talk_dialogues("train", seed=0, count=300, dialogs=chitchat)
    tool_use, small_talk = after_other_exchanges(train, talk, seed=0)
    assert after_other_exchanges(train, talk, seed=0) == (tool_use, small_talk)
    assert after_other_exchanges(train, talk, seed=1) != (tool_use, small_talk)

    def first_exchange(conversation: list[dict]) -> list[dict]:  # independent of the module's exchanges()
        nxt = next(i for i in range(2, len(conversation)) if conversation[i]["role"] == "user")
        return conversation[1:nxt]

    talk_openings = [d["conversations"][1:3] for d in talk]
    tool_exchanges = [d["conversations"][1:] for d in train]
    for originals, continued, others in ((train, tool_use, talk_openings), (talk, small_talk, tool_exchanges)):
        assert len(continued) == len(originals)
        changed = 0
        for original, row in zip(originals, continued):
            if row == original:
                continue
            changed += 1
            conversation = row["conversations"]
            assert conversation[0] == original["conversations"][0] and conversation[1]["role"] == "user"
            before = first_exchange(conversation)
            assert before in others
            assert conversation[:1] + conversation[1 + len(before):] == original["conversations"]
        assert abs(changed / len(originals) - 1 / MULTI_TURN_EVERY) < 0.08, changed


def test_a_continued_tool_dialogue_learns_its_call_and_answer_after_the_small_talk(tokenizer, train, chitchat):
    """Encoded for SFT, a continued lookup learns the small-talk reply, the call and the answer (the assistant
    tokens), never the user's or the tool's text."""
    from dataset.chat_format import normalize_messages

    talk = small_talk_dialogues("train", seed=0, count=50, dialogs=chitchat)
    tool_use, _ = after_other_exchanges(train, talk, seed=0, every=1)
    messages = normalize_messages(tool_use[0]["conversations"])
    tools = messages[0].pop("tools")
    encoding = encode_chatml(tokenizer, messages, tools=tools)
    learned = tokenizer.decode([t for t, a in zip(encoding.input_ids, encoding.assistant) if a])
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant", "tool", "assistant"]
    for message in (messages[2], messages[6]):
        assert message["content"] in learned
    assert json.dumps(messages[4]["tool_calls"][0]["arguments"], ensure_ascii=False) in learned
    assert messages[1]["content"] not in learned and messages[3]["content"] not in learned
    with pytest.raises(ValueError, match="every must be >= 1"):
        after_other_exchanges(train, talk, seed=0, every=0)


def test_the_maximum_a_refusal_names_is_the_real_one(monkeypatch):
    """TooFewProblems' `available` does not depend on the count asked: that many are drawn, one more is refused."""
    import dataset.tool_dialogues

    monkeypatch.setattr(dataset.tool_dialogues, "MAX_PROBLEM_DRAWS", 20_000)
    with pytest.raises(TooFewProblems) as refused:
        tool_dialogues("held_out", 0, 0, 0, 5000)
    available = refused.value.available
    assert refused.value.tool == "convert_units" and 0 < available < 5000
    assert len(tool_dialogues("held_out", 0, 0, 0, available)) == available
    with pytest.raises(TooFewProblems, match=f"at most {available}$"):
        tool_dialogues("held_out", 0, 0, 0, available + 1)


def test_grpo_tool_prompts_hold_train_questions_only_with_the_columns_of_their_dialogues(held_out, tmp_path):
    """dataset/tool_prompts.py: the training file's rows are train-split questions (the rule above: no held-out
    title, arithmetic problem or conversion), each the dialogue's system turn and question with the call's tool,
    arguments and result and the fact, and the PromptDataset reads them with the tool_use reward's columns."""
    from dataset.prompt_dataset import PromptDataset
    from dataset.tokenization import load_tokenizer
    from dataset.tool_prompts import FILE_NAMES, tool_prompt_rows, write_tool_prompts
    from trainer.rewards import column_problems

    rows = tool_prompt_rows("train", 1, 150, 400, 60)
    dialogues = tool_dialogues("train", 1, 150, 400, 60)
    assert [row["prompt"] for row in rows] == [dialogue["conversations"][:2] for dialogue in dialogues]
    for row, dialogue in zip(rows, dialogues):
        tool, arguments = call_of(dialogue)
        assert (row["tool"], row["arguments"]) == (tool, arguments)
        assert row["result"] == dialogue["conversations"][3]["content"] == run_tool(tool, arguments)
    assert {row["tool"] for row in rows} == set(TOOLS)
    held_out_titles = {call_of(d)[1]["title"] for d in held_out if call_of(d)[0] == "wiki"}
    assert not {row["arguments"]["title"] for row in rows if row["tool"] == "wiki"} & held_out_titles
    train_problems = {canonical_problem(row["arguments"]["expression"]) for row in rows if row["tool"] == "calculator"}
    held_out_problems = {canonical_problem(call_of(d)[1]["expression"]) for d in held_out
                         if call_of(d)[0] == "calculator"}
    assert len(train_problems) == 400 and not train_problems & held_out_problems
    train_conversions = {json.dumps(row["arguments"], sort_keys=True) for row in rows if row["tool"] == "convert_units"}
    held_out_conversions = {json.dumps(call_of(d)[1], sort_keys=True) for d in held_out
                            if call_of(d)[0] == "convert_units"}
    assert len(train_conversions) == 60 and not train_conversions & held_out_conversions
    paths = write_tool_prompts(tmp_path, seed=1, train_counts=(3, 3, 2), val_counts=(2, 2, 1))
    assert [path.name for path in paths.values()] == list(FILE_NAMES.values())
    prompts = PromptDataset(paths["train"], load_tokenizer(), 512, column_check=partial_check(column_problems),
                            tools=TOOLS)
    assert len(prompts) == 8 and set(prompts[0]["columns"]) == {"tool", "arguments", "result", "fact"}


def partial_check(column_problems):
    return lambda rows, source: column_problems(["tool_use"], rows, source)
