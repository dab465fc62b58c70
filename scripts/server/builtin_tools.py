"""The library's built-in tools (dataset/tools.py) offered to the server's clients, which run the tool loop
themselves, as OpenAI's clients do: GET /tools gives the schemas and the round limit, POST /tools/run runs one call.

The tools are offered when the model uses the chat template and a question with every tool's description fits its
context; otherwise the list is empty and a note says why. A call the request gets wrong (no such tool, arguments
that are not a JSON object) is a 400; a call the tool refuses (an argument missing or of the wrong type, no such
article, an expression it cannot evaluate) is answered with the tool's "Error: ..." text, which the model reads as
its result, as eval/chat.py does."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from dataset.chat_format import encode_chatml
from dataset.tools import ToolError, is_tool_error, parse_arguments, run_tool, tool_schemas
from model.chat_session import MAX_TOOL_ROUNDS
from dataset.shown_value import shown_text, shown_value
from scripts.server.errors import APIError
from scripts.server.protocol import parse_json_object
from scripts.server.served_model import ServedModel

PROBE_QUESTION = [{"role": "user", "content": "Hi"}]  # the shortest conversation a client could send
# POST /tools/run's body for the OpenAPI document (the route reads and checks the body itself: parse_run_request).
RUN_REQUEST_BODY = {"requestBody": {"required": True, "content": {"application/json": {"schema": {
    "type": "object", "required": ["name"], "additionalProperties": False, "properties": {
        "name": {"type": "string", "description": "an offered tool's name (GET /tools)"},
        "arguments": {"anyOf": [{"type": "object"}, {"type": "string"}],
                      "description": "a JSON object, or a string holding one (as tool_calls carry them)"}}}}}}}


@dataclass(frozen=True)
class OfferedTools:
    """The tools a server offers (OpenAI-format schemas, possibly none) and, when none, why."""

    schemas: list[dict[str, Any]]
    note: str = ""

    def body(self) -> dict[str, Any]:
        """GET /tools: {"tools": [...], "max_tool_rounds": N, "note": "..."}."""
        return {"tools": self.schemas, "max_tool_rounds": MAX_TOOL_ROUNDS, "note": self.note}

    def names(self) -> list[str]:
        return [schema["function"]["name"] for schema in self.schemas]


def offered_tools(served: ServedModel, enabled: bool = True) -> OfferedTools:
    """Every built-in tool, unless turned off, the model continues plain text (no turns to call from), or the
    prompt of a one-word question with the tools does not fit its context."""
    if not enabled:
        return OfferedTools([], "this server offers no tools")
    if not served.use_template:
        return OfferedTools([], "the model continues plain text (a pretrained model): it cannot call tools")
    schemas = tool_schemas()
    length = len(encode_chatml(served.tokenizer, PROBE_QUESTION, add_generation_prompt=True,
                               tools=schemas).input_ids)
    if length >= served.max_context:
        return OfferedTools([], f"the tools' descriptions make a one-word question {length} tokens long; the "
                                f"model's context is {served.max_context}")
    return OfferedTools(schemas)


def parse_run_request(body: bytes, offered: OfferedTools) -> tuple[str, Any]:
    """The tool's name and its arguments (a mapping) from a POST /tools/run body, {"name": ..., "arguments": ...}
    (arguments: a JSON object, or a string holding one as OpenAI's tool_calls carry them; default {}); an APIError
    (400) naming the field otherwise."""
    data = parse_json_object(body)
    unknown = sorted(set(data) - {"name", "arguments"})
    if unknown:
        field = shown_text(unknown[0])  # a client's key, cut: its name and the param both echo it
        raise APIError(400, f"{field}: unknown field; the fields are name and arguments", param=field)
    name = data.get("name")
    allowed = ", ".join(offered.names()) or "none are offered"
    if not isinstance(name, str):
        raise APIError(400, f"name: must be a tool's name ({allowed})", param="name")
    if name not in offered.names():
        raise APIError(400, f"name: no tool {shown_value(name)}; tools: {allowed}", param="name",
                       code="tool_not_found")
    try:
        arguments = parse_arguments(data.get("arguments", {}))
    except ToolError as error:
        raise APIError(400, str(error), param="arguments") from None  # it names the arguments itself
    return name, arguments


async def run_call(name: str, arguments: Any) -> dict[str, Any]:
    """POST /tools/run's answer: {"name", "result", "is_error"}. The tool runs on a worker thread (a wiki lookup
    reads the corpus the first time), never on the event loop; run_tool never raises."""
    result = await asyncio.to_thread(run_tool, name, arguments)
    return {"name": name, "result": result, "is_error": is_tool_error(result)}
