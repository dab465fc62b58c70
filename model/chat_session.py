"""One conversation with a causal LM: history, prompt encoding, (streamed) generation and its speed.

A fine-tuned model gets the ChatML template with the last `history_turns` exchanges and an optional system
prompt. A pretrained model only knows documents, so it gets plain continuation: the text after an eos, which
is how every document but the first starts in packed pretraining (our tokenizer has no bos). Either way the
user's words are encoded as text (dataset.chat_format): a message containing "<|im_end|>" cannot end a turn or
forge one. Generation (model/generation.py) stops at the tokenizer's eos, `<|im_end|>`, and at the model
directory's configured eos ids, so directories whose generation_config lacks it stop too (MiniMind #555 looped
forever for that reason).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Callable

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from dataset.chat_format import encode_chatml, encode_text, render_chatml
from model.generation import FINISH_ERROR, FINISH_STOP, GenerationEngine, GenerationSettings


@dataclass
class Reply:
    text: str
    new_tokens: int
    seconds: float
    stopped_at_eos: bool  # False: it ran into max_new_tokens (or the context length)
    token_ids: list[int] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else float("nan")


def uses_chat_template(mode: str, task: str | None, tokenizer: PreTrainedTokenizerBase) -> bool:
    """mode "chat" or "plain" decides; "auto": the template for fine-tuned models (SFT, LoRA, DPO: the trainer
    records the task), plain continuation for pretrained ones, and for directories without a record whether the
    tokenizer has a template."""
    if mode != "auto":
        return mode == "chat"
    if task is not None:
        return task != "pretrain"
    return bool(getattr(tokenizer, "chat_template", None))


def encode_prompt(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Mapping[str, str]],
                  use_template: bool) -> list[int]:
    """The prompt's token ids: ChatML with the assistant's header, or (plain continuation) eos + the last
    message's text. Messages are text throughout: control-token strings in them stay text."""
    if not use_template:
        return [tokenizer.eos_token_id, *encode_text(tokenizer, messages[-1]["content"])]
    return encode_chatml(tokenizer, messages, add_generation_prompt=True).input_ids


class ChatSession:
    """Multi-turn chat (use_template=True) or plain continuation (False) with one model."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, use_template: bool,
                 system_prompt: str | None = None, history_turns: int = 2,
                 settings: GenerationSettings | None = None, engine: GenerationEngine | None = None) -> None:
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos token; generation could not stop")
        self.model, self.tokenizer = model, tokenizer
        self.engine = engine or GenerationEngine(model, tokenizer, max_batch=1)
        self.use_template = use_template
        self.system_prompt = system_prompt or None
        self.history_turns = max(0, history_turns)
        self.settings = settings or GenerationSettings()
        # Every exchange, alternating user / assistant messages, oldest first; messages() keeps the last
        # history_turns of them (the only place that cut is made).
        self.history: list[dict[str, str]] = []
        self.max_context = getattr(model.config, "max_position_embeddings", None) or 2048

    def reset(self) -> None:
        self.history.clear()

    def messages(self, user_text: str) -> list[dict[str, str]]:
        """System prompt, the last `history_turns` exchanges and the new user message."""
        kept = self.history[-2 * self.history_turns:] if self.history_turns else []
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return system + kept + [{"role": "user", "content": user_text}]

    def render(self, user_text: str) -> str:
        """The prompt as text (before any cut to fit the context); the model gets encode_prompt's ids, in which
        a control-token string inside a message is text."""
        messages = self.messages(user_text)
        if not self.use_template:
            return self.tokenizer.eos_token + messages[-1]["content"]
        return render_chatml(messages, add_generation_prompt=True)[0]

    def _prompt_ids(self, user_text: str) -> tuple[list[int], int]:
        """Prompt token ids and the new-token budget, dropping the oldest exchanges to fit the context."""
        messages = self.messages(user_text)
        first_past = 1 if self.system_prompt else 0  # index of the oldest past message
        while True:
            ids = encode_prompt(self.tokenizer, messages, self.use_template)
            if len(ids) + self.settings.max_new_tokens <= self.max_context or len(messages) - first_past <= 1:
                break
            del messages[first_past:first_past + 2]  # the oldest exchange: a user and an assistant message
        if len(ids) >= self.max_context:  # a single message longer than the context: keep its end
            ids = ids[-(self.max_context // 2):]
        return ids, max(1, min(self.settings.max_new_tokens, self.max_context - len(ids)))

    def reply(self, user_text: str, on_text: Callable[[str], None] | None = None) -> Reply:
        """Answer one message; `on_text` receives the answer piece by piece as it is generated."""
        ids, budget = self._prompt_ids(user_text)
        settings = dataclasses.replace(self.settings, max_new_tokens=budget)
        generation = self.engine.generate(ids, settings, on_text=on_text)
        if generation.finish_reason == FINISH_ERROR:
            raise RuntimeError(f"generation failed: {generation.error}")
        if self.use_template:
            self.history += [{"role": "user", "content": user_text},
                             {"role": "assistant", "content": generation.text.strip()}]
        return Reply(text=generation.text, new_tokens=len(generation.token_ids), seconds=generation.seconds,
                     stopped_at_eos=generation.finish_reason == FINISH_STOP, token_ids=generation.token_ids)
