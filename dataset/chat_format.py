"""ChatML with tools and thinking: the one chat format of MiniNorm (MiniMind's, laid out as Qwen3 lays out tools).

A conversation renders as ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message, with these additions:

- ``tools`` (OpenAI's ``[{"type": "function", "function": {...}}]``, from the request or from the first message's
  ``tools`` field when it is a system message, MiniMind's place for them) go into the system turn, one compact line
  per tool: ``# Tools`` then ``name(arg: type, opt?: type): description``;
- an assistant message is ``<think>\\n{reasoning_content}\\n</think>\\n\\n{content}``, then each of its
  ``tool_calls`` as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (a newline before each); with no
  reasoning the think block is empty, ``<think>\\n\\n</think>\\n\\n``, exactly what the generation prompt injects;
- consecutive ``tool`` messages share one ``user`` turn, each as ``<tool_response>{content}</tool_response>``;
- ``add_generation_prompt`` appends ``<|im_start|>assistant\\n`` and, unless ``open_thinking``, the empty think
  block, so the model answers directly; with ``open_thinking`` the model may think first.

No default system prompt is injected. ``chat_segments`` is the format, built once: ``render_chatml`` joins it into
text and ``encode_chatml`` into token ids, with every message's text encoded as text (a control-token string inside a
message never becomes a control token). ``CHATML_TEMPLATE`` is the same format in Jinja, written into
``tokenizer_config.json`` by ``scripts/train_tokenizer.py``; ``check_chatml_tokenizer`` makes sure a tokenizer
renders what ``chat_segments`` does (tests/unit/test_chat_template.py compares them on many conversations).
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerBase

from dataset.atomic_io import first_line
from dataset.shown_value import shown_text, shown_value
from dataset.json_text import check_json_value, check_text, read_json, read_json_field

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"
TOOL_CALL, TOOL_CALL_END = "<tool_call>", "</tool_call>"
TOOL_RESPONSE, TOOL_RESPONSE_END = "<tool_response>", "</tool_response>"
THINK, THINK_END = "<think>", "</think>"
RESERVED_TOKENS: tuple[str, ...] = tuple(f"<|reserved_{i}|>" for i in range(4))  # spares for later formats

# The tokens the template emits (and nothing else may): a message's text never becomes one of them.
CONTROL_TOKENS: tuple[str, ...] = (IM_START, IM_END, TOOL_CALL, TOOL_CALL_END, TOOL_RESPONSE, TOOL_RESPONSE_END,
                                   THINK, THINK_END)
# Order fixes the ids: <|endoftext|>=0, <|im_start|>=1, <|im_end|>=2 (MiniMind's order), then the tool and thinking
# tokens 3..8 and the reserved ones.
SPECIAL_TOKENS: tuple[str, ...] = (ENDOFTEXT, *CONTROL_TOKENS, *RESERVED_TOKENS)

# The roles a conversation's messages may have (the server also takes OpenAI's "developer", as "system"). Another
# (a ShareGPT "human", a mistyped "Assistant") would train as a turn the chat never writes, or, lacking an
# assistant, leave the conversation nothing to learn.
ROLES = ("system", "user", "assistant", "tool")
EMPTY_THINK = "\n\n"  # what lies between <think> and </think> when there is no reasoning
AFTER_THINK = "\n\n"  # between </think> and the content

# The format in Jinja (transformers' apply_chat_template, llama.cpp). It takes tool_calls as lists and arguments as
# objects; a JSON-string "arguments" (OpenAI's wire form) is written as given, and a JSON-string "tool_calls" or
# "tools" (MiniMind's data), which it refuses in one line, must be parsed first: normalize_messages does both.
CHATML_TEMPLATE = (
    "{%- set tools = tools if tools else (messages[0].tools if messages and messages[0].role == 'system' "
    "and messages[0].tools is defined and messages[0].tools else none) -%}"
    "{%- if tools is string -%}"
    "{{- raise_exception('tools must be a list of tool schemas, not a JSON string: parse it first') -}}"
    "{%- endif -%}"
    "{%- if tools -%}"
    "{%- set tool_lines = namespace(text='# Tools') -%}"
    "{%- for tool in tools -%}"
    "{%- set f = tool.function if tool.function is defined else tool -%}"
    "{%- set p = f.parameters if f.parameters is defined and f.parameters else {} -%}"
    "{%- set required = p.required if p.required is defined and p.required else [] -%}"
    "{%- set tool_lines.text = tool_lines.text + '\\n' + f.name + '(' -%}"
    "{%- for name, prop in (p.properties if p.properties is defined and p.properties else {}).items() -%}"
    "{%- set tool_lines.text = tool_lines.text + (', ' if not loop.first else '') + name "
    "+ ('' if name in required else '?') + ': ' + ((prop.type if prop.type is defined else 'any') | string) -%}"
    "{%- endfor -%}"
    "{%- set tool_lines.text = tool_lines.text + ')' -%}"
    "{%- if f.description is defined and f.description -%}"
    "{%- set tool_lines.text = tool_lines.text + ': ' + f.description -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if not (messages and messages[0].role == 'system') -%}"
    "{{- '<|im_start|>system\\n' + tool_lines.text + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- set content = message.content if message.content is defined and message.content else '' -%}"
    "{%- if message.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user\\n' -}}{%- else -%}"
    "{{- '\\n' -}}"
    "{%- endif -%}"
    "{{- '<tool_response>' + content + '</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- elif message.role == 'assistant' -%}"
    "{%- set reasoning = message.reasoning_content if message.reasoning_content is defined "
    "and message.reasoning_content else '' -%}"
    "{%- set calls = message.tool_calls if message.tool_calls is defined and message.tool_calls else [] -%}"
    "{%- if calls is string -%}"
    "{{- raise_exception('messages[' ~ loop.index0 ~ '].tool_calls must be a list of calls, not a JSON string: "
    "parse it first') -}}"
    "{%- endif -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content -}}"
    "{%- for call in calls -%}"
    "{%- set call = call.function if call.function is defined else call -%}"
    "{%- set arguments = call.arguments if call.arguments is defined and call.arguments else {} -%}"
    "{{- '\\n' if content or not loop.first else '' -}}"
    "{{- '<tool_call>{\"name\": ' + (call.name | tojson) + ', \"arguments\": ' "
    "+ (arguments if arguments is string else arguments | tojson) + '}</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{%- if loop.first and message.role == 'system' and tools -%}"
    "{%- set content = content + '\\n\\n' + tool_lines.text if content else tool_lines.text -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if not open_thinking -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)


# --------------------------------------------------------------------------- messages
def _json_value(value: Any, field: str) -> Any:
    """A field that may come as a JSON string (MiniMind's data), read by the project's strict reader, or as the
    value itself (OpenAI's requests), held to the same rules (dataset/json_text.py); a ValueError naming the field."""
    if isinstance(value, str):
        return read_json_field(value, field)
    check_json_value(value, field)
    return value


def parse_tools(value: Any, field: str = "tools") -> list[dict]:
    """OpenAI-format tool schemas from a list or its JSON string; each as {"type": "function", "function": {...}}
    (a bare function object is accepted too). None or "" means no tools."""
    if value is None or value == "":
        return []
    tools = _json_value(value, field)
    if not isinstance(tools, list):
        raise ValueError(f"{field} must be a list of tool schemas, got {type(tools).__name__}")
    parsed = []
    for i, tool in enumerate(tools):
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ValueError(f'{field}[{i}] must be {{"type": "function", "function": {{"name": ...}}}}')
        parameters = function.get("parameters") or {}
        where = f"{field}[{i}].function.parameters"
        if not isinstance(parameters, dict) or not isinstance(parameters.get("properties", {}), dict):
            raise ValueError(f'{where} must be a JSON schema object with "properties"')
        # What tools_text reads: each property a schema object, "required" a list of names (a string would be
        # read as a substring test).
        for name, prop in (parameters.get("properties") or {}).items():
            if not isinstance(prop, dict):
                quoted = shown_text(json.dumps(name, ensure_ascii=False))
                kind = type(prop).__name__
                raise ValueError(f"{where}.properties[{quoted}] must be a JSON schema object, got {kind}")
        required = parameters.get("required")
        odd = ([] if required is None else [required] if not isinstance(required, list)
               else [name for name in required if not isinstance(name, str)])
        if odd:
            held = "a list holding " if isinstance(required, list) else ""
            raise ValueError(f"{where}.required must be a list of property names, got {held}{type(odd[0]).__name__}")
        description = function.get("description")
        if description is not None and not isinstance(description, str):  # the template adds it to a text
            raise ValueError(f"{field}[{i}].function.description must be a string, got {type(description).__name__}")
        parsed.append({"type": "function", "function": function})
    # What is kept is read again (the jsonl loader stores it as JSON text, the encoders normalize once more): a bare
    # function wrapped here is a level deeper than given, and must still be within the reader's bound.
    check_json_value(parsed, field)
    return parsed


def parse_tool_calls(value: Any, field: str = "tool_calls") -> list[dict]:
    """Tool calls as [{"name": str, "arguments": dict}]: from OpenAI's list of {"type": "function", "function":
    {"name", "arguments"}} (arguments a JSON string or an object) or MiniMind's JSON string of
    [{"name", "arguments"}]. None or "" means no calls."""
    if value is None or value == "":
        return []
    calls = _json_value(value, field)
    if isinstance(calls, dict):
        calls = [calls]
    if not isinstance(calls, list):
        raise ValueError(f"{field} must be a list of calls, got {type(calls).__name__}")
    parsed = []
    for i, call in enumerate(calls):
        function = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ValueError(f'{field}[{i}] must be {{"name": ..., "arguments": {{...}}}} or OpenAI\'s '
                             f'{{"type": "function", "function": {{"name": ..., "arguments": ...}}}}')
        check_text(function["name"], f"{field}[{i}].name")
        arguments = function.get("arguments")
        arguments = {} if arguments is None or arguments == "" else _json_value(arguments, f"{field}[{i}].arguments")
        if not isinstance(arguments, dict):
            raise ValueError(f"{field}[{i}].arguments must be a JSON object, got {type(arguments).__name__}")
        parsed.append({"name": function["name"], "arguments": arguments})
    # What is kept is read again (the jsonl loader stores it as JSON text, the encoders normalize once more):
    # arguments given as a JSON string, or one call not in a list, are deeper here than in the text they came in,
    # and must still be within the reader's bound, or the second reading fails where no line is named.
    check_json_value(parsed, field)
    return parsed


def _text_field(message: Mapping[str, Any], name: str, where: str) -> str:
    value = message.get(name)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ValueError(f"{where}.{name} must be a string, got {type(value).__name__}")
    return check_text(value, f"{where}.{name}")  # a lone surrogate cannot be tokenized


def normalize_messages(messages: Sequence[Mapping[str, Any]], field: str = "messages") -> list[dict]:
    """Messages in the canonical form both renderers read: role and content strings (content None is ""), and
    only where present, reasoning_content (a string), tool_calls (parse_tool_calls) and, on a first system
    message, tools (parse_tools). Raises ValueError naming the message (``{field}[i]``) and the field."""
    normalized = []
    for index, message in enumerate(messages):
        where = f"{field}[{index}]"
        if not isinstance(message, Mapping):
            raise ValueError(f"{where} must be an object with role and content, got {type(message).__name__}")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not (content is None or isinstance(content, str)):
            raise ValueError(f"a message's role and content must be strings, got {type(role).__name__} and "
                             f"{type(content).__name__}")
        if role not in ROLES:
            raise ValueError(f"{where}.role is {shown_value(role)}; a role is one of {', '.join(ROLES)}")
        out: dict[str, Any] = {"role": role, "content": _text_field(message, "content", where)}
        reasoning = _text_field(message, "reasoning_content", where)
        if reasoning:
            if role != "assistant":
                raise ValueError(f"{where}.reasoning_content: only assistant messages think, this one is {role!r}")
            out["reasoning_content"] = reasoning
        calls = parse_tool_calls(message.get("tool_calls"), f"{where}.tool_calls")
        if calls:
            if role != "assistant":
                raise ValueError(f"{where}.tool_calls: only assistant messages call tools, this one is {role!r}")
            out["tool_calls"] = calls
        tools = parse_tools(message.get("tools"), f"{where}.tools")
        if tools:
            if index != 0 or role != "system":
                raise ValueError(f"{where}.tools: only the first message, a system one, may carry tools")
            out["tools"] = tools
        normalized.append(out)
    return normalized


def split_exchanges(messages: Sequence[Mapping[str, Any]]) -> list[list[Mapping[str, Any]]]:
    """Messages cut into exchanges, each from a user message up to the next one (an assistant's calls and the tool
    results inside); messages before the first user message make an exchange of their own."""
    exchanges: list[list[Mapping[str, Any]]] = []
    for message in messages:
        if message["role"] == "user" or not exchanges:
            exchanges.append([])
        exchanges[-1].append(message)
    return exchanges


def tool_call_text(call: Mapping[str, Any]) -> str:
    """The JSON between <tool_call> and </tool_call>: {"name": ..., "arguments": {...}}."""
    return f'{{"name": {json.dumps(call["name"], ensure_ascii=False)}, "arguments": ' \
           f'{json.dumps(call["arguments"], ensure_ascii=False)}}}'


def tools_text(tools: Sequence[Mapping[str, Any]]) -> str:
    """The tools as the system turn shows them: "# Tools", then per tool ``name(arg: type, opt?: type):
    description`` -- a fraction of the tokens of their JSON schemas (docs/tools.md has the counts)."""
    lines = ["# Tools"]
    for tool in tools:
        function = tool["function"]
        parameters = function.get("parameters") or {}
        required = parameters.get("required") or []
        arguments = ", ".join(f"{name}{'' if name in required else '?'}: {prop.get('type', 'any')}"
                              for name, prop in (parameters.get("properties") or {}).items())
        description = function.get("description")
        lines.append(f"{function['name']}({arguments})" + (f": {description}" if description else ""))
    return "\n".join(lines)


# --------------------------------------------------------------------------- the format, once
@dataclass(frozen=True)
class Segment:
    """A piece of a rendered conversation: a control token (`control`) or text. `learned_from`: None when no
    character of it is supervised, else the offset of its first supervised character (to its end)."""

    text: str
    control: bool = False
    learned_from: int | None = None


def chat_segments(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = False,
                  tools: Sequence[Mapping[str, Any]] | str | None = None,
                  open_thinking: bool = False) -> list[Segment]:
    """The conversation as segments, never two text segments in a row. Supervised: an assistant message's
    thinking (its whole think block, when it has reasoning), content, tool calls and closing <|im_end|>; not its
    ``assistant\\n`` header, an empty think block (the prompt supplies it), nor the newline after <|im_end|>."""
    messages = normalize_messages(messages)
    tools = parse_tools(tools) or (messages[0].get("tools", []) if messages and messages[0]["role"] == "system"
                                   else [])
    segments: list[Segment] = []

    def control(token: str, learned: bool = False) -> None:
        segments.append(Segment(token, control=True, learned_from=0 if learned else None))

    def text(value: str, learned_from: int | None = None) -> None:
        segments.append(Segment(value, learned_from=learned_from))

    if tools and not (messages and messages[0]["role"] == "system"):
        control(IM_START), text(f"system\n{tools_text(tools)}"), control(IM_END), text("\n")
    for index, message in enumerate(messages):
        role, content = message["role"], message["content"]
        if role == "tool":
            if index == 0 or messages[index - 1]["role"] != "tool":
                control(IM_START), text("user\n")
            else:
                text("\n")
            control(TOOL_RESPONSE), text(content), control(TOOL_RESPONSE_END)
            if index == len(messages) - 1 or messages[index + 1]["role"] != "tool":
                control(IM_END), text("\n")
        elif role == "assistant":
            reasoning = message.get("reasoning_content", "")
            thinks = bool(reasoning)
            control(IM_START), text("assistant\n")
            control(THINK, thinks), text(f"\n{reasoning}\n" if thinks else EMPTY_THINK, 0 if thinks else None)
            control(THINK_END, thinks)
            calls = message.get("tool_calls", [])
            text(AFTER_THINK + content + ("\n" if content and calls else ""), 0 if thinks else len(AFTER_THINK))
            for number, call in enumerate(calls):
                if number:
                    text("\n", 0)
                control(TOOL_CALL, True), text(tool_call_text(call), 0), control(TOOL_CALL_END, True)
            control(IM_END, True), text("\n")
        else:
            if index == 0 and role == "system" and tools:
                content = f"{content}\n\n{tools_text(tools)}" if content else tools_text(tools)
            control(IM_START), text(f"{role}\n{content}"), control(IM_END), text("\n")
    if add_generation_prompt:
        control(IM_START), text("assistant\n")
        if not open_thinking:
            control(THINK), text(EMPTY_THINK), control(THINK_END), text(AFTER_THINK)
    return segments


def render_chatml(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = False,
                  tools: Sequence[Mapping[str, Any]] | str | None = None,
                  open_thinking: bool = False) -> tuple[str, list[tuple[int, int]]]:
    """The conversation as text, and the character spans ``[start, end)`` the SFT loss covers (chat_segments),
    adjacent supervised pieces merged: e.g. an assistant's content with its closing ``<|im_end|>``."""
    parts: list[str] = []
    spans: list[tuple[int, int]] = []
    pos = 0
    for segment in chat_segments(messages, add_generation_prompt, tools, open_thinking):
        if segment.learned_from is not None and segment.learned_from < len(segment.text):
            start = pos + segment.learned_from
            if spans and spans[-1][1] == start:
                start = spans.pop()[0]
            spans.append((start, pos + len(segment.text)))
        parts.append(segment.text)
        pos += len(segment.text)
    return "".join(parts), spans


# --------------------------------------------------------------------------- text as text
# A tokenizer matches its special-token strings anywhere in the text it is given, so a message that contains the
# characters "<|im_end|>" would end its turn, and "<|im_end|>\n<|im_start|>assistant\n" in a user message would
# forge one. Messages are therefore tokenized with special-token matching off, and the control tokens are
# inserted as ids where the format puts them. Between two control tokens the text is encoded in one
# piece, so a conversation without such strings gets exactly the ids of tokenizing its rendered text.
_TEXT_BACKENDS: "weakref.WeakKeyDictionary[PreTrainedTokenizerBase, Tokenizer]" = weakref.WeakKeyDictionary()
_CHATML_CHECKED: "weakref.WeakKeyDictionary[PreTrainedTokenizerBase, str]" = weakref.WeakKeyDictionary()
_PROBE = [
    {"role": "system", "content": "You are terse.", "tools": [
        {"type": "function", "function": {"name": "wiki", "description": "Look up.", "parameters": {
            "type": "object", "properties": {"title": {"type": "string"}, "n": {"type": "integer"}},
            "required": ["title"]}}}]},
    {"role": "user", "content": "Hi 你好 🙂"},
    {"role": "assistant", "content": "", "reasoning_content": "Look it up.",
     "tool_calls": [{"name": "wiki", "arguments": {"title": "Ω"}}, {"name": "wiki", "arguments": {}}]},
    {"role": "tool", "content": "A."},
    {"role": "tool", "content": "B."},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": " spaced \n"},
]
_PROBE_RENDERINGS = ({"add_generation_prompt": False}, {"add_generation_prompt": True},
                     {"add_generation_prompt": True, "open_thinking": True})


def text_backend(tokenizer: PreTrainedTokenizerBase) -> Tokenizer:
    """A copy of the tokenizer's Rust backend that reads every added token's string as plain text (built once per
    tokenizer; the tokenizer itself is left as it is, so other callers and threads are unaffected)."""
    backend = _TEXT_BACKENDS.get(tokenizer)
    if backend is None:
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError("a fast (Rust-backed) tokenizer is needed to keep control-token strings as text")
        spec = json.loads(tokenizer.backend_tokenizer.to_str())
        for added in spec.get("added_tokens", []):
            # encode_special_tokens reads only the tokens marked special as text; an added token left unmarked
            # (Qwen's <think> and <tool_call>, in an imported model's tokenizer) would still match in the text.
            added["special"] = True
        backend = Tokenizer.from_str(json.dumps(spec))
        backend.encode_special_tokens = True
        backend.no_truncation()
        backend.no_padding()
        _TEXT_BACKENDS[tokenizer] = backend
    return backend


def encode_text(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Token ids of `text` as text: "<|im_end|>" in it is a few ordinary tokens, never the control token."""
    return text_backend(tokenizer).encode(text, add_special_tokens=False).ids


def control_id(tokenizer: PreTrainedTokenizerBase, token: str) -> int:
    """The id of a control token, which must be a special token of the tokenizer."""
    for token_id, added in tokenizer.added_tokens_decoder.items():
        if added.content == token and added.special:
            return int(token_id)
    raise ValueError(f"{token!r} must be a special token of the tokenizer")


def tool_call_span(tokenizer: PreTrainedTokenizerBase) -> tuple[int, int]:
    """The ids of the control tokens around a tool call's JSON, <tool_call> and </tool_call>."""
    return control_id(tokenizer, TOOL_CALL), control_id(tokenizer, TOOL_CALL_END)


def check_chatml_tokenizer(tokenizer: PreTrainedTokenizerBase) -> None:
    """The encoders below build the format themselves; fail early, in one line, if the tokenizer lacks its control
    tokens (a tokenizer made before the tool and thinking tokens) or if its own template (what other programs use
    with the exported model) renders anything else."""
    if _CHATML_CHECKED.get(tokenizer) == tokenizer.chat_template:
        return
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("a fast (Rust-backed) tokenizer is needed for ChatML encoding")
    special = {added.content for added in tokenizer.added_tokens_decoder.values() if added.special}
    missing = [token for token in CONTROL_TOKENS if token not in special]
    if missing:
        raise ValueError(f"the tokenizer lacks the control tokens {' '.join(missing)} (it predates MiniNorm's tool "
                         f"and thinking tokens); retrain the model with today's tokenizer (model/, "
                         f"scripts/train_tokenizer.py)")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat_template; MiniNorm's is written by scripts/train_tokenizer.py")
    for kwargs in _PROBE_RENDERINGS:
        try:
            rendered = tokenizer.apply_chat_template(_PROBE, tokenize=False, **kwargs)
        except TemplateError as error:  # an edited chat_template.jinja that does not parse or fails to render
            raise ValueError(f"the tokenizer's chat_template does not render: {first_line(error)}; MiniNorm's is "
                             f"written by scripts/train_tokenizer.py") from None
        except Exception as error:  # Python's own, from what the template computes: range(10**9), 1 / 0
            raise ValueError(f"the tokenizer's chat_template does not render: {first_line(error, named=True)}; "
                             f"MiniNorm's is written by scripts/train_tokenizer.py") from None
        expected = render_chatml(_PROBE, **kwargs)[0]
        if rendered != expected:
            # The rendering is the template's (an edited chat_template.jinja may write 100,000 characters over many
            # lines, which were quoted whole): quoted from where it first differs, each side cut by shown_value.
            at = next((i for i, (ours, theirs) in enumerate(zip(expected, rendered)) if ours != theirs),
                      min(len(expected), len(rendered)))
            raise ValueError(f"the tokenizer's chat_template is not MiniNorm's ChatML (dataset/chat_format.py); "
                             f"with {kwargs} it renders {shown_value(rendered[at:])} at character {at}, where "
                             f"ChatML has {shown_value(expected[at:])}")
    _CHATML_CHECKED[tokenizer] = tokenizer.chat_template


@dataclass(frozen=True)
class ChatEncoding:
    """Token ids of a conversation, and for each id whether it is an assistant token the SFT loss learns
    (chat_segments says which)."""

    input_ids: list[int]
    assistant: list[bool]


def encode_chatml_batch(tokenizer: PreTrainedTokenizerBase, conversations: Sequence[Sequence[Mapping[str, Any]]],
                        add_generation_prompt: bool = False, tools: Sequence[Mapping[str, Any]] | str | None = None,
                        open_thinking: bool = False) -> list[ChatEncoding]:
    """encode_chatml for many conversations, with one batch call to the tokenizer."""
    check_chatml_tokenizer(tokenizer)
    ids_of = {token: control_id(tokenizer, token) for token in CONTROL_TOKENS}
    all_segments = [chat_segments(messages, add_generation_prompt, tools, open_thinking)
                    for messages in conversations]
    texts = [segment.text for segments in all_segments for segment in segments if not segment.control]
    encodings = iter(text_backend(tokenizer).encode_batch(texts, add_special_tokens=False))
    result = []
    for segments in all_segments:
        ids: list[int] = []
        assistant: list[bool] = []
        for segment in segments:
            learned_from = segment.learned_from
            if segment.control:
                ids.append(ids_of[segment.text])
                assistant.append(learned_from is not None)
                continue
            encoding = next(encodings)
            ids += encoding.ids
            # A token is learned when it starts inside the supervised part; a token that straddles the boundary (a
            # newline merged across header and content) belongs to the part before it, which the prompt supplies.
            assistant += [learned_from is not None and start >= learned_from for start, _ in encoding.offsets]
        result.append(ChatEncoding(ids, assistant))
    return result


def encode_chatml(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Mapping[str, Any]],
                  add_generation_prompt: bool = False, tools: Sequence[Mapping[str, Any]] | str | None = None,
                  open_thinking: bool = False) -> ChatEncoding:
    """The token ids of `messages` (what render_chatml's text tokenizes to when no message contains a
    control-token string), with every message's text encoded as text."""
    return encode_chatml_batch(tokenizer, [messages], add_generation_prompt, tools, open_thinking)[0]


# --------------------------------------------------------------------------- reading a generated reply
@dataclass(frozen=True)
class AssistantReply:
    """A generated assistant turn read back into OpenAI's message fields: ``content``, ``reasoning_content`` and
    ``tool_calls`` ([{"name", "arguments": dict}]). A call that cannot be read -- invalid JSON, no name, arguments
    that are not an object, a tool not offered -- stays in ``content`` as the text the model wrote, and is counted in
    ``unread_calls`` (with a <tool_call> never closed, or closed after another one opened)."""

    content: str
    reasoning_content: str
    tool_calls: list[dict]
    unread_calls: int = 0  # the <tool_call> openers that became no call


def _read_call(text: str, tool_names: set[str] | None) -> dict | None:
    """The call a model wrote between <tool_call> and </tool_call>, or None (it stays content): JSON the strict
    reader refuses (a key given twice means whatever a reader picks), no name, arguments not an object, or a name
    that is not offered. The name checked is the returned call's own, and it must be the one the model wrote at the
    top: a nested "function" object naming another tool cannot slip past the check."""
    try:
        value = read_json(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    try:
        call = parse_tool_calls([value])[0]
    except ValueError:
        return None
    if call["name"] != value["name"] or (tool_names is not None and call["name"] not in tool_names):
        return None
    return call


REASONING, CONTENT, CALL = "reasoning", "content", "call"  # the kinds of a ReplySpan


@dataclass(frozen=True)
class ReplySpan:
    """Where one part of a reply lies in its ids: ``ids[start:end]`` are a thought's (after <think>), content's or a
    call's (between <tool_call> and </tool_call>, the ids start - 1 and end). ``stray``: content that begins with a
    <tool_call> that became no call (another opener came before its closer, or the reply ended)."""

    kind: str
    start: int
    end: int
    stray: bool = False


class ReplyLayout:
    """parse_assistant_ids's reading of a reply's ids, by control ids alone and one id at a time: ``push`` ids as
    they are generated; ``settled`` lists the spans that no later id can change, in order (a thought once </think>
    ends it, content once an opener follows it, a call once closed), and ``tail`` the one still open at the end, as
    the ids so far read. Each id is looked at once, so a reply read as it grows costs its length in all. What a
    span's ids say (its text, or the call a call's span holds) is read_span's."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._think, self._think_end, self._opener, self._closer, self._end = (
            control_id(tokenizer, token) for token in (THINK, THINK_END, TOOL_CALL, TOOL_CALL_END, IM_END))
        self.ids: list[int] = []  # the reply's ids up to <|im_end|>
        self.ended = False  # <|im_end|> came: later ids are no part of the reply
        self.settled: list[ReplySpan] = []
        self._thinking = False  # the reply began with <think>, and no </think> came yet
        self._open: int | None = None  # where the open content or call begins
        self._open_call = False  # the open span is a <tool_call> with neither tag after it yet

    def push(self, ids: Sequence[int]) -> None:
        for token in ids:
            if self.ended or token == self._end:
                self.ended = True
                return
            at = len(self.ids)
            self.ids.append(token)
            if self._thinking:
                if token == self._think_end:
                    self.settled.append(ReplySpan(REASONING, 1, at))
                    self._thinking = False
            elif at == 0 and token == self._think:
                self._thinking = True
            elif token == self._opener:  # ends the open content; an opener still open before it is stray
                if self._open is not None:
                    self.settled.append(ReplySpan(CONTENT, self._open, at, stray=self._open_call))
                self._open, self._open_call = at, True
            elif token == self._closer and self._open_call:
                self.settled.append(ReplySpan(CALL, self._open + 1, at))
                self._open, self._open_call = None, False
            elif self._open is None:
                self._open = at

    def tail(self, unfinished: bool = False) -> ReplySpan | None:
        """The open span as the ids so far read: a thought not yet ended, or content up to the end (an opener with
        no closer yet is none while `unfinished`: it may still become a call; else it is stray content)."""
        if self._thinking:
            return ReplySpan(REASONING, 1, len(self.ids))
        if self._open is None or (self._open_call and unfinished):
            return None
        return ReplySpan(CONTENT, self._open, len(self.ids), stray=self._open_call)


def read_span(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int], span: ReplySpan,
              tool_names: set[str] | None) -> tuple[str, str | dict]:
    """What a span says: (REASONING or CONTENT, its text as decoded, not yet stripped of the format's newlines) or
    (CALL, the call); a call that cannot be read (see _read_call) is (CONTENT, its text with its tags)."""
    decode = lambda part: tokenizer.decode(part, skip_special_tokens=False)  # noqa: E731
    if span.kind != CALL:
        return span.kind, decode(ids[span.start:span.end])
    call = _read_call(decode(ids[span.start:span.end]), tool_names)
    return (CONTENT, decode(ids[span.start - 1:span.end + 1])) if call is None else (CALL, call)


def parse_assistant_ids(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int],
                        tool_names: Sequence[str] | None = None, unfinished: bool = False) -> AssistantReply:
    """Read a generated reply (the ids after the generation prompt, up to <|im_end|> if present) by its control
    ids, never by text: a "<tool_call>" the model spelled in ordinary pieces is content.

    A reply thinks only when its first token is <think> (the format's prompt never leaves a thought open: it holds
    the closed empty block, or with open_thinking ends at the assistant's header, where the model writes <think>
    itself); the thought ends at the first </think>, and a reply cut before it is all reasoning. Any other <think>
    or </think> is a stray control token: content, shown as its text, as a stray <tool_call> is. So every prefix of
    a reply reads as the start of the whole one (what lets a stream send reasoning and content as they come).

    A call is a </tool_call> with the nearest <tool_call> before it; an opener with another opener before its
    closer is stray, and stays content with its text. `unfinished`: the reply is still being generated, so an
    opener with no closer after it yet (and what follows it) is left out: it may still become a call. Text outside
    the calls is the content, stripped of the format's newlines; `tool_names`: the tools a call may name (None:
    any). The reading is ReplyLayout's (where each part lies) and read_span's (what it says)."""
    layout = ReplyLayout(tokenizer)
    layout.push(ids)
    names = set(tool_names) if tool_names is not None else None
    tail = layout.tail(unfinished)
    reasoning = ""
    content: list[str] = []
    calls: list[dict] = []
    unread = 0
    for span in layout.settled + ([tail] if tail is not None else []):
        kind, value = read_span(tokenizer, layout.ids, span, names)
        if kind == REASONING:
            reasoning = value.strip("\n")
        elif kind == CALL:
            calls.append(value)
        else:
            content.append(value)
            unread += span.stray or span.kind == CALL
    return AssistantReply("".join(content).strip("\n"), reasoning, calls, unread)
