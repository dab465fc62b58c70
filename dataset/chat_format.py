"""ChatML, the one chat format of MiniNorm (the same as MiniMind's).

Each message renders as ``<|im_start|>{role}\\n{content}<|im_end|>\\n``; ``add_generation_prompt`` appends
``<|im_start|>assistant\\n``. No default system prompt is injected, so the rendering is exact and predictable.

The Jinja template below is what ``scripts/train_tokenizer.py`` writes into ``tokenizer_config.json``;
``render_chatml`` is the same format in plain Python that also reports where each assistant turn lies.
``encode_chatml`` is how MiniNorm turns messages into token ids -- for SFT data, chat, evaluation and the server --
with every message's text encoded as text: a control-token string inside a message never becomes a control
token. ``check_chatml_tokenizer`` makes sure a tokenizer's own template renders this same format.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerBase

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"

# Order fixes the ids: <|endoftext|>=0, <|im_start|>=1, <|im_end|>=2 (MiniMind's order).
SPECIAL_TOKENS: tuple[str, ...] = (ENDOFTEXT, IM_START, IM_END)

CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)


def render_chatml(
    messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = False
) -> tuple[str, list[tuple[int, int]]]:
    """Render messages as ChatML text.

    Returns the text and, for every assistant message, the character span ``[start, end)`` that the loss
    should cover: the content plus its closing ``<|im_end|>`` -- not the ``<|im_start|>assistant\\n`` header
    and not the newline after ``<|im_end|>``.
    """
    parts: list[str] = []
    spans: list[tuple[int, int]] = []
    pos = 0
    for message in messages:
        role, content = message["role"], message["content"]
        header = f"{IM_START}{role}\n"
        body = f"{content}{IM_END}"
        if role == "assistant":
            start = pos + len(header)
            spans.append((start, start + len(body)))
        piece = header + body + "\n"
        parts.append(piece)
        pos += len(piece)
    if add_generation_prompt:
        parts.append(f"{IM_START}assistant\n")
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
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi 你好 🙂"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": " spaced \n"},
]


def text_backend(tokenizer: PreTrainedTokenizerBase) -> Tokenizer:
    """A copy of the tokenizer's Rust backend that reads special-token strings as plain text (built once per
    tokenizer; the tokenizer itself is left as it is, so other callers and threads are unaffected)."""
    backend = _TEXT_BACKENDS.get(tokenizer)
    if backend is None:
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError("a fast (Rust-backed) tokenizer is needed to keep control-token strings as text")
        backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
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


def check_chatml_tokenizer(tokenizer: PreTrainedTokenizerBase) -> None:
    """The encoders below build ChatML themselves; fail early, naming the problem, if the tokenizer's own template
    (what other programs use with the exported model) renders anything else, or if it lacks the control tokens."""
    if _CHATML_CHECKED.get(tokenizer) == tokenizer.chat_template:
        return
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat_template; MiniNorm's ChatML one is written by "
                         "scripts/train_tokenizer.py")
    for add_generation_prompt in (False, True):
        rendered = tokenizer.apply_chat_template(_PROBE, tokenize=False, add_generation_prompt=add_generation_prompt)
        if rendered != render_chatml(_PROBE, add_generation_prompt)[0]:
            raise ValueError(f"the tokenizer's chat_template is not plain ChatML; it renders {rendered!r}")
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("a fast (Rust-backed) tokenizer is needed for ChatML encoding")
    for token in (IM_START, IM_END):
        control_id(tokenizer, token)
    _CHATML_CHECKED[tokenizer] = tokenizer.chat_template


@dataclass(frozen=True)
class ChatEncoding:
    """Token ids of a ChatML conversation, and for each id whether it is an assistant token the SFT loss learns:
    an assistant message's content and its closing <|im_end|> (not its header, not the newline after it)."""

    input_ids: list[int]
    assistant: list[bool]


def _chatml_segments(messages: Sequence[Mapping[str, str]],
                     add_generation_prompt: bool) -> list[tuple[str, str, int | None]]:
    """ChatML as a list of ("control", token, -) and ("text", text, first assistant character or None) pieces;
    an assistant message's closing control token is ("control", IM_END, 1)."""
    segments: list[tuple[str, str, int | None]] = []
    for message in messages:
        role, content = message["role"], message["content"]
        if not isinstance(role, str) or not isinstance(content, str):
            raise ValueError(f"a message's role and content must be strings, got {type(role).__name__} and "
                             f"{type(content).__name__}")
        header = f"{role}\n"
        is_assistant = role == "assistant"
        segments += [("control", IM_START, None), ("text", header + content, len(header) if is_assistant else None),
                     ("control", IM_END, 1 if is_assistant else None), ("text", "\n", None)]
    if add_generation_prompt:
        segments += [("control", IM_START, None), ("text", "assistant\n", None)]
    return segments


def encode_chatml_batch(tokenizer: PreTrainedTokenizerBase, conversations: Sequence[Sequence[Mapping[str, str]]],
                        add_generation_prompt: bool = False) -> list[ChatEncoding]:
    """encode_chatml for many conversations, with one batch call to the tokenizer."""
    check_chatml_tokenizer(tokenizer)
    ids_of = {token: control_id(tokenizer, token) for token in (IM_START, IM_END)}
    all_segments = [_chatml_segments(messages, add_generation_prompt) for messages in conversations]
    texts = [text for segments in all_segments for kind, text, _ in segments if kind == "text"]
    encodings = iter(text_backend(tokenizer).encode_batch(texts, add_special_tokens=False))
    result = []
    for segments in all_segments:
        ids: list[int] = []
        assistant: list[bool] = []
        for kind, text, learned_from in segments:
            if kind == "control":
                ids.append(ids_of[text])
                assistant.append(learned_from is not None)
                continue
            encoding = next(encodings)
            ids += encoding.ids
            # A token is learned when it starts inside the content; a token that straddles the header and the
            # content (a newline merged across them) belongs to the header, which the prompt supplies.
            assistant += [learned_from is not None and start >= learned_from for start, _ in encoding.offsets]
        result.append(ChatEncoding(ids, assistant))
    return result


def encode_chatml(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Mapping[str, str]],
                  add_generation_prompt: bool = False) -> ChatEncoding:
    """The ChatML token ids of `messages` (what render_chatml's text tokenizes to when no message contains a
    control-token string), with every message's role and content encoded as text."""
    return encode_chatml_batch(tokenizer, [messages], add_generation_prompt)[0]
