"""OpenAI's chat-completions wire format: the request schema and the bodies the server sends back (a whole
completion, the chunks of a streamed one, the model card). Field names of the protocol live here only."""

# No `from __future__ import annotations`: pydantic reads the models' annotations, and error locations name the
# union branches by their types ("list[TextPart]").
import time
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, ValidationInfo,
                      field_validator)
from pydantic_core import PydanticCustomError

from dataset.chat_format import normalize_messages, parse_tools
from dataset.json_text import JsonTextError, read_json
from dataset.shown_value import shown_json, shown_value
from scripts.server.errors import APIError, field_path, validation_error
from trainer.inference_flags import (MAX_TOP_LOGPROBS, OPENAI_LOGIT_BIAS_RANGE, OPENAI_PENALTY_RANGE,
                                     OPENAI_TEMPERATURE_RANGE)
from trainer.sampling_ranges import LARGEST_FACTOR, SMALLEST_DIVISOR

# A seed beyond 64 bits is beyond torch's generator (OpenAI's API takes a signed 64-bit seed); the sampling limits
# are the library's.
SEED_MIN, SEED_MAX = -2**63, 2**63 - 1
MAX_TOKEN_ID_DIGITS = 20  # a logit_bias key, leading zeros aside: 2**64 has 20 digits, a vocabulary far fewer
MAX_LISTED = 5  # call ids an error lists, then how many more
MIN_LOGPROB = -9999.0  # OpenAI's and vLLM's floor for a token the model rules out: JSON has no -Infinity


def _token_id(key: str) -> int | None:
    """The token id a logit_bias key writes, as int() reads a decimal integer ("0005" is 5), or None where it writes
    none: anything but ASCII digits, or more than MAX_TOKEN_ID_DIGITS of them after its leading zeros."""
    if not (key.isascii() and key.isdigit()):
        return None
    significant = key.lstrip("0") or "0"
    return int(significant) if len(significant) <= MAX_TOKEN_ID_DIGITS else None


def _integral_float_as_int(value: Any) -> Any:
    """OpenAI accepts 22.0 where an integer goes: a float without a fraction is that integer."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def integer(**limits: int) -> Any:
    """An integer field's type, within `limits` (ge, le); an integral float is taken as that integer (the limits
    sit on the integer itself, so the JSON schema shows them as minimum and maximum)."""
    return Annotated[Annotated[int, Field(**limits)], BeforeValidator(_integral_float_as_int)]


# ----------------------------------------------------------------------------------------------- the request
class TextPart(BaseModel):
    model_config = ConfigDict(strict=True)  # strict: "0.5" is not a number
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(strict=True)
    name: str = Field(min_length=1)
    arguments: str | dict[str, Any]  # required, as OpenAI's API requires it: a JSON string; an object is taken too


class ToolCall(BaseModel):
    model_config = ConfigDict(strict=True)
    id: str  # what the "tool" message answering the call names as its tool_call_id (OpenAI requires it)
    type: Literal["function"]  # required too, as OpenAI's API requires it
    function: FunctionCall


class Message(BaseModel):
    model_config = ConfigDict(strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    tool_calls: list[ToolCall] | None = None   # assistant; before content, whose check reads it
    content: str | list[TextPart] | None = Field(None, validate_default=True)  # None: an assistant's tool calls
    name: str | None = None
    reasoning_content: str | None = None       # assistant (MiniMind's and DeepSeek's field)
    tool_call_id: str | None = None            # tool

    @field_validator("tool_calls")
    @classmethod
    def _calls_if_any(cls, value: list[ToolCall] | None) -> list[ToolCall] | None:
        if value is not None and not value:  # OpenAI's rule: an empty list is no calls, said the wrong way
            raise PydanticCustomError("tool_calls_empty", "must hold at least one call (leave it out, or send null, "
                                      "when there are none)", {})
        return value

    @field_validator("content")
    @classmethod
    def _content_unless_calling(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None and not (info.data.get("role") == "assistant" and info.data.get("tool_calls")):
            raise PydanticCustomError("content_missing", "is required (it may be null only on an assistant "
                                      "message with tool_calls)", {})
        return value

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionSchema(BaseModel):
    model_config = ConfigDict(strict=True)
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")  # OpenAI's rule for the name
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        # OpenAI's rule: a call's arguments are a JSON object, so the schema describing them is of type "object".
        # The library's parse_tools stays looser: SFT data may spell it otherwise (Gorilla's "dict").
        if value is not None and "type" in value and value["type"] != "object":
            raise PydanticCustomError("parameters_type", 'must be a JSON schema of "type": "object" (the arguments '
                                      'of a call are an object), got "type": {got}', {"got": shown_json(value["type"])})
        return value


class Tool(BaseModel):
    model_config = ConfigDict(strict=True)
    type: Literal["function"]
    function: FunctionSchema


class FunctionName(BaseModel):
    model_config = ConfigDict(strict=True)
    name: str = Field(min_length=1)


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True)
    type: Literal["function"]
    function: FunctionName


class ChatTemplateKwargs(BaseModel):
    model_config = ConfigDict(strict=True)
    open_thinking: bool = False  # MiniMind's switch: the model may think before it answers


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    include_usage: bool = False


class ResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")  # "json_schema" carries its schema: never read
    type: Literal["text", "json_object", "json_schema"]  # OpenAI's; ChatRequest takes "text" only


def _listed(ids: list[str]) -> str:
    """Call ids as an error lists them: each as a JSON string (dataset/shown_value.py's shown_json: one holding a
    newline or a comma keeps the message one line and the ids apart, a long one is cut), the first MAX_LISTED and
    how many more (a message with thousands of calls made an error of thousands of ids)."""
    return _first_listed([shown_json(i) for i in ids[:MAX_LISTED]], len(ids))


def _first_listed(first: list[str], count: int) -> str:
    """The first MAX_LISTED of `count` quoted items, then how many more: the one cut of every list an error gives
    back of what a client sent (its call ids, the names of the tools it offered)."""
    listed = ", ".join(first[:MAX_LISTED])
    return listed if count <= MAX_LISTED else f"{listed} and {count - MAX_LISTED} more"


class ChatRequest(BaseModel):
    model_config = ConfigDict(strict=True)
    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    temperature: float | None = Field(None, ge=OPENAI_TEMPERATURE_RANGE[0], le=OPENAI_TEMPERATURE_RANGE[1])
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: integer(ge=1) | None = None
    max_completion_tokens: integer(ge=1) | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    seed: integer(ge=SEED_MIN, le=SEED_MAX) | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(None, ge=OPENAI_PENALTY_RANGE[0], le=OPENAI_PENALTY_RANGE[1])
    frequency_penalty: float | None = Field(None, ge=OPENAI_PENALTY_RANGE[0], le=OPENAI_PENALTY_RANGE[1])
    # {token id as a string: a value added to its logit}, OpenAI's
    logit_bias: dict[str, Annotated[float, Field(ge=OPENAI_LOGIT_BIAS_RANGE[0], le=OPENAI_LOGIT_BIAS_RANGE[1])]] \
        | None = None
    n: integer(ge=1, le=1) | None = None
    logprobs: bool | None = None
    top_logprobs: integer(ge=0, le=MAX_TOP_LOGPROBS) | None = None
    # Extensions that vLLM and llama.cpp's server accept as well.
    top_k: integer(ge=0) | None = None
    repetition_penalty: float | None = Field(None, ge=SMALLEST_DIVISOR, le=LARGEST_FACTOR)
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None  # vLLM's and MiniMind's servers take it
    response_format: ResponseFormat | None = None

    @field_validator("tools")
    @classmethod
    def _tools_if_any(cls, value: list[Tool] | None) -> list[Tool] | None:
        if value is not None and not value:  # OpenAI's rule (at least one item), as for a message's tool_calls
            raise PydanticCustomError("tools_empty", "must hold at least one tool (leave it out, or send null, "
                                      "when there are none)", {})
        return value

    @field_validator("temperature")
    @classmethod
    def _temperature_not_numerically_zero(cls, value: float | None) -> float | None:
        if value is not None and 0 < value < SMALLEST_DIVISOR:
            raise PydanticCustomError("temperature_range", "must be 0 (greedy) or at least {smallest}",
                                      {"smallest": SMALLEST_DIVISOR})
        return value

    @field_validator("logit_bias")
    @classmethod
    def _token_ids_as_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        # A key is read as the integer it writes, as int() reads it ("0005" is token 5), but only its significant
        # digits are counted: more than MAX_TOKEN_ID_DIGITS name no token of any vocabulary, and int() refuses a
        # text of more than 4300 digits (the body's bound on integers does not reach a key, which is a text).
        named: dict[int, str] = {}
        for key in value or {}:
            token = _token_id(key)
            if token is None:
                raise PydanticCustomError("logit_bias", "keys are token ids written as decimal integers (at most "
                                          "{digits} digits, leading zeros aside), got {key}",
                                          {"key": shown_json(key), "digits": MAX_TOKEN_ID_DIGITS})
            if token in named:  # which of the two values would count is anyone's guess
                raise PydanticCustomError("logit_bias", "keys {first} and {second} name the same token {token}",
                                          {"first": shown_json(named[token]), "second": shown_json(key),
                                           "token": token})
            named[token] = key
        return value

    @field_validator("stream_options")
    @classmethod
    def _stream_options_with_stream(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        # OpenAI's rule ("only set this when you set stream: true"), and vLLM's: a whole answer has no chunks, so
        # include_usage would be dropped without a word
        if value is not None and info.data.get("stream") is not True:
            raise PydanticCustomError("stream_options", 'is only allowed with "stream": true', {})
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_with_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):  # OpenAI's rule
            raise PydanticCustomError("top_logprobs", 'needs "logprobs": true', {})
        return value

    @field_validator("tool_choice", "parallel_tool_calls")
    @classmethod
    def _only_with_tools(cls, value: Any, info: ValidationInfo) -> Any:
        # OpenAI's rule ("'tool_choice' is only allowed when 'tools' are specified"); when tools failed its own
        # check, that error is the one to report.
        if value is not None and "tools" in info.data and not info.data["tools"]:
            raise PydanticCustomError("needs_tools", "is only allowed when tools are given (this request offers "
                                      "none)", {})
        return value

    @field_validator("response_format")
    @classmethod
    def _free_text_only(cls, value: ResponseFormat | None) -> ResponseFormat | None:
        # Text is what the model writes anyway; JSON could only be promised by constrained decoding, which the
        # engine does not do, and free text in its place would be a silent breach of the request.
        if value is not None and value.type != "text":
            raise PydanticCustomError("response_format", "only {allowed} is supported (a {asked} reply would need "
                                      "constrained decoding, which this server does not do)",
                                      {"allowed": '{"type": "text"}', "asked": shown_json(value.type)})
        return value

    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk (and every chunk carries "usage": null)."""
        return bool(self.stream_options and self.stream_options.include_usage)

    def logprob_count(self) -> int | None:
        """None without logprobs; else how many of the most likely tokens each token's entry lists (top_logprobs,
        default 0)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def token_biases(self) -> dict[int, float] | None:
        """`logit_bias` with its keys read as token ids (None when absent or empty)."""
        return {_token_id(key): value for key, value in self.logit_bias.items()} if self.logit_bias else None

    def stop_strings(self) -> list[str]:
        """`stop` as a list (a string is one stop string)."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def prompt_messages(self) -> list[dict[str, Any]]:
        """The conversation as the library's chat format takes it (normalize_messages): "developer" read as
        "system", tool calls with their arguments parsed; an APIError (400) naming the field when an argument
        string is not a JSON object, or naming the message when calls and tool messages do not pair up
        (check_tool_answers)."""
        messages = []
        for m in self.messages:
            message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            if m.reasoning_content:
                message["reasoning_content"] = m.reasoning_content
            if m.tool_calls:
                message["tool_calls"] = [{"name": c.function.name, "arguments": c.function.arguments}
                                         for c in m.tool_calls]
            messages.append(message)
        try:
            normalized = normalize_messages(messages)
        except ValueError as error:
            raise APIError(400, str(error), param="messages") from None
        self.check_tool_answers()
        return normalized

    def check_tool_answers(self) -> None:
        """OpenAI's rule for a tool loop sent back, by the call ids that only the wire carries (the library's chat
        format pairs no calls with answers, and MiniMind's training data has no ids): a "tool" message answers, by
        its tool_call_id, a call of the assistant message with tool_calls that its run of tool messages follows, and
        each of that message's calls is answered before the conversation goes on. An APIError (400) naming the
        message (``messages[3]``) and the ids."""
        caller: int | None = None  # the index of the assistant message whose calls the tool messages answer
        unanswered: list[str] = []  # its calls' ids that no tool message has answered yet
        answered: dict[str, int] = {}  # the ids answered so far, each with the index of its answer
        for index, message in enumerate([*self.messages, None]):
            where = f"messages[{index}]"
            if message is not None and message.role == "tool":
                if caller is None:
                    raise APIError(400, f"{where}: a message with role 'tool' must be a response to a preceding "
                                        f"assistant message with 'tool_calls'", param=where)
                if message.tool_call_id is None:
                    raise APIError(400, f"{where}.tool_call_id: is required (the id of the call of "
                                        f"messages[{caller}] it answers)", param=f"{where}.tool_call_id")
                ids = [call.id for call in self.messages[caller].tool_calls or []]
                if message.tool_call_id not in ids:
                    raise APIError(400, f"{where}.tool_call_id: {shown_json(message.tool_call_id)} is not the id of a "
                                        f"call in the tool_calls of messages[{caller}] ({_listed(ids)})",
                                   param=f"{where}.tool_call_id")
                if message.tool_call_id in answered:  # which answer holds would be the format's guess
                    raise APIError(400, f"{where}.tool_call_id: duplicate value {shown_json(message.tool_call_id)}, in "
                                        f"messages[{answered[message.tool_call_id]}] and {where} (a call is answered "
                                        f"once)", param=f"{where}.tool_call_id")
                answered[message.tool_call_id] = index
                unanswered = [i for i in unanswered if i != message.tool_call_id]
                continue
            if unanswered:
                raise APIError(400, f"messages[{caller}]: an assistant message with 'tool_calls' must be followed by "
                                    f"tool messages responding to each 'tool_call_id'; the following tool_call_ids did "
                                    f"not have response messages: {_listed(unanswered)}", param=f"messages[{caller}]")
            caller = index if message is not None and message.role == "assistant" and message.tool_calls else None
            unanswered = [call.id for call in message.tool_calls] if caller is not None else []
            for position, call_id in enumerate(unanswered):  # an answer names one call: two of one id are ambiguous
                if call_id in unanswered[:position]:
                    field = f"{where}.tool_calls[{position}].id"
                    raise APIError(400, f"{field}: duplicate value {shown_json(call_id)}, also {where}.tool_calls["
                                        f"{unanswered.index(call_id)}]'s (each call needs its own id, which its "
                                        f"answer names)", param=field)
            answered = {}

    def offered_tools(self) -> list[dict[str, Any]]:
        """The tools the prompt shows: none with tool_choice "none"; the schemas as the chat format takes them,
        or an APIError (400) naming the tool when its parameters are not a JSON schema object. Parsed on each
        call: the route calls it once and hands the result on."""
        if not self.tools or self.tool_choice == "none":
            return []
        try:
            return parse_tools([t.model_dump(exclude_none=True) for t in self.tools])
        except ValueError as error:
            raise APIError(400, str(error), param="tools") from None

    def forced_tool(self) -> str | None:
        """What tool_choice demands: None (the model decides), "" (some tool: "required") or a tool's name. An
        APIError (400) when it names a tool the request does not offer (one without tools never gets here:
        _only_with_tools)."""
        choice = self.tool_choice
        if choice is None or choice in ("auto", "none"):
            return None
        names = [t.function.name for t in self.tools or []]  # not empty: tool_choice comes with tools
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in names:
                raise APIError(400, f"tool_choice: no tool {shown_value(choice.function.name)} among the tools offered "
                                    f"({_first_listed(names, len(names))})", param="tool_choice")
            return choice.function.name
        return ""

    def open_thinking(self) -> bool:
        return bool(self.chat_template_kwargs and self.chat_template_kwargs.open_thinking)


def parse_json_object(body: bytes) -> dict[str, Any]:
    """A body's JSON object, read by the project's one strict reader (dataset/json_text.py: UTF-8; no NaN or
    Infinity, no number beyond a 64-bit float, no key given twice, no lone surrogate; at most MAX_DEPTH levels),
    or an APIError (400) that names the problem: ``body has a duplicate key "messages"``."""
    try:
        # A UTF-8 byte order mark before the JSON is ignored, as RFC 8259 allows and as Python's json.loads does
        # for bytes, and as a jsonl file's start (dataset/jsonl.py's numbered_lines).
        data = read_json(body.removeprefix(b"\xef\xbb\xbf"))
    except JsonTextError as error:  # named by the field that holds the value, where it lies inside one
        raise APIError(400, error.about("body"), param=field_path(error.keys) or None) from None
    if not isinstance(data, dict):
        raise APIError(400, "body must be a JSON object")
    return data


def parse_chat_request(body: bytes) -> ChatRequest:
    """The request in a body, or an APIError (400) that names what is wrong with it."""
    data = parse_json_object(body)
    try:
        return ChatRequest.model_validate(data)
    except ValidationError as error:
        raise validation_error(error) from None


def request_schemas(ref_prefix: str = "#/components/schemas/") -> dict[str, Any]:
    """The JSON schemas of the chat request and the models it holds, by name, for an OpenAPI document."""
    schema = ChatRequest.model_json_schema(ref_template=ref_prefix + "{model}")
    return {**schema.pop("$defs", {}), "ChatRequest": schema}


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


def token_logprob_body(data: bytes, logprob: float, top: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """One token's logprob entry: its text (its bytes decoded, a part of a character as U+FFFD, as OpenAI writes
    it), its log-probability, its exact bytes, and (`top`, for a generated token) the most likely tokens'
    entries."""
    body = {"token": data.decode("utf-8", errors="replace"), "logprob": max(logprob, MIN_LOGPROB),
            "bytes": list(data)}
    if top is not None:
        body["top_logprobs"] = top
    return body


def logprobs_body(content: list[dict[str, Any]]) -> dict[str, Any]:
    """A choice's "logprobs": the entries of its tokens."""
    return {"content": content, "refusal": None}


def completion_body(completion: CompletionId, message: dict[str, Any], finish_reason: str | None,
                    token_usage: dict[str, int], logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """A whole completion ("chat.completion"); `message` is what the assistant's message holds besides its role
    (content, and reasoning_content and tool_calls when there are any); `logprobs`: logprobs_body's."""
    return {"id": completion.id, "object": "chat.completion", "created": completion.created,
            "model": completion.model,
            "choices": [{"index": 0, "message": {"role": "assistant", **message},
                         "finish_reason": finish_reason, "logprobs": logprobs}],
            "usage": token_usage}


def chunk_body(completion: CompletionId, delta: dict[str, Any], finish_reason: str | None = None,
               include_usage: bool = False, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """One chunk of a streamed completion ("chat.completion.chunk"): `delta` is what the message gains, `logprobs`
    the entries this chunk carries (logprobs_body's)."""
    body = {"id": completion.id, "object": "chat.completion.chunk", "created": completion.created,
            "model": completion.model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}]}
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
