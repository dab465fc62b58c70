"""Tool calling and thinking through scripts/serve.py's app (under uvicorn in this process) with the official `openai`
client: a tiny model trained, full-batch, to answer fixed questions with fixed tool calls, a fixed answer after a tool's
response, a fixed thought, and badly written calls (tests/tool_model.py's served_rows, in the model the tool tests
share). The expected calls and texts are the training data's; the prompt token counts come from the library's encoder in
this process."""

from __future__ import annotations

import json
import re

import openai
import pytest

from tests.tool_model import BAD_CALL_TEXT, SUMMARY, THOUGHT
from tests.tool_model import SERVED_ANSWER as ANSWER
from tests.tool_model import SERVED_TOOLS as TOOLS
from tests.tool_model import SERVED_WIKI as WIKI
from tests.tool_model import WIKI_ASK as ASK
from tests.tool_model import WIKI_CALL as CALL
from tests.tool_model import served_tool_turn as tool_turn

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = {"temperature": 0.0, "max_tokens": 40}


@pytest.fixture(scope="module")
def server(tool_model, threaded_server):
    from scripts.server.app import create_app
    from scripts.server.served_model import load_served_model

    with threaded_server(create_app(load_served_model(tool_model, max_batch=2))) as running:
        yield running.url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=120)


def streamed(client, **request) -> tuple[dict, str]:
    """A streamed completion's deltas joined into a message (tool calls by index), and its finish reason."""
    message = {"content": "", "reasoning_content": "", "tool_calls": {}}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **request):
        choice = chunk.choices[0]
        delta = choice.delta.model_dump(exclude_none=True)
        message["content"] += delta.get("content") or ""
        message["reasoning_content"] += delta.get("reasoning_content") or ""
        for call in delta.get("tool_calls") or []:
            message["tool_calls"][call["index"]] = {"name": call["function"]["name"],
                                                    "arguments": call["function"]["arguments"], "id": call["id"]}
        if choice.finish_reason:
            assert finish is None, "one finish reason, in the last chunk"
            finish = choice.finish_reason
    return message, finish


def whole(message) -> dict:
    """A non-streamed message in streamed()'s shape."""
    data = message.model_dump()
    return {"content": data["content"] or "", "reasoning_content": data.get("reasoning_content") or "",
            "tool_calls": {i: {"name": c["function"]["name"], "arguments": c["function"]["arguments"], "id": c["id"]}
                           for i, c in enumerate(data.get("tool_calls") or [])}}


def same_but_ids(a: dict, b: dict) -> bool:
    strip = lambda m: {**m, "tool_calls": {i: {**c, "id": None} for i, c in m["tool_calls"].items()}}  # noqa: E731
    return strip(a) == strip(b)


def test_a_two_request_tool_loop_with_the_openai_client(client) -> None:
    first = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, **GREEDY)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert re.fullmatch(r"call_[0-9a-f]{24}", call.id) and call.type == "function"
    assert call.function.name == "wiki" and json.loads(call.function.arguments) == CALL["arguments"]
    assert not choice.message.content
    # the second request sends the call back as the client received it, and the tool's response
    second = client.chat.completions.create(model="m", tools=TOOLS, **GREEDY, messages=ASK + [
        choice.message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": SUMMARY}])
    assert second.choices[0].message.content == ANSWER and second.choices[0].finish_reason == "stop"
    assert second.choices[0].message.tool_calls is None


def calling(*ids: str) -> dict:
    """An assistant message calling wiki once per id, in OpenAI's wire form."""
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": i, "type": "function", "function": {"name": "wiki", "arguments": json.dumps(CALL["arguments"])}}
        for i in ids]}


def answer(call_id: str | None) -> dict:
    """A tool message answering the call `call_id` (None: a tool message without tool_call_id)."""
    return {"role": "tool", "content": SUMMARY, **({"tool_call_id": call_id} if call_id is not None else {})}


# Tool messages that answer no call, and calls that get no answer: OpenAI's API refuses each with a 400, its param
# the message (what the client must fix) and its message naming the ids.
UNPAIRED = {
    "a tool message after a user message": (
        ASK + [answer("call_1")], "messages[1]",
        "messages[1]: a message with role 'tool' must be a response to a preceding assistant message with "
        "'tool_calls'"),
    "a tool message after the answer that followed the loop": (
        tool_turn() + [{"role": "assistant", "content": ANSWER}, answer("call_1")], "messages[4]",
        "messages[4]: a message with role 'tool' must be a response"),
    "a tool message naming another call": (
        ASK + [calling("call_1", "call_2"), answer("call_1"), answer("call_9")], "messages[3].tool_call_id",
        'messages[3].tool_call_id: "call_9" is not the id of a call in the tool_calls of messages[1] '
        '("call_1", "call_2")'),
    "a tool message naming a call of an earlier assistant message": (
        tool_turn("call_1") + [calling("call_2"), answer("call_1")], "messages[4].tool_call_id",
        '"call_1" is not the id of a call in the tool_calls of messages[3] ("call_2")'),
    "a call answered twice": (
        ASK + [calling("call_1", "call_2"), answer("call_1"), answer("call_2"), answer("call_1")],
        "messages[4].tool_call_id",
        'messages[4].tool_call_id: duplicate value "call_1", in messages[2] and messages[4] (a call is answered once)'),
    "two calls of one id": (
        ASK + [calling("call_1", "call_2", "call_1"), answer("call_1"), answer("call_2")],
        "messages[1].tool_calls[2].id",
        'messages[1].tool_calls[2].id: duplicate value "call_1", also messages[1].tool_calls[0]\'s (each call needs '
        "its own id, which its answer names)"),
    "a call id holding a newline, named in one line": (
        ASK + [calling("call\n1", "call_2"), answer("call_2"), answer("call_9")], "messages[3].tool_call_id",
        'messages[3].tool_call_id: "call_9" is not the id of a call in the tool_calls of messages[1] ("call\\n1", '
        '"call_2")'),
    "a tool message without tool_call_id": (
        ASK + [calling("call_1"), answer(None)], "messages[2].tool_call_id", "messages[2].tool_call_id: is required"),
    "a call left unanswered before a user message": (
        ASK + [calling("call_1", "call_2"), answer("call_2"), {"role": "user", "content": "And?"}], "messages[1]",
        "messages[1]: an assistant message with 'tool_calls' must be followed by tool messages responding to each "
        "'tool_call_id'; the following tool_call_ids did not have response messages: \"call_1\""),
    "calls left unanswered at the end": (
        ASK + [calling("call_1", "call_2")], "messages[1]",
        'the following tool_call_ids did not have response messages: "call_1", "call_2"'),
    "a call without an id": (
        ASK + [{"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "wiki", "arguments": "{}"}}]}], "messages[1].tool_calls[0].id",
        "messages[1].tool_calls[0].id: is required"),
}


@pytest.mark.parametrize(("messages", "param", "phrase"), UNPAIRED.values(), ids=UNPAIRED.keys())
def test_tool_messages_that_answer_no_call_are_refused(client, messages, param, phrase) -> None:
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="m", messages=messages, tools=TOOLS, stream=stream, **GREEDY)
        error = refused.value.body
        assert refused.value.status_code == 400 and error["type"] == "invalid_request_error", error
        assert error["param"] == param and phrase in error["message"] and "\n" not in error["message"], error


def test_calls_answered_in_any_order_are_accepted(client) -> None:
    """OpenAI pairs answers with calls by id, not by place: two calls answered in the other order, and a loop of
    two rounds, are answered (the format shows the answers in the order they are sent: docs/serving.md)."""
    for messages in (ASK + [calling("call_1", "call_2"), answer("call_2"), answer("call_1")],
                     tool_turn("call_1") + [calling("call_2"), answer("call_2")],
                     tool_turn("call_1") + [calling("call_1"), answer("call_1")]):  # an id again in a later round
        response = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, **GREEDY)
        assert response.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_a_strict_tool_is_accepted_and_called_as_any_other(client) -> None:
    """OpenAI's clients may send "strict": true by default: accepted, rendered as the tool without it (the same
    prompt, so the same call), and promising nothing more (docs/serving.md)."""
    strict = {"type": "function", "function": {**WIKI["function"], "strict": True}}
    choice = client.chat.completions.create(model="m", messages=ASK, tools=[strict], **GREEDY).choices[0]
    [call] = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and call.function.name == "wiki"
    assert json.loads(call.function.arguments) == CALL["arguments"]


CASES = {
    "call": dict(messages=ASK, tools=TOOLS),
    "answer after the response": dict(messages=tool_turn(), tools=TOOLS),
    "thinking": dict(messages=[{"role": "user", "content": "Think first."}],
                     extra_body={"chat_template_kwargs": {"open_thinking": True}}),
    "bad call": dict(messages=[{"role": "user", "content": "Break it."}], tools=TOOLS),
    "unknown tool": dict(messages=[{"role": "user", "content": "Use magic."}], tools=TOOLS),
}


@pytest.mark.parametrize("request_fields", CASES.values(), ids=CASES.keys())
def test_streamed_deltas_join_into_the_whole_message(client, request_fields) -> None:
    response = client.chat.completions.create(model="m", **request_fields, **GREEDY)
    message, finish = streamed(client, model="m", **request_fields, **GREEDY)
    assert same_but_ids(message, whole(response.choices[0].message)), (message, response.choices[0].message)
    assert finish == response.choices[0].finish_reason
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", call["id"]) for call in message["tool_calls"].values())


def test_thinking_comes_back_as_reasoning_content(client) -> None:
    response = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Think first."}],
                                              extra_body={"chat_template_kwargs": {"open_thinking": True}}, **GREEDY)
    message = response.choices[0].message.model_dump()
    assert message["reasoning_content"] == THOUGHT and message["content"] == "Done."


def test_a_thought_cut_by_max_tokens_is_reasoning_streamed_or_not(client) -> None:
    """A reply that opened <think> and ran out of tokens before </think> is all reasoning (as it streamed: the
    reasoning deltas are the message's), never content that starts with the tag."""
    fields = dict(model="m", messages=[{"role": "user", "content": "Think first."}], temperature=0.0, max_tokens=5,
                  extra_body={"chat_template_kwargs": {"open_thinking": True}})
    response = client.chat.completions.create(**fields)
    message = response.choices[0].message.model_dump()
    assert response.choices[0].finish_reason == "length"
    assert not message["content"] and message["reasoning_content"] and THOUGHT.startswith(message["reasoning_content"])
    streamed_message, finish = streamed(client, **fields)
    assert same_but_ids(streamed_message, whole(response.choices[0].message)) and finish == "length"
    deltas = [chunk.choices[0].delta.model_dump(exclude_none=True)
              for chunk in client.chat.completions.create(stream=True, **fields) if chunk.choices]
    pieces = [delta["reasoning_content"] for delta in deltas if delta.get("reasoning_content")]
    assert len(pieces) > 1  # the thought streamed as it was generated, not at the end


@pytest.mark.parametrize(("question", "text"), [("Break it.", BAD_CALL_TEXT),
                                                ("Use magic.", '{"name": "magic", "arguments": {}}')])
def test_a_badly_written_call_comes_back_as_content(client, question, text) -> None:
    response = client.chat.completions.create(model="m", messages=[{"role": "user", "content": question}],
                                              tools=TOOLS, **GREEDY)
    choice = response.choices[0]
    assert choice.message.content == f"<tool_call>{text}</tool_call>"
    assert choice.message.tool_calls is None and choice.finish_reason == "stop"


def test_tool_choice_none_renders_no_tools_and_reads_no_calls(client, tokenizer) -> None:
    from dataset.chat_format import encode_chatml

    response = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="none", **GREEDY)
    expected = len(encode_chatml(tokenizer, ASK, add_generation_prompt=True).input_ids)
    assert response.usage.prompt_tokens == expected
    assert response.choices[0].message.tool_calls is None and response.choices[0].finish_reason != "tool_calls"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "wiki"}}])
def test_a_demanded_call_is_started_in_the_prompt(client, tokenizer, choice) -> None:
    """tool_choice "required" or a named tool: the reply starts with the call (its opening, and for a named tool
    its name, are appended to the prompt), so the model writes the arguments."""
    from dataset.chat_format import encode_chatml, encode_text

    base = len(encode_chatml(tokenizer, ASK, add_generation_prompt=True, tools=TOOLS).input_ids)
    forced = 1 + (len(encode_text(tokenizer, '{"name": "wiki", "arguments":')) if isinstance(choice, dict) else 0)
    response = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice=choice, **GREEDY)
    assert response.usage.prompt_tokens == base + forced
    [call] = response.choices[0].message.tool_calls
    assert call.function.name == "wiki" and json.loads(call.function.arguments) == CALL["arguments"]
    message, finish = streamed(client, model="m", messages=ASK, tools=TOOLS, tool_choice=choice, **GREEDY)
    assert same_but_ids(message, whole(response.choices[0].message)) and finish == "tool_calls"


@pytest.mark.parametrize("choice", [None, "required"])
def test_sampled_requests_spell_their_calls_greedily(client, choice) -> None:
    """With tools offered, a call's JSON is decoded greedily whatever the temperature (the server's default, as in
    chat): sampled hot, every call the model opens is the one it learned, and a demanded call (its opening in the
    prompt) is spelled right on every seed."""
    fields = {} if choice is None else {"tool_choice": choice}
    calls = []
    for seed in range(12):
        response = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, temperature=1.5, top_p=1.0,
                                                  seed=seed, max_tokens=40, **fields)
        calls += [{"name": call.function.name, "arguments": json.loads(call.function.arguments)}
                  for call in response.choices[0].message.tool_calls or []]
    assert len(calls) >= (12 if choice else 6) and all(call == CALL for call in calls)


# --------------------------------------------------------------------------- the reply reader, without a model
def _ids(tokenizer, *pieces) -> list[int]:
    """Ids from pieces: a str is text, a control token's name (dataset.chat_format's constants) is its id."""
    from dataset.chat_format import CONTROL_TOKENS, control_id, encode_text

    return [i for p in pieces for i in ([control_id(tokenizer, p)] if p in CONTROL_TOKENS
                                        else encode_text(tokenizer, p))]


def _joined_stream(reader, ids: list[int]) -> dict:
    """The deltas of a DeltaStream fed `ids` one more at a time, then final, joined into a message."""
    from scripts.server.replies import DeltaStream

    stream = DeltaStream(reader)
    joined = {"content": "", "reasoning_content": "", "tool_calls": []}
    deltas = [d for n in range(1, len(ids) + 1) for d in stream.deltas(ids[:n])] + stream.deltas(ids, final=True)
    for delta in deltas:
        for key, value in delta.items():
            joined[key] += [(c["function"]["name"], c["function"]["arguments"]) for c in value] \
                if key == "tool_calls" else value
    return joined


GOOD = ("<tool_call>", '{"name": "wiki", "arguments": {"title": "X"}}', "</tool_call>")
REPLIES = {  # (pieces, stop strings)
    "a stray </think> mid-reply (the fuzzer's)": (("Hello there ", "</think>", "World"), ()),
    "plain": (("Hello there, world",), ()),
    "a call after words": (("Let me see.\n", *GOOD), ()),
    "a stray opener, then a call": (("<tool_call>", '{"name": "wi', *GOOD, " after"), ()),
    "a stray opener, words, a call, a stray opener": (("<tool_call>", "oops ", *GOOD, "<tool_call>", "tail"), ()),
    "a thought, then an answer": (("<think>", "\nthinking a lot\n", "</think>", "\n\nanswer"), ()),
    "a thought cut short": (("<think>", "\nstill thinking", "<tool_call>", '{"name"'), ()),
    "a thought holding an unclosed call, then a call": (("<think>", "a", "<tool_call>", "b", "</think>", "c",
                                                         *GOOD), ()),
    "two closers": (("<think>", "a", "</think>", "b", "</think>", "c"), ()),
    "words, then a thought's tags": (("pre", "<think>", "x", "</think>", "post"), ()),
    "a closer before an opener": (("</tool_call>", *GOOD, "</think>", "</tool_call>"), ()),
    "a call not offered": (("x ", "<tool_call>", '{"name": "calculator", "arguments": {}}', "</tool_call>", " y"),
                           ()),
    "a stop string": (("Hello STOP world",), ("STOP",)),
    "a stop string across a call": (("abc ST", *GOOD, "OP d"), ("STOP",)),
    "a stop string from the reply's start, longer than the content so far": (("ST", "OP d"), ("STOP",)),
    "newlines around a call": (("abc\n\n", *GOOD, "\n\ndef", "<|im_end|>"), ()),
    "characters of several tokens": (("I like 🙂🙂 and 中文 </think>",), ()),
}


@pytest.mark.parametrize(("pieces", "stop"), REPLIES.values(), ids=REPLIES.keys())
def test_a_streamed_reply_joins_into_the_whole_reply(tokenizer, pieces, stop) -> None:
    """Whatever the ids, the deltas sent as they come (reasoning, content, calls) join into the message read from
    the whole reply: one rule (parse_assistant_ids) says what a thought, a call and content are."""
    from scripts.server.replies import ReplyReader

    ids = _ids(tokenizer, *pieces)
    whole_message = ReplyReader(tokenizer, ["wiki"], stop=stop).message(ids)
    reader = ReplyReader(tokenizer, ["wiki"], stop=stop)
    assert _joined_stream(reader, ids) == {
        "content": whole_message["content"] or "", "reasoning_content": whole_message.get("reasoning_content", ""),
        "tool_calls": [(c["function"]["name"], c["function"]["arguments"])
                       for c in whole_message.get("tool_calls", [])]}


def test_a_stray_think_end_is_content_streamed_or_not(tokenizer) -> None:
    from scripts.server.replies import ReplyReader

    ids = _ids(tokenizer, "Hello there ", "</think>", "World")
    assert ReplyReader(tokenizer, []).message(ids) == {"content": "Hello there </think>World"}
    assert _joined_stream(ReplyReader(tokenizer, []), ids) == {
        "content": "Hello there </think>World", "reasoning_content": "", "tool_calls": []}


@pytest.mark.parametrize("text", [' {"title": "Paris"}, "name": "wiki"}',
                                  ' {}, "function": {"name": "wiki", "arguments": {"title": "Paris"}}}'])
def test_a_named_tool_choice_cannot_be_renamed_by_the_reply(tokenizer, text) -> None:
    """tool_choice names calculator: the prompt ends with the call's start, naming it; a reply that goes on to name
    wiki (a key given twice, a nested function object) is no call, though wiki is offered."""
    from types import SimpleNamespace

    from scripts.server.completion import prompt_ids
    from scripts.server.protocol import parse_chat_request

    calculator = {"type": "function", "function": {"name": "calculator", "parameters": {
        "type": "object", "properties": {"expression": {"type": "string"}}}}}
    request = parse_chat_request(json.dumps({"messages": ASK, "tools": [WIKI, calculator], "tool_choice": {
        "type": "function", "function": {"name": "calculator"}}}).encode())
    served = SimpleNamespace(tokenizer=tokenizer, use_template=True, max_context=4096)
    _, reader = prompt_ids(request, served, request.offered_tools())
    message = reader.message(_ids(tokenizer, text, "</tool_call>", "<|im_end|>"))
    assert "tool_calls" not in message and message["content"].startswith('<tool_call>{"name": "calculator"')
    good = reader.message(_ids(tokenizer, ' {"expression": "1+1"}}', "</tool_call>"))
    assert [c["function"]["name"] for c in good["tool_calls"]] == ["calculator"]


def test_a_request_s_tools_are_parsed_once(server, client, monkeypatch) -> None:
    """The route parses the offered tools once and hands them on: to the prompt and to the greedy tool-call span."""
    import scripts.server.protocol as protocol

    calls = []
    parse_tools = protocol.parse_tools
    monkeypatch.setattr(protocol, "parse_tools", lambda tools: calls.append(tools) or parse_tools(tools))
    response = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, **GREEDY)
    assert response.choices[0].message.tool_calls[0].function.name == "wiki"
    assert len(calls) == 1


@pytest.mark.parametrize(("request_fields", "parts"), [
    (CASES["call"], ["<tool_call>", '"name": "wiki"', '"title": "Paris"', "</tool_call>"]),
    (CASES["thinking"], [THOUGHT, "</think>", "Done."])], ids=["call", "thinking"])
def test_logprobs_cover_every_generated_token_of_a_call_or_a_thought(client, request_fields, parts) -> None:
    """The logprobs' entries are every generated token in order -- a call's control tokens and JSON, a thought and
    its tags, the closing <|im_end|> -- whether the reply reads as content, reasoning or a call; streamed alike."""
    fields = dict(model="m", **request_fields, **GREEDY, logprobs=True)
    response = client.chat.completions.create(**fields)
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    text = b"".join(bytes(entry.bytes) for entry in content).decode()
    assert text.endswith("<|im_end|>") and all(part in text for part in parts), text
    assert [text.index(part) for part in parts] == sorted(text.index(part) for part in parts)
    chunks = [c for c in client.chat.completions.create(stream=True, **fields) if c.choices and c.choices[0].logprobs]
    assert [entry for chunk in chunks for entry in chunk.choices[0].logprobs.content] == content


def test_a_stop_string_is_not_looked_for_in_the_imposed_call_prefix(tokenizer) -> None:
    """tool_choice names wiki and stop is "name": the prefix `<tool_call>{"name": "wiki", "arguments":` is prompt,
    not generated text (OpenAI's stop strings apply to generated text); a reply that writes its call badly kept
    `<tool_call>{"` as its content, cut inside the prefix."""
    from scripts.server.replies import ReplyReader, forced_call_prefix

    prefix = forced_call_prefix(tokenizer, "wiki")
    reader = ReplyReader(tokenizer, ["wiki"], prefix, stop=["name"])
    content = reader.message(_ids(tokenizer, ' oops, a name', "<|im_end|>"))["content"]
    assert content == '<tool_call>{"name": "wiki", "arguments": oops, a '
    assert _joined_stream(ReplyReader(tokenizer, ["wiki"], prefix, stop=["name"]),
                          _ids(tokenizer, ' oops, a name', "<|im_end|>"))["content"] == content


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "wiki"}}])
def test_a_demanded_call_on_a_plain_continuation_is_refused(tokenizer, choice) -> None:
    """--mode plain (or a pretrained model) has no calls: the demand was dropped and plain text answered."""
    from types import SimpleNamespace

    from scripts.server.completion import prompt_ids
    from scripts.server.errors import APIError
    from scripts.server.protocol import parse_chat_request

    request = parse_chat_request(json.dumps({"messages": ASK, "tools": [WIKI], "tool_choice": choice}).encode())
    served = SimpleNamespace(tokenizer=tokenizer, use_template=False, max_context=4096)
    with pytest.raises(APIError) as error:
        prompt_ids(request, served, request.offered_tools())
    assert error.value.status == 400 and error.value.param == "tool_choice"


@pytest.mark.parametrize("request_fields, stop, expected", [
    (CASES["thinking"], "me", {"reasoning_content": THOUGHT, "content": "Done.", "tool_calls": {}}),
    (CASES["call"], "title", {"reasoning_content": "", "content": "",
                              "tool_calls": {0: {"name": "wiki", "arguments": json.dumps(CALL["arguments"]),
                                                 "id": None}}}),
])
def test_a_stop_string_in_a_thought_or_a_call_does_not_end_the_reply(client, request_fields, stop, expected) -> None:
    """Stop strings are the content's: the engine looked for them in all the text, so 'me' ended the thought
    mid-sentence (no answer) and 'title' broke the call into content."""
    fields = dict(model="m", **request_fields, **GREEDY, stop=[stop])
    response = client.chat.completions.create(**fields)
    message, finish = streamed(client, **fields)
    assert same_but_ids(whole(response.choices[0].message), expected), response.choices[0].message
    assert same_but_ids(message, expected) and finish == response.choices[0].finish_reason != "length"


def test_a_stop_string_in_the_content_still_ends_the_reply_there(client) -> None:
    fields = dict(model="m", messages=tool_turn(), tools=TOOLS, **GREEDY, stop=[ANSWER[5:9]])
    response = client.chat.completions.create(**fields)
    message, finish = streamed(client, **fields)
    assert response.choices[0].message.content == message["content"] == ANSWER[:5]
    assert finish == response.choices[0].finish_reason == "stop"
    assert response.usage.completion_tokens < client.chat.completions.create(
        model="m", messages=tool_turn(), tools=TOOLS, **GREEDY).usage.completion_tokens  # generation ended there
