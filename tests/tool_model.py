"""The one memorised tool model of the tool tests (tests/integration/test_tool_eval.py, test_chat_tools.py,
test_serve_tools.py and test_web_page.py's tool loop): its rows are the union of what each of them needs, each section
below being one test file's, so one training serves them all (about 52 CPU-s, where the four models took about 69
together). The rows never depend on which tests run: every worker that builds the model builds the same one, and under
pytest-xdist it is built once for all workers (shared_tool_model)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.memorized_model import Row, memorized_model, supervised_row

POSITIONS = 512  # the tool evaluation's messages name this context (the questions with every tool's schema fit)

# Shared by several sections: a thought and its answer, a call made again and again, a call written as invalid JSON.
THOUGHT, THOUGHT_ANSWER = "The user wants me to think.", "Done."
LOOP_ASK = [{"role": "user", "content": "Loop."}]
LOOP_CALL = {"name": "calculator", "arguments": {"expression": "1+1"}}
BAD_CALL_TEXT = '{"name": "wiki", "arguments": {oops}'  # invalid JSON between the tags: not a call


def called(messages: list[dict], call: dict) -> list[dict]:
    """The conversation after the assistant's call and the tool's real result (the library's run_tool)."""
    from dataset.tools import run_tool

    return messages + [{"role": "assistant", "content": "", "tool_calls": [call]},
                       {"role": "tool", "content": run_tool(call["name"], call["arguments"])}]


def raw_call_row(tokenizer, question: str, call_text: str, tools: list[dict]) -> Row:
    """`question` answered with `call_text` between the call's tags, as written (a call that does not read)."""
    from dataset.chat_format import IM_END, TOOL_CALL, TOOL_CALL_END, control_id, encode_chatml, encode_text

    prompt = encode_chatml(tokenizer, [{"role": "user", "content": question}], add_generation_prompt=True,
                           tools=tools).input_ids
    reply = [control_id(tokenizer, TOOL_CALL), *encode_text(tokenizer, call_text),
             control_id(tokenizer, TOOL_CALL_END), control_id(tokenizer, IM_END)]
    return prompt + reply, [-100] * len(prompt) + reply


def loop_rows(tokenizer, tools: list[dict]) -> list[Row]:
    """"Loop." calls LOOP_CALL again after each of its first three results."""
    loops = [LOOP_ASK]
    for _ in range(3):
        loops.append(called(loops[-1], LOOP_CALL))
    return [supervised_row(tokenizer, loop + [{"role": "assistant", "content": "", "tool_calls": [LOOP_CALL]}],
                           tools=tools) for loop in loops]


def thought_row(tokenizer, **kwargs) -> Row:
    return supervised_row(tokenizer, [{"role": "user", "content": "Think first."}, {
        "role": "assistant", "content": THOUGHT_ANSWER, "reasoning_content": THOUGHT}], **kwargs)


# ------------------------------------------------------------ eval/tool_eval.py's (tests/integration/test_tool_eval.py)
def tool_eval_rows(tokenizer) -> list[Row]:
    """The tool dialogues of the first held-out question of each kind, asked first and after the small talk's
    opening exchange (--after_other), and the small talk, asked first and after the first question's exchange."""
    from dataset.chat_format import normalize_messages
    from dataset.tool_dialogues import small_talk_dialogues, tool_dialogues

    rows = []
    (small_talk,) = small_talk_dialogues("held_out", 0, 1)
    talk = normalize_messages(small_talk["conversations"])
    dialogues = tool_dialogues("held_out", 0, 1, 1, 1)
    for dialogue in dialogues:
        messages = normalize_messages(dialogue["conversations"])
        for before in ([], talk[1:3]):  # asked first, and after the small talk's opening exchange (--after_other)
            chat = messages[:1] + before + messages[1:]
            rows.append(supervised_row(tokenizer, chat[:3 + len(before)]))  # the question -> the call
            rows.append(supervised_row(tokenizer, chat))  # ... the tool's result -> the answer
    rows.append(supervised_row(tokenizer, talk[:3]))  # a reply, no call
    first_tool_exchange = normalize_messages(dialogues[0]["conversations"])[1:]
    # the same opening after a lookup gets another reply (the conversation's second), so the answer shows whether the
    # model saw the history
    rows.append(supervised_row(tokenizer, talk[:1] + first_tool_exchange + [talk[1], talk[4]]))
    return rows


# ----------------------------------------------------- the chat CLI's (tests/integration/test_chat_tools.py)
SUM_ASK = [{"role": "user", "content": "What is 2+3?"}]
SUM_CALL = {"name": "calculator", "arguments": {"expression": "2+3"}}
SUM_ANSWER = "The answer is 5."
PLAIN_ANSWER = "I cannot compute that."  # what it says to SUM_ASK when no tools are offered
MAGIC_ASK = [{"role": "user", "content": "Use magic."}]
MAGIC_ANSWER = "Magic failed."


def chat_rows(tokenizer) -> list[Row]:
    """With the built-in tools: the calculator called for SUM_ASK and the answer after its result, a plain answer
    without tools, a call to a tool that does not exist and the answer after its error, the loop and a thought."""
    from dataset.tools import tool_schemas

    tools = tool_schemas()
    magic = {"name": "magic", "arguments": {}}
    return [
        supervised_row(tokenizer, SUM_ASK + [{"role": "assistant", "content": "", "tool_calls": [SUM_CALL]}],
                       tools=tools),
        supervised_row(tokenizer, called(SUM_ASK, SUM_CALL) + [{"role": "assistant", "content": SUM_ANSWER}],
                       tools=tools),
        supervised_row(tokenizer, SUM_ASK + [{"role": "assistant", "content": PLAIN_ANSWER}]),
        supervised_row(tokenizer, MAGIC_ASK + [{"role": "assistant", "content": "", "tool_calls": [magic]}],
                       tools=tools),
        supervised_row(tokenizer, called(MAGIC_ASK, magic) + [{"role": "assistant", "content": MAGIC_ANSWER}],
                       tools=tools),
        *loop_rows(tokenizer, tools),
        thought_row(tokenizer, tools=tools),
    ]


# ------------------------------------------- the web page's (tests/integration/test_web_page.py's tool loop)
WIKI_ASK = [{"role": "user", "content": "What is Paris?"}]
WIKI_CALL = {"name": "wiki", "arguments": {"title": "Paris"}}
WIKI_ANSWER = "Paris is the capital of France."  # after the built-in wiki's result


def page_rows(tokenizer) -> list[Row]:
    """With the server's tools (the built-in ones) in the prompt: a wiki call and the answer after its result, the
    loop, a thought (open_thinking) and a call written as invalid JSON."""
    from dataset.tools import tool_schemas

    tools = tool_schemas()
    return [
        supervised_row(tokenizer, WIKI_ASK + [{"role": "assistant", "content": "", "tool_calls": [WIKI_CALL]}],
                       tools=tools),
        supervised_row(tokenizer, called(WIKI_ASK, WIKI_CALL) + [{"role": "assistant", "content": WIKI_ANSWER}],
                       tools=tools),
        *loop_rows(tokenizer, tools),
        thought_row(tokenizer, tools=tools),
        raw_call_row(tokenizer, "Break it.", BAD_CALL_TEXT, tools),
    ]


# -------------------------------------------- the server's (tests/integration/test_serve_tools.py)
SERVED_WIKI = {"type": "function", "function": {"name": "wiki", "description": "Look a title up.", "parameters": {
    "type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"]}}}
SERVED_TOOLS = [SERVED_WIKI]  # a client's own tool, not the built-in wiki: the same question gets its own prompt
SUMMARY = "Paris is the capital of France."  # the client's tool result
SERVED_ANSWER = "It is the capital of France."


def served_tool_turn(call_id: str = "call_1") -> list[dict]:
    """WIKI_ASK after the call: the assistant's call (OpenAI's wire form) and the tool's response, SUMMARY."""
    return WIKI_ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": "wiki",
                                                         "arguments": json.dumps(WIKI_CALL["arguments"])}}]},
        {"role": "tool", "tool_call_id": call_id, "content": SUMMARY}]


def served_rows(tokenizer) -> list[Row]:
    """With SERVED_TOOLS: the call, the answer after the response, a bad call and a call to a tool that is not
    offered; and a thought without tools."""
    return [
        supervised_row(tokenizer, WIKI_ASK + [{"role": "assistant", "content": "", "tool_calls": [WIKI_CALL]}],
                       tools=SERVED_TOOLS),
        supervised_row(tokenizer, served_tool_turn() + [{"role": "assistant", "content": SERVED_ANSWER}],
                       tools=SERVED_TOOLS),
        thought_row(tokenizer),
        raw_call_row(tokenizer, "Break it.", BAD_CALL_TEXT, SERVED_TOOLS),
        raw_call_row(tokenizer, "Use magic.", '{"name": "magic", "arguments": {}}', SERVED_TOOLS),
    ]


def tool_rows(tokenizer) -> list[Row]:
    """Every section's rows, a row that two sections share once."""
    rows: list[Row] = []
    for row in (*tool_eval_rows(tokenizer), *chat_rows(tokenizer), *page_rows(tokenizer), *served_rows(tokenizer)):
        if row not in rows:
            rows.append(row)
    return rows


def shared_tool_model(tmp_path_factory, tokenizer, worker_id: str) -> Path:
    """The model directory, trained once per test run (tests/conftest.py's run_wide_folder): under pytest-xdist the
    first worker to ask trains it, and the others wait and reuse it."""
    from tests.conftest import run_wide_folder

    with run_wide_folder(tmp_path_factory, worker_id, "tool_model") as path:
        if not (path / "done").is_file():
            memorized_model(tokenizer, tool_rows(tokenizer), path, positions=POSITIONS)
            (path / "done").touch()  # a worker killed mid-save leaves no marker: the next one trains again
    return path
