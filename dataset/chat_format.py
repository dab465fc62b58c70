"""ChatML, the one chat format of MiniNorm (the same as MiniMind's).

Each message renders as ``<|im_start|>{role}\\n{content}<|im_end|>\\n``; ``add_generation_prompt`` appends
``<|im_start|>assistant\\n``. No default system prompt is injected, so the rendering is exact and predictable.

The Jinja template below is what ``scripts/train_tokenizer.py`` writes into ``tokenizer_config.json``;
``render_chatml`` is the same format in plain Python that also reports where each assistant turn lies, which
the SFT loss mask needs. ``SFTDataset`` checks that a tokenizer's template renders like ``render_chatml``
before trusting these spans.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

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
