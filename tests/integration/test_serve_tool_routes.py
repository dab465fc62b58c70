"""The server's built-in tools for clients' tool loops (scripts/server/builtin_tools.py): GET /tools gives the
library's schemas and round limit, POST /tools/run answers with what dataset/tools.run_tool returns, and a request
it cannot run gets a one-line 400 naming the field; the same API key rule as /v1/. Servers run in this process."""

from __future__ import annotations

import httpx
import pytest

from dataset.tools import run_tool, tool_schemas
from model.chat_session import MAX_TOOL_ROUNDS

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def server(endless_model, serve_app, threaded_server):
    """A chat-template model with a 4096-token context: every tool fits."""
    with threaded_server(serve_app(endless_model, max_batch=1)) as running:
        yield running.url


def run(url: str, body, **kwargs) -> httpx.Response:
    if isinstance(body, (bytes, str)):
        return httpx.post(f"{url}/tools/run", content=body, timeout=60, **kwargs)
    return httpx.post(f"{url}/tools/run", json=body, timeout=60, **kwargs)


def test_the_tools_are_the_librarys(server) -> None:
    response = httpx.get(f"{server}/tools", timeout=60)
    assert response.status_code == 200
    body = response.json()
    assert body["tools"] == tool_schemas() and [t["function"]["name"] for t in body["tools"]] == [
        "wiki", "calculator", "convert_units"]
    assert body["max_tool_rounds"] == MAX_TOOL_ROUNDS == 3
    document = httpx.get(f"{server}/openapi.json", timeout=60).json()  # the run request, described for clients
    schema = document["paths"]["/tools/run"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert schema["required"] == ["name"] and set(schema["properties"]) == {"name", "arguments"}
    assert "/tools" in document["paths"]


@pytest.mark.parametrize(("name", "arguments", "expected"), [
    ("calculator", {"expression": "(17 + 5) * 3"}, "66"),
    ("calculator", '{"expression": "2 ** 10"}', "1024"),  # as OpenAI's tool_calls carry arguments: a JSON string
    ("convert_units", {"value": 100, "from_unit": "°C", "to_unit": "°F"},
     "100 degrees Celsius = 212 degrees Fahrenheit"),
])
def test_a_call_runs_the_tool(server, name, arguments, expected) -> None:
    response = run(server, {"name": name, "arguments": arguments})
    assert response.status_code == 200
    assert response.json() == {"name": name, "result": expected, "is_error": False}


def test_a_wiki_lookup_gives_the_librarys_summary(server) -> None:
    body = run(server, {"name": "wiki", "arguments": {"title": "paris"}}).json()
    assert body["result"] == run_tool("wiki", {"title": "Paris"}) and body["result"].startswith("Paris is")


@pytest.mark.parametrize("arguments", [{"expr": "2+3"}, {}, {"expression": 5}, {"expression": "2 +"}])
def test_a_call_the_tool_refuses_is_answered_with_its_error_text(server, arguments) -> None:
    """The model wrote the call: it reads the tool's error as the result, as in eval/chat.py."""
    response = run(server, {"name": "calculator", "arguments": arguments})
    assert response.status_code == 200
    body = response.json()
    assert body["is_error"] is True and body["result"].startswith("Error: ")
    assert body["result"] == run_tool("calculator", arguments)


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"name": "magic", "arguments": {}}, "name", "no tool 'magic'; tools: wiki, calculator, convert_units"),
    ({"arguments": {}}, "name", "must be a tool's name (wiki, calculator, convert_units)"),
    ({"name": 5}, "name", "must be a tool's name"),
    ({"name": "calculator", "arguments": "{oops"}, "arguments", "not valid JSON"),
    ({"name": "calculator", "arguments": ["2+3"]}, "arguments", "must be a JSON object, got list"),
    ({"name": "calculator", "arguments": None}, "arguments", "must be a JSON object"),
    ({"name": "calculator", "args": {}}, "args", "unknown field; the fields are name and arguments"),
    (b"{not json", None, "not valid JSON"),
    ({"name": "calculator", "arguments": '{"expression": ' + "1" * 5000 + "}"}, "arguments",
     "arguments is not valid JSON (an integer of more than 4300 digits)"),
    ({"name": "calculator", "arguments": "[" * 50000 + "]" * 50000}, "arguments", "arguments is nested too deeply"),
    ({"name": "wiki", "arguments": '{"title": "Paris", "title": "Rome"}'}, "arguments",
     'arguments has a duplicate key "title"'),
    ({"name": "wiki", "arguments": '{"title": "Paris\\ud800"}'}, "arguments",
     'arguments["title"] holds a lone surrogate (U+D800 at character 5)'),
    (b"[]", None, "must be a JSON object"),
])
def test_a_request_that_cannot_run_is_a_one_line_400(server, body, param, words) -> None:
    response = run(server, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert words in error["message"] and "\n" not in error["message"]
    assert error["param"] == param and error["type"] == "invalid_request_error"


@pytest.mark.parametrize("model", ["sft", "pretrain"])
def test_no_tools_are_offered_where_they_cannot_be_used(tiny_models, serve_app, threaded_server, model) -> None:
    """The tiny SFT model's context (128 tokens) is shorter than the tools' descriptions; a pretrained model
    continues plain text. Either way the list is empty, a note says why, and nothing runs."""
    with threaded_server(serve_app(getattr(tiny_models, model), max_batch=1)) as running:
        body = httpx.get(f"{running.url}/tools", timeout=60).json()
        assert body["tools"] == []
        assert ("context is 128" if model == "sft" else "plain text") in body["note"]
        response = run(running.url, {"name": "calculator", "arguments": {"expression": "1+1"}})
        assert response.status_code == 400 and "tools: none are offered" in response.json()["error"]["message"]


def test_a_server_can_offer_no_tools(endless_model, serve_app, threaded_server) -> None:
    with threaded_server(serve_app(endless_model, max_batch=1, tools=False)) as running:
        assert httpx.get(f"{running.url}/tools", timeout=60).json()["tools"] == []


def test_the_tools_need_the_api_key(endless_model, serve_app, threaded_server) -> None:
    with threaded_server(serve_app(endless_model, max_batch=1, api_key="s3cret")) as running:
        call = {"name": "calculator", "arguments": {"expression": "1+1"}}
        assert httpx.get(f"{running.url}/tools", timeout=60).status_code == 401
        assert run(running.url, call).status_code == 401
        assert run(running.url, call, headers={"Authorization": "Bearer wrong"}).status_code == 401
        key = {"Authorization": "Bearer s3cret"}
        assert httpx.get(f"{running.url}/tools", headers=key, timeout=60).json()["tools"] == tool_schemas()
        assert run(running.url, call, headers=key).json()["result"] == "2"
