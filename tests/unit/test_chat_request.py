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
