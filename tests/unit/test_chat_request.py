"""The chat request's schema (scripts/server/protocol.py parse_chat_request) without a server: what OpenAI's API
requires of a name is refused as a 400 whose `param` names the field, as the server answers it."""

from __future__ import annotations

import json

import pytest

from scripts.server.errors import APIError
from scripts.server.protocol import parse_chat_request

TOOL = {"type": "function", "function": {"name": "calculator", "parameters": {"type": "object", "properties": {}}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": "{}"}}


def _request(**changes) -> dict:
    return {"messages": [{"role": "user", "content": "1 + 1?"}], "tools": [TOOL], **changes}


@pytest.mark.parametrize("request_body, param", [
    (_request(messages=[{"role": "user", "content": "1 + 1?"},
                        {"role": "assistant", "content": None, "tool_calls": [
                            {**CALL, "function": {"name": "", "arguments": "{}"}}]},
                        {"role": "tool", "tool_call_id": "call_1", "content": "2"}]),
     "messages[1].tool_calls[0].function.name"),
    (_request(tools=[{"type": "function", "function": {**TOOL["function"], "name": ""}}]), "tools[0].function.name"),
    (_request(tool_choice={"type": "function", "function": {"name": ""}}), "tool_choice.function.name"),
], ids=["a call's name", "a tool's name", "tool_choice's name"])
def test_an_empty_name_is_a_400_naming_its_field(request_body, param):
    with pytest.raises(APIError) as refused:
        parse_chat_request(json.dumps(request_body).encode())
    assert (refused.value.status, refused.value.param) == (400, param)


def test_the_same_requests_with_names_are_taken():
    answered = _request(messages=[{"role": "user", "content": "1 + 1?"},
                                  {"role": "assistant", "content": None, "tool_calls": [CALL]},
                                  {"role": "tool", "tool_call_id": "call_1", "content": "2"}],
                        tool_choice={"type": "function", "function": {"name": "calculator"}})
    request = parse_chat_request(json.dumps(answered).encode())
    assert request.messages[1].tool_calls[0].function.name == "calculator"


SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "repetition_penalty", "presence_penalty", "frequency_penalty")
PROBES = (-1e308, -100001.0, -3.0, -2.0, -0.1, 0.0, 1e-6, 1e-5, 0.5, 1.0, 1.5, 2.0, 2.0001, 3.0, 1e5, 100001.0, 1e308)


@pytest.mark.parametrize("field", SAMPLING_FIELDS)
def test_chats_sampling_flags_take_what_a_servers_request_takes(field, capsys):
    """eval/chat.py's sampling flags and the server's request fields bound each setting alike
    (trainer/inference_flags.py, OpenAI's ranges): --temperature 1e308 was taken and sampled every token alike, where
    a request refused anything above 2."""
    from eval.chat import build_parser

    parser = build_parser()
    for value in PROBES:
        number = int(value) if field == "top_k" and value.is_integer() else value
        try:
            parse_chat_request(json.dumps(_request(**{field: number})).encode())
            served = True
        except APIError:
            served = False
        try:
            parser.parse_args([f"--{field}", repr(number)])
            flagged = True
        except SystemExit:
            flagged = False
        assert flagged == served, (field, number, capsys.readouterr().err)


def test_chats_temperature_past_openais_range_is_one_line_naming_the_range(capsys):
    from eval.chat import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["--temperature", "1e308"])
    assert capsys.readouterr().err.splitlines()[0] == ("error: argument --temperature: 1e308 is not 0 (greedy) or a "
                                                       "number in 1e-05 .. 2 (OpenAI's range)")
