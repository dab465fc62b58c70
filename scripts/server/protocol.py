"""OpenAI's chat-completions wire format: the request schema and the bodies the server sends back (a whole
completion, the chunks of a streamed one, the model card). Field names of the protocol live here only."""

# No `from __future__ import annotations`: pydantic reads the models' annotations, and error locations name the
# union branches by their types ("list[TextPart]").
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from scripts.server.errors import APIError, validation_error


# ----------------------------------------------------------------------------------------------- the request
class TextPart(BaseModel):
    model_config = ConfigDict(strict=True)  # strict: "0.5" is not a number
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    include_usage: bool = False


class ChatRequest(BaseModel):
    model_config = ConfigDict(strict=True)
    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    n: int = Field(1, ge=1, le=1)
    logprobs: bool | None = None
    # Extensions that vLLM and llama.cpp's server accept as well.
    top_k: int | None = Field(None, ge=0)
    repetition_penalty: float | None = Field(None, gt=0)

    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk (and every chunk carries "usage": null)."""
        return bool(self.stream_options and self.stream_options.include_usage)

    def prompt_messages(self) -> list[dict[str, str]]:
        """The conversation as the library's chat format takes it: text only, "developer" read as "system"."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


def parse_chat_request(body: bytes) -> ChatRequest:
    """The request in a body, or an APIError (400) that names what is wrong with it."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise APIError(400, f"the body is not valid JSON ({error})") from None
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object")
    try:
        return ChatRequest.model_validate(data)
    except ValidationError as error:
        raise validation_error(error) from None


# ----------------------------------------------------------------------------------------------- the responses
@dataclass(frozen=True)
class CompletionId:
    """What every body and chunk of one completion repeats: its id, when it was created, the model's id."""
    id: str
    created: int
    model: str

    @classmethod
    def new(cls, model: str) -> "CompletionId":
        return cls(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), model)


def usage_body(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(completion: CompletionId, text: str, finish_reason: str | None,
                    token_usage: dict[str, int]) -> dict[str, Any]:
    """A whole completion ("chat.completion")."""
    return {"id": completion.id, "object": "chat.completion", "created": completion.created,
            "model": completion.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": finish_reason, "logprobs": None}],
            "usage": token_usage}


def chunk_body(completion: CompletionId, delta: dict[str, Any], finish_reason: str | None = None,
               include_usage: bool = False) -> dict[str, Any]:
    """One chunk of a streamed completion ("chat.completion.chunk"): `delta` is what the message gains."""
    body = {"id": completion.id, "object": "chat.completion.chunk", "created": completion.created,
            "model": completion.model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]}
    if include_usage:
        body["usage"] = None
    return body


def usage_chunk_body(completion: CompletionId, token_usage: dict[str, int]) -> dict[str, Any]:
    """The stream's last chunk when the client asked for usage: no choices, the token counts."""
    return {**chunk_body(completion, {}, None, include_usage=True), "choices": [], "usage": token_usage}


def model_card(name: str, created: int, max_context: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "mininorm", "max_context": max_context}


def model_list(cards: list[dict[str, Any]]) -> dict[str, Any]:
    return {"object": "list", "data": cards}
