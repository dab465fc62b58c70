"""One conversation with a causal LM: history, prompt rendering, (streamed) generation and its speed.

A fine-tuned model gets the ChatML template with the last `history_turns` exchanges and an optional system
prompt. A pretrained model only knows documents, so it gets plain continuation: the text after an eos, which
is how every document but the first starts in packed pretraining (our tokenizer has no bos). Generation stops
at the tokenizer's eos, `<|im_end|>`; it is passed explicitly so directories whose generation_config lacks it
stop too (MiniMind #555 looped forever for that reason).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase, TextStreamer


@dataclass
class GenerationSettings:
    max_new_tokens: int = 256
    temperature: float = 0.7   # 0: greedy
    top_p: float = 0.9
    top_k: int = 0             # 0: off
    repetition_penalty: float = 1.0

    def generate_kwargs(self) -> dict:
        kwargs: dict = {"do_sample": self.temperature > 0, "repetition_penalty": self.repetition_penalty}
        if self.temperature > 0:
            kwargs.update(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)  # 0 disables (None: 50)
        else:  # the model dir's generation_config may carry sampling values; greedy must not warn about them
            kwargs.update(temperature=None, top_p=None, top_k=None)
        return kwargs


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


class _CallbackStreamer(TextStreamer):
    """transformers' TextStreamer, handing each finished piece of text to a callback instead of print()."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, on_text: Callable[[str], None]) -> None:
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.on_text = on_text

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        if text:
            self.on_text(text)


class ChatSession:
    """Multi-turn chat (use_template=True) or plain continuation (False) with one model."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, use_template: bool,
                 system_prompt: str | None = None, history_turns: int = 2,
                 settings: GenerationSettings | None = None) -> None:
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos token; generation could not stop")
        self.model, self.tokenizer = model, tokenizer
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
        """The exact prompt text the model sees (before any cut to fit the context)."""
        return self._render(self.messages(user_text))

    def _render(self, messages: list[dict[str, str]]) -> str:
        if not self.use_template:
            return self.tokenizer.eos_token + messages[-1]["content"]
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def _prompt_ids(self, user_text: str) -> tuple[list[int], int]:
        """Prompt token ids and the new-token budget, dropping the oldest exchanges to fit the context."""
        messages = self.messages(user_text)
        first_past = 1 if self.system_prompt else 0  # index of the oldest past message
        while True:
            ids = self.tokenizer(self._render(messages), add_special_tokens=False)["input_ids"]
            if len(ids) + self.settings.max_new_tokens <= self.max_context or len(messages) - first_past <= 1:
                break
            del messages[first_past:first_past + 2]  # the oldest exchange: a user and an assistant message
        if len(ids) >= self.max_context:  # a single message longer than the context: keep its end
            ids = ids[-(self.max_context // 2):]
        return ids, max(1, min(self.settings.max_new_tokens, self.max_context - len(ids)))

    @torch.no_grad()
    def reply(self, user_text: str, on_text: Callable[[str], None] | None = None) -> Reply:
        """Answer one message; `on_text` receives the answer piece by piece as it is generated."""
        ids, budget = self._prompt_ids(user_text)
        device = next(self.model.parameters()).device
        input_ids = torch.tensor([ids], dtype=torch.long, device=device)
        streamer = _CallbackStreamer(self.tokenizer, on_text) if on_text is not None else None
        eos = self.tokenizer.eos_token_id
        started = time.perf_counter()
        output = self.model.generate(
            input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=budget,
            eos_token_id=eos, pad_token_id=self.tokenizer.pad_token_id, streamer=streamer,
            **self.settings.generate_kwargs())
        seconds = time.perf_counter() - started
        new = output[0, len(ids):].tolist()
        stopped = bool(new) and new[-1] == eos
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        if self.use_template:
            self.history += [{"role": "user", "content": user_text}, {"role": "assistant", "content": text.strip()}]
        return Reply(text=text, new_tokens=len(new), seconds=seconds, stopped_at_eos=stopped, token_ids=new)
