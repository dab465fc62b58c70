"""scripts/serve.py's app under uvicorn in this process, sent what a hostile or careless client sends: every such
request gets a 400 in OpenAI's error shape (or, failing mid-generation, a finished stream with an error event),
never a 500 with internal text, and never fails another request. Also: what OpenAI accepts is accepted, and the
OpenAPI document describes the real request model."""

from __future__ import annotations

import functools
import json

import httpx
import pytest

from dataset.shown_value import MAX_SHOWN
from scripts.server.app import create_app
from scripts.server.errors import INTERNAL_ERROR
from scripts.server.served_model import load_served_model

USER = [{"role": "user", "content": "Hi!"}]
TIMEOUT = httpx.Timeout(60)


@pytest.fixture(scope="module")
def served(tiny_models):
    return load_served_model(tiny_models.sft, max_batch=4)


@pytest.fixture(scope="module")
def server(served, threaded_server):
    with threaded_server(create_app(served)) as running:
        yield running.url


def post(url: str, body: bytes | dict) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{url}/v1/chat/completions", content=content, timeout=TIMEOUT,
                      headers={"content-type": "application/json"})


def with_fields(**fields) -> bytes:
    """A well-formed request plus `fields`, written as Python's json writes them (NaN, Infinity and lone
    surrogates as the \\u escapes JSON allows)."""
    return json.dumps({"messages": USER, "max_tokens": 4, **fields}).encode()


NESTED = b'{"messages": [{"role": "user", "content": "x"}], "extra": ' + b"[" * 1000 + b"]" * 1000 + b"}"
HOSTILE = {
    "seed 2**64": (with_fields(seed=2**64), "seed"),
    "seed -2**63 - 1": (with_fields(seed=-2**63 - 1), "seed"),
    "temperature 1e-45": (with_fields(temperature=1e-45), "temperature"),
    "temperature 2e-38": (with_fields(temperature=2e-38), "temperature"),
    "repetition_penalty 3e-38": (with_fields(repetition_penalty=3e-38), "repetition_penalty"),
    "repetition_penalty 2e-38": (with_fields(repetition_penalty=2e-38), "repetition_penalty"),
    "repetition_penalty 1e300": (with_fields(repetition_penalty=1e300), "repetition_penalty"),
    # named by the field that holds them (test_a_number_json_lacks_is_named_by_its_field): "body is not valid JSON"
    "repetition_penalty Infinity": (with_fields(repetition_penalty=float("inf")),
                                    'body["repetition_penalty"] is not valid JSON (Infinity is not a JSON number)'),
    "temperature NaN": (with_fields(temperature=float("nan")),
                        'body["temperature"] is not valid JSON (NaN is not a JSON number)'),
    "top_p -Infinity": (with_fields(top_p=float("-inf")), 'body["top_p"] is not valid JSON (-Infinity is not'),
    "a number beyond float64": (with_fields().replace(b'"max_tokens": 4', b'"top_p": 1e400'),
                                'body["top_p"] is not valid JSON (1e400 is beyond the range of a 64-bit float)'),
    "an integer of 5000 digits": (with_fields().replace(b'"max_tokens": 4', b'"seed": ' + b"9" * 5000), "JSON"),
    "lone surrogate in content": (json.dumps({"messages": [{"role": "user", "content": "a\ud800b"}]}).encode(),
                                  "surrogate"),
    "lone surrogate in a part": (json.dumps({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "\udfff"}]}]}).encode(), "surrogate"),
    "lone surrogate in stop": (with_fields(stop=["\ud83d"]), "surrogate"),
    "lone surrogate in a key": (json.dumps({"messages": USER, "\ud800": 1}).encode(), "surrogate"),
    "1000 levels in an extra field": (NESTED, "body is nested too deeply (more than 100 levels"),
    "1000 levels as messages": (b'{"messages": ' + b"[" * 1000 + b"]" * 1000 + b"}", "body is nested too deeply"),
    "101 levels in an extra field": (NESTED.replace(b"[" * 1000 + b"]" * 1000, b"[" * 100 + b"]" * 100),
                                     "body is nested too deeply (more than 100 levels"),
    "a key given twice": (with_fields().replace(b'"max_tokens": 4', b'"max_tokens": 4, "max_tokens": 9000'),
                          'body has a duplicate key "max_tokens"'),
    "a key given twice in a message": (json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode().replace(
        b'"content"', b'"role": "system", "content"'), 'body has a duplicate key "role"'),
    "UTF-16": ('{"messages": [{"role": "user", "content": "x"}]}'.encode("utf-16"),
               "body is not valid UTF-8 (byte 0xff at offset 0)"),
    "max_tokens 22.5": (with_fields(max_tokens=22.5), "max_tokens"),
    "a stop list holding a number": (with_fields(stop=["a", 1]), "stop[1]: Input should be a valid string"),
    # a key is a text, which the body's 4300-digit bound on integers does not reach: int() of it raised, a 500
    "a logit_bias key of 5000 digits": (with_fields(logit_bias={"9" * 5000: 1}),
                                        "logit_bias: keys are token ids written as decimal integers (at most 20 "
                                        f'digits, leading zeros aside), got "{"9" * (MAX_SHOWN - 4)}...'),
    "a logit_bias key of 21 digits": (with_fields(logit_bias={"1" + "0" * 20: 1}), f'got "1{"0" * 20}"'),
    "a logit_bias key of 21 digits after zeros": (with_fields(logit_bias={"00" + "1" * 21: 1}),
                                                  f'got "00{"1" * 21}"'),
    # int() reads both as token 5: which value would count is anyone's guess
    "two logit_bias keys of one token": (with_fields(logit_bias={"5": 1, "0005": -1}),
                                         'logit_bias: keys "5" and "0005" name the same token 5'),
    # isdigit() takes other scripts' digits, and int() reads Arabic-Indic five as 5 (a superscript two it refuses),
    # but a key is ASCII digits; a key of exactly 20 digits is within the bound and names no token of ours
    "a logit_bias key of a non-ASCII digit": (with_fields(logit_bias={"\u0665": 1}), 'got "\\u0665"'),
    "a logit_bias key of a superscript digit": (with_fields(logit_bias={"\u00b2": 1}), 'got "\\u00b2"'),
    "a logit_bias key of 20 digits": (with_fields(logit_bias={"9" * 20: 1}),
                                      f"logit_bias names token {'9' * 20}; token ids are 0 to "),
}
WIKI = {"type": "function", "function": {"name": "wiki", "parameters": {
    "type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"]}}}


def calling(arguments) -> list[dict]:
    """USER, then an assistant message calling wiki with `arguments` (OpenAI sends them as a JSON string)."""
    return USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "wiki", "arguments": arguments}}]}]


# Malformed tools payloads: a 400 whose message names the field.
HOSTILE.update({
    "tools not a list": (with_fields(tools={"type": "function"}), "tools: "),
    "a tool without its function": (with_fields(tools=[{"type": "function"}]), "tools[0].function"),
    "a tool of another type": (with_fields(tools=[{"type": "retrieval", "function": {"name": "x"}}]),
                               "tools[0].type"),
    "a tool name with a space": (with_fields(tools=[{"type": "function", "function": {"name": "a b"}}]),
                                 "tools[0].function.name"),
    "parameters not an object": (with_fields(tools=[{"type": "function", "function": {
        "name": "a", "parameters": "x"}}]), "tools[0].function.parameters"),
    "properties not an object": (with_fields(tools=[{"type": "function", "function": {
        "name": "a", "parameters": {"properties": [1]}}}]), "tools[0].function.parameters"),
    "tool_choice unknown word": (with_fields(tools=[WIKI], tool_choice="always"), "tool_choice"),
    "tool_choice names no offered tool": (with_fields(tools=[WIKI], tool_choice={
        "type": "function", "function": {"name": "calc"}}), "tool_choice: no tool 'calc'"),
    "tool_choice without a name": (with_fields(tools=[WIKI], tool_choice={"type": "function", "function": {}}),
                                   "tool_choice.function.name"),
    "tool_choice required without tools": (with_fields(tool_choice="required"), "tool_choice"),
    # OpenAI's rule: "'tool_choice' is only allowed when 'tools' are specified", and the same for parallel_tool_calls
    **{f"{field} {json.dumps(value)}, {json.dumps(tools)[1:-1] or 'no tools'}": (
        with_fields(**{field: value}, **tools), f"{field}: is only allowed when tools are given (this request offers "
                                                "none)")
       for field, value in (("tool_choice", "none"), ("tool_choice", "auto"), ("tool_choice", "required"),
                            ("tool_choice", {"type": "function", "function": {"name": "wiki"}}),
                            ("parallel_tool_calls", False), ("parallel_tool_calls", True))
       for tools in ({}, {"tools": None})},
    # ... and "tools": [] is itself refused (OpenAI's schema: at least one item), named before tool_choice
    **{f"tools [], {json.dumps(extra)[1:-1] or 'alone'}": (
        with_fields(tools=[], **extra), "tools: must hold at least one tool (leave it out, or send null, when there "
                                        "are none)")
       for extra in ({}, {"tool_choice": "auto"}, {"parallel_tool_calls": True})},
    "a tool message without content": (with_fields(messages=USER + [{"role": "tool", "tool_call_id": "c"}]),
                                       "messages[1].content: is required"),
    "call arguments not JSON": (with_fields(messages=calling("{oops")), "messages[1].tool_calls[0].arguments"),
    "call arguments a list": (with_fields(messages=calling("[1]")), "messages[1].tool_calls[0].arguments"),
    "a call without a name": (with_fields(messages=USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"arguments": "{}"}}]}]), "tool_calls[0].function.name"),
    "an empty list of calls": (with_fields(messages=USER + [{"role": "assistant", "content": "x", "tool_calls": []}]),
                               "messages[1].tool_calls: must hold at least one call (leave it out, or send null"),
    "a call without its type": (with_fields(messages=USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "function": {"name": "wiki", "arguments": "{}"}}]}]),
                                "messages[1].tool_calls[0].type: is required"),
    "reasoning on a user message": (with_fields(messages=[{"role": "user", "content": "x", "reasoning_content": "r"}]),
                                    "messages[0].reasoning_content"),
    "open_thinking a string": (with_fields(chat_template_kwargs={"open_thinking": "yes"}),
                               "chat_template_kwargs.open_thinking"),
})


# Fields OpenAI's schema requires (the openai package's ChatCompletionMessageFunctionToolCallParam and
# FunctionDefinition mark them Required): leaving one out is a 400 whose param is the field's path.
REQUIRED_TOOL_FIELDS = {
    "tools []": (with_fields(tools=[]), "tools"),
    "a call without arguments": (with_fields(messages=USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "wiki"}}]}, {"role": "tool", "tool_call_id": "c",
                                                                           "content": "X"}]),
                                 "messages[1].tool_calls[0].function.arguments"),
    "a call without a name": (with_fields(messages=USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"arguments": "{}"}}]}, {"role": "tool", "tool_call_id": "c",
                                                                             "content": "X"}]),
                              "messages[1].tool_calls[0].function.name"),
    "a tool without a name": (with_fields(tools=[{"type": "function", "function": {"parameters": {
        "type": "object", "properties": {}}}}]), "tools[0].function.name"),
}


@pytest.mark.parametrize("body, param", REQUIRED_TOOL_FIELDS.values(), ids=REQUIRED_TOOL_FIELDS)
def test_fields_openai_requires_are_required(server, body, param) -> None:
    response = post(server, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}: ") and \
        error["type"] == "invalid_request_error", error


def offering(parameters) -> bytes:
    return with_fields(tools=[{"type": "function", "function": {"name": "f", "parameters": parameters}}])


# JSON inside a field's string, which the body's own checks cannot see, and tool schemas tools_text cannot read: a
# 400 naming the field (each was a 500).
HOSTILE.update({
    "call arguments with an integer of 5000 digits": (
        with_fields(messages=calling('{"title": ' + "1" * 5000 + "}")),
        "messages[1].tool_calls[0].arguments is not valid JSON (an integer of more than 4300 digits)"),
    "call arguments nested 5000 deep": (with_fields(messages=calling("[" * 5000)),
                                        "messages[1].tool_calls[0].arguments is nested too deeply"),
    "call arguments with a key twice": (with_fields(messages=calling('{"title": "a", "title": "b"}')),
                                        'messages[1].tool_calls[0].arguments has a duplicate key "title"'),
    "call arguments with a lone surrogate": (with_fields(messages=calling('{"title": "\\ud800"}')),
                                             'messages[1].tool_calls[0].arguments["title"] holds a lone surrogate'),
    "call arguments with a lone surrogate in a key": (with_fields(messages=calling('{"\\udc00": 1}')),
                                                      "messages[1].tool_calls[0].arguments holds a lone surrogate"),
    "call arguments with NaN": (with_fields(messages=calling('{"title": NaN}')),
                                'messages[1].tool_calls[0].arguments["title"] is not valid JSON (NaN is not a JSON '
                                'number)'),
    "call arguments with 1e999": (with_fields(messages=calling('{"title": 1e999}')),
                                  'messages[1].tool_calls[0].arguments["title"] is not valid JSON (1e999 is beyond '
                                  'the range'),
    "a property that is not a schema": (offering({"properties": {"x": "string"}}),
                                        'tools[0].function.parameters.properties["x"] must be a JSON schema object'),
    "a property that is null": (offering({"properties": {"x": None}}), 'properties["x"] must be a JSON schema'),
    "parameters of type string": (offering({"type": "string"}), 'tools[0].function.parameters: must be a JSON '
                                  'schema of "type": "object" (the arguments of a call are an object), got "type": '
                                  '"string"'),
    "parameters of type array": (offering({"type": "array", "items": {"type": "number"}}),
                                 'tools[0].function.parameters: must be a JSON schema of "type": "object"'),
    "parameters of Gorilla's type dict": (offering({"type": "dict", "properties": {}}),
                                          'must be a JSON schema of "type": "object" (the arguments of a call are an '
                                          'object), got "type": "dict"'),
    "parameters of type null": (offering({"type": None}), 'must be a JSON schema of "type": "object" (the arguments '
                                                          'of a call are an object), got "type": null'),
    "required a number": (offering({"properties": {"x": {"type": "string"}}, "required": 5}),
                          "tools[0].function.parameters.required must be a list of property names, got int"),
    "required a string": (offering({"properties": {"x": {}, "y": {}}, "required": "xy"}),
                          "required must be a list of property names, got str"),
})


@pytest.mark.parametrize(("body", "phrase"), HOSTILE.values(), ids=HOSTILE.keys())
def test_hostile_values_get_openai_style_400s(server, body, phrase) -> None:
    for stream in (False, True):
        sent = body.replace(b'{"messages"', b'{"stream": true, "messages"', 1) if stream else body
        response = post(server, sent)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert phrase in error["message"] and error["type"] == "invalid_request_error", error


# (a raw body, what it names, the error's param): NaN, the infinities and numbers past a 64-bit float are no JSON,
# and json's hooks meet them without their place; a lone surrogate's place was named in the message only
UNPLACED = [
    (with_fields(temperature=float("nan")), 'body["temperature"] is not valid JSON (NaN is not a JSON number)',
     "temperature"),
    (with_fields(logit_bias={"5": float("-inf")}), 'body["logit_bias"]["5"] is not valid JSON (-Infinity is not a '
     "JSON number)", "logit_bias.5"),
    (with_fields().replace(b'"max_tokens": 4', b'"stop": ["a", 1e400]'),
     'body["stop"][1] is not valid JSON (1e400 is beyond the range of a 64-bit float)', "stop[1]"),
    (json.dumps({"messages": [{"role": "user", "content": "a\ud800b"}]}).encode(),
     'body["messages"][0]["content"] holds a lone surrogate (U+D800 at character 1)', "messages[0].content"),
]


@pytest.mark.parametrize(("body", "named", "param"), UNPLACED, ids=[case[2] for case in UNPLACED])
def test_a_number_json_lacks_is_named_by_its_field(server, body, named, param) -> None:
    response = post(server, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["message"].startswith(named) and error["param"] == param, error


@pytest.mark.parametrize("stream", [False, None, "absent"])
def test_stream_options_without_stream_are_refused(server, stream) -> None:
    """OpenAI's and vLLM's rule: a whole answer has no usage chunk, and include_usage was dropped without a word."""
    body = {"messages": USER, "max_tokens": 2, "stream_options": {"include_usage": True}}
    response = post(server, body if stream == "absent" else {**body, "stream": stream})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["message"] == 'stream_options: is only allowed with "stream": true', error
    assert error["param"] == "stream_options", error


LONG = "x" * 100_000  # a client's name or id of 100,000 characters
CUT = "x" * (MAX_SHOWN - 4) + "..."  # as dataset/shown_value.py cuts its quote, by hand: the quote mark and 56 more
NAME_CUT = "x" * (MAX_SHOWN - 3) + "..."  # and a name, which has no quote mark


def _calls(*ids: str) -> list[dict]:
    """USER, then an assistant message calling wiki once per id."""
    return USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": i, "type": "function", "function": {"name": "wiki", "arguments": "{}"}} for i in ids]}]


def _answer(call_id: str) -> dict:
    return {"role": "tool", "tool_call_id": call_id, "content": "X is a letter."}


# (method, route, body, headers, the error's message): each quoted a client's value whole
LONG_VALUES = {
    # 5,000 characters: httpx refuses a URL of 100,000
    "a model id": ("GET", f"/v1/models/{LONG[:5000]}", None, {}, f"no model '{CUT}; this server has "),
    "a Content-Type": ("POST", "/v1/chat/completions", with_fields(), {"content-type": f"text/{LONG[:5000]}"},
                       f"Content-Type must be application/json, got 'text/{CUT[:-8]}..."),
    "a tool_choice name": ("POST", "/v1/chat/completions",
                           with_fields(tools=[WIKI], tool_choice={"type": "function", "function": {"name": LONG}}),
                           {}, f"tool_choice: no tool '{CUT} among the tools offered (wiki)"),
    "a tool_call_id": ("POST", "/v1/chat/completions",
                       with_fields(messages=_calls("call_1") + [_answer(LONG)]), {},
                       f'messages[2].tool_call_id: "{CUT} is not the id of a call in the tool_calls of messages[1] '
                       f'("call_1")'),
    "a call id given twice": ("POST", "/v1/chat/completions", with_fields(messages=_calls(LONG, LONG)), {},
                              f'messages[1].tool_calls[1].id: duplicate value "{CUT}, also messages[1].tool_calls[0]'),
    "a call id in the list of those a tool message may answer": (
        "POST", "/v1/chat/completions", with_fields(messages=_calls(LONG, "call_2") + [_answer("call_9")]), {},
        f'is not the id of a call in the tool_calls of messages[1] ("{CUT}, "call_2")'),
    "2,000 calls left unanswered": (
        "POST", "/v1/chat/completions", with_fields(messages=_calls(*(f"c{i}" for i in range(2000)))), {},
        'did not have response messages: "c0", "c1", "c2", "c3", "c4" and 1995 more'),
    "a logit_bias key": ("POST", "/v1/chat/completions", with_fields(logit_bias={LONG: "high"}), {},
                         f"logit_bias.{NAME_CUT}: Input should be a valid number"),
    # 300 names of 64 characters (OpenAI's longest) each: the error listed every one, 20,000 characters
    "300 tools offered beside a tool_choice naming none of them": (
        "POST", "/v1/chat/completions", with_fields(
            tools=[{"type": "function", "function": {"name": f"{i:064d}"}} for i in range(300)],
            tool_choice={"type": "function", "function": {"name": "calc"}}), {},
        f"tool_choice: no tool 'calc' among the tools offered ({0:064d}, {1:064d}, {2:064d}, {3:064d}, {4:064d} "
        f"and 295 more)"),
    "a tool name to run": ("POST", "/tools/run", json.dumps({"name": LONG}).encode(), {},
                           f"name: no tool '{CUT}; tools: "),
    "a field of the run request": ("POST", "/tools/run", json.dumps({"name": "wiki", LONG: 1}).encode(), {},
                                   f"{NAME_CUT}: unknown field; the fields are name and arguments"),
    # a logit_bias key was cut by a rule of its own (40 characters and the length); now as every quote is cut
    "a logit_bias key that is no token id": (
        "POST", "/v1/chat/completions", with_fields(logit_bias={"\n" + LONG: 1}), {},
        f'(at most 20 digits, leading zeros aside), got "\\n{CUT[2:]}'),
    "a tool's parameters of a long type": (
        "POST", "/v1/chat/completions", offering({"type": LONG}), {}, f'of a call are an object), got "type": "{CUT}'),
    "a tool's parameters of a type of 10,000 lines": (
        "POST", "/v1/chat/completions", offering({"type": ["a\n"] * 10_000}), {},
        'of a call are an object), got "type": [' + '"a\\n", ' * 8 + "..."),
    "a logit_bias key naming a token another names": (
        "POST", "/v1/chat/completions", with_fields(logit_bias={"5": 1, "0" * 100_000 + "5": 1}), {},
        f'keys "5" and "{"0" * (MAX_SHOWN - 4)}... name the same token 5'),
}


@pytest.mark.parametrize(("method", "route", "body", "headers", "message"), LONG_VALUES.values(),
                         ids=LONG_VALUES.keys())
def test_a_long_client_value_is_quoted_cut_in_the_error(server, method, route, body, headers, message) -> None:
    """An error quotes a client's value as every refusal quotes one (dataset/shown_value.py, cut at MAX_SHOWN
    characters): a 100,000-character name made a 100,000-character error."""
    response = httpx.request(method, f"{server}{route}", content=body, timeout=TIMEOUT,
                             headers={"content-type": "application/json", **headers})
    assert 400 <= response.status_code < 500, response.text[:300]
    error = response.json()["error"]
    assert message in error["message"] and len(error["message"]) < 400, error["message"][:500]
    assert len(json.dumps(error)) < 800, error["param"][:300]  # the param names the field, cut too


def test_a_client_key_holding_newlines_is_quoted_on_one_line(server) -> None:
    """A key of a client's object is echoed as its own text, not a repr (dataset/shown_value.py's shown_text): its
    newlines and the spaces around them become one space, so the message and the param stay one line each."""
    response = httpx.post(f"{server}/tools/run", content=json.dumps({"name": "wiki", "a\n  b\nc": 1}).encode(),
                          timeout=TIMEOUT, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert error["message"] == "a b c: unknown field; the fields are name and arguments"
    assert error["param"] == "a b c"


ACCEPTED = {
    "max_tokens 22.0": dict(max_tokens=22.0),
    "max_completion_tokens 3.0": dict(max_completion_tokens=3.0, max_tokens=None),
    "nulls": dict(presence_penalty=None, frequency_penalty=None, n=None, stream=None, temperature=None, seed=None),
    "n 1.0, top_k 5.0": dict(n=1.0, top_k=5.0, temperature=1.0),
    "seed 2**63 - 1": dict(seed=2**63 - 1, temperature=1.0),
    "seed -2**63": dict(seed=-2**63, temperature=1.0),
    "seed 1e18 as a float": dict(seed=1e18, temperature=1.0),
    "a tool loop": dict(tools=[WIKI], tool_choice="auto", parallel_tool_calls=False,
                        chat_template_kwargs={"open_thinking": True}, messages=calling('{"title": "x"}') + [
                            {"role": "tool", "tool_call_id": "call_1", "content": "X is a letter."}]),
    "thinking sent back": dict(messages=USER + [{"role": "assistant", "content": "Hi", "reasoning_content": "r"},
                                                {"role": "user", "content": "Again"}]),
    "tool_choice none, named": dict(tools=[WIKI], tool_choice="none"),
    "response_format text": dict(response_format={"type": "text"}),
    "logprobs, top_logprobs 2.0": dict(logprobs=True, top_logprobs=2.0),
    # a token id as int() reads it, leading zeros and all (they were counted as digits: 21 characters were a 400)
    "logit_bias keys with leading zeros": dict(logit_bias={"0" * 20 + "5": 1, "0" * 5000 + "7": -1, "0": 2}),
    "logit_bias key of more than 20 zeros, token 0": dict(logit_bias={"0" * 25: 2}),
    "top_logprobs null": dict(logprobs=False, top_logprobs=None),
    "100 levels, the strict reader's bound": dict(extra=functools.reduce(lambda inner, _: [inner], range(98), [])),
}


@pytest.mark.parametrize("fields", ACCEPTED.values(), ids=ACCEPTED.keys())
def test_what_openai_accepts_is_accepted(server, fields) -> None:
    response = post(server, {"messages": USER, "max_tokens": 4, **fields})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["choices"][0]["finish_reason"] in ("stop", "length") and body["usage"]["completion_tokens"] >= 1


def test_a_byte_order_mark_before_the_body_is_ignored(server) -> None:
    """RFC 8259 lets a parser ignore a UTF-8 BOM, and Python's json.loads of bytes does: some Windows clients send
    one."""
    response = post(server, b"\xef\xbb\xbf" + json.dumps({"messages": USER, "max_tokens": 2}).encode())
    assert response.status_code == 200, response.text


def test_internal_errors_carry_no_internal_text(served, server, monkeypatch) -> None:
    """An exception inside the server, before or during generation: a generic 500 (or stream error event); the
    exception's text stays in the server's log."""
    secret = "secret-internal-detail /srv/model"

    def broken(*args, **kwargs):
        raise RuntimeError(secret)

    with monkeypatch.context() as patch:  # failing before generation: the route's own exception
        patch.setattr(served.engine, "submit", broken)
        response = post(server, {"messages": USER})
    assert response.status_code == 500 and secret not in response.text
    assert response.json()["error"] == {"message": INTERNAL_ERROR, "type": "server_error", "param": None,
                                        "code": None}
    with monkeypatch.context() as patch:  # failing in the engine's decode step
        patch.setattr(served.engine, "_decode", broken)
        response = post(server, {"messages": USER, "max_tokens": 8})
        assert response.status_code == 500 and secret not in response.text
        assert response.json()["error"]["type"] == "server_error"
        with httpx.stream("POST", f"{server}/v1/chat/completions", timeout=TIMEOUT,
                          json={"messages": USER, "max_tokens": 8, "stream": True}) as stream:
            assert stream.status_code == 200
            events = [line for line in stream.iter_lines() if line]
    assert secret not in "".join(events)
    assert json.loads(events[-1].removeprefix("data: "))["error"]["type"] == "server_error"
    assert post(server, {"messages": USER, "max_tokens": 3}).status_code == 200  # and it goes on serving


def test_the_openapi_document_describes_the_chat_request(server) -> None:
    document = httpx.get(f"{server}/openapi.json", timeout=TIMEOUT).json()
    body = document["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]
    schemas = document["components"]["schemas"]
    request = schemas[body["schema"]["$ref"].rsplit("/", 1)[1]]
    fields = {"model", "messages", "temperature", "top_p", "max_tokens", "max_completion_tokens", "stream",
              "stream_options", "seed", "stop", "presence_penalty", "frequency_penalty", "n", "logprobs", "top_k",
              "repetition_penalty", "tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs",
              "response_format", "top_logprobs", "logit_bias"}
    assert set(request["properties"]) == fields and request["required"] == ["messages"]
    assert {"type": "integer", "minimum": -2**63, "maximum": 2**63 - 1} in request["properties"]["seed"]["anyOf"]
    message = schemas[request["properties"]["messages"]["items"]["$ref"].rsplit("/", 1)[1]]
    assert message["properties"]["role"]["enum"] == ["system", "developer", "user", "assistant", "tool"]
    assert {"/v1/models", "/health"} <= set(document["paths"])


# ------------------------------------------------------------------------- what the HTTP layer carries
NOT_JSON_TYPES = ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                  "text/plain;charset=UTF-8"]


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/tools/run"])
@pytest.mark.parametrize("content_type", NOT_JSON_TYPES)
def test_a_body_declared_as_something_else_than_json_is_a_415(server, route, content_type) -> None:
    """What a form or another site's page can send without the browser asking first (a CORS "simple request"):
    refused, as FastAPI refuses it for its own JSON bodies."""
    response = httpx.post(f"{server}{route}", content=json.dumps({"messages": USER, "max_tokens": 2}).encode(),
                          headers={"content-type": content_type}, timeout=TIMEOUT)
    assert response.status_code == 415, response.text
    assert response.json()["error"]["message"] == (f"Content-Type must be application/json, got {content_type!r}")


@pytest.mark.parametrize("content_type", [None, "application/json", "application/json; charset=utf-8",
                                          "Application/JSON", "application/merge-patch+json"])
def test_a_json_body_or_an_undeclared_one_is_read(server, content_type) -> None:
    headers = {"content-type": content_type} if content_type else {}
    response = httpx.post(f"{server}/v1/chat/completions", headers=headers, timeout=TIMEOUT,
                          content=json.dumps({"messages": USER, "max_tokens": 2}).encode())
    assert response.status_code == 200, response.text


def test_a_wrong_method_is_a_405_naming_the_allowed_ones(server) -> None:
    for method, path, allowed in (("POST", "/v1/models", "GET"), ("DELETE", "/v1/chat/completions", "POST"),
                                  ("PUT", "/tools/run", "POST")):
        response = httpx.request(method, f"{server}{path}", timeout=TIMEOUT)
        assert response.status_code == 405 and response.headers.get("allow") == allowed, (method, path)
        assert response.json()["error"]["message"] == "Method Not Allowed"


def test_a_client_gone_before_its_body_ends_is_no_server_error(served) -> None:
    """A Content-Length longer than what arrives, then a hang-up: the route reads a disconnect where the rest of the
    body should be. It answers 499 (read by nobody), not a 500 and a traceback in the server's log."""
    import asyncio

    received = [{"type": "http.request", "body": b'{"messages": [', "more_body": True}, {"type": "http.disconnect"}]
    sent: list[dict] = []

    async def receive() -> dict:
        return received.pop(0) if received else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json"), (b"content-length", b"1000")],
             "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000)}
    asyncio.run(create_app(served)(scope, receive, send))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499
