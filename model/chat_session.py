"""One conversation with a causal LM: history, prompt encoding, (streamed) generation and its speed.

A fine-tuned model gets the ChatML template with the last `history_turns` exchanges and an optional system
prompt. A pretrained model only knows documents, so it gets plain continuation: the text after an eos, which
is how every document but the first starts in packed pretraining (our tokenizer has no bos). Either way the
user's words are encoded as text (dataset.chat_format): a message containing "<|im_end|>" cannot end a turn or
forge one. Generation (model/generation.py) stops at the tokenizer's eos, `<|im_end|>`, and at the model
directory's configured eos ids, so directories whose generation_config lacks it stop too (MiniMind #555 looped
forever for that reason).

With `tools` (OpenAI-format schemas, e.g. dataset.tools.tool_schemas()) a reply is a tool loop: generate; if the
reply holds tool calls (read from its control ids), run each with dataset.tools.run_tool (every failure, an unknown
tool included, comes back as an "Error: ..." text the model reads), append the assistant's call and the tool
messages, and generate again -- at most `max_tool_rounds` rounds of calls, then the model's calls are no longer run.
The history keeps the whole exchange (calls and results), so the next user turn sees it. A call's JSON is decoded
greedily whatever the temperature (`greedy_tool_calls`): it has one right spelling, which a draw can break ("6 - 98"
copied for the question's "66 - 98"); the words around it are sampled as asked.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from dataset.chat_format import (encode_chatml, encode_text, parse_assistant_ids, render_chatml, split_exchanges,
                                 tool_call_span)
from dataset.tokenization import text_token_range
from dataset.tools import run_tool
from model.generation import FINISH_ERROR, FINISH_STOP, GenerationEngine, GenerationSettings

MAX_TOOL_ROUNDS = 3  # rounds of tool calls per user message; a model that keeps calling is stopped there


@dataclass(frozen=True)
class ToolResult:
    """One call the model made and what the tool returned (an "Error: ..." text when it failed)."""

    name: str
    arguments: dict
    result: str

    def describe(self) -> str:
        """``calculator({"expression": "2+3"}) -> 5``"""
        return f"{self.name}({json.dumps(self.arguments, ensure_ascii=False)}) -> {self.result}"


@dataclass(frozen=True)
class ToolRound:
    """One generation of the tool loop: the model's thinking, its text and the calls it made, with their results
    (empty in the last round; `unrun`: calls made after the last allowed round, which were not run; `unread_calls`:
    calls it opened that read as none, left in its text; `fit`: how its prompt was cut to fit the context, so a
    caller can tell the round that left the history out -- the call's, or only the answer's after a long result)."""

    reasoning: str
    content: str
    results: list[ToolResult]
    unrun: list[dict] = field(default_factory=list)
    unread_calls: int = 0
    fit: PromptFit | None = None


@dataclass
class Reply:
    text: str
    new_tokens: int
    seconds: float
    stopped_at_eos: bool  # False: it ran into max_new_tokens (or the context length)
    token_ids: list[int] = field(default_factory=list)  # the last generation's
    rounds: list[ToolRound] = field(default_factory=list)  # every generation, read back (chat template only)
    # How the last round's prompt was cut to fit the context: the exchange only grows from round to round, so no
    # earlier round cut more.
    fit: PromptFit | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else float("nan")


class MessageTooLong(ValueError):
    """A user message that does not fit the model's context even alone. str() is what does not fit, the tokens
    against the context ("takes 700 tokens in the chat format, over the model's context of 512"), for the caller to
    name the message before it ("line 3 ...") and say what to do after it (its own flags: shorten it, leave the
    tools out, use a longer model)."""

    def __init__(self, tokens: int, context: int, with_tools: bool, with_system: bool = False,
                 at_least: bool = False) -> None:
        self.tokens, self.context, self.with_tools, self.with_system = tokens, context, with_tools, with_system
        self.at_least = at_least  # `tokens` is the fewest its length allows, the message left untokenized
        # What else the tokens hold, for a caller to point at: a long system prompt read as a long message.
        beside = " and ".join(part for part, given in (("the system prompt", with_system),
                                                       ("the tools' schemas", with_tools)) if given)
        included = f", {beside} included" if beside else ""
        fewest = "at least " if at_least else ""
        super().__init__(f"takes {fewest}{tokens} tokens in the chat format{included}, over the model's context of "
                         f"{context}")


class PromptFit(NamedTuple):
    """A prompt made to fit the model's context: its ids, the new-token budget left beside them, the past exchanges
    left out (oldest first) and, when even the message in progress did not fit, the length it had before its start
    was cut away (0: not cut)."""

    ids: list[int]
    budget: int
    dropped_exchanges: int = 0
    uncut_tokens: int = 0


def uses_chat_template(mode: str, task: str | None, tokenizer: PreTrainedTokenizerBase) -> bool:
    """mode "chat" or "plain" decides; "auto": the template for fine-tuned models (SFT, LoRA, DPO: the trainer
    records the task), plain continuation for pretrained ones, and for directories without a record whether the
    tokenizer has a template."""
    if mode != "auto":
        return mode == "chat"
    if task is not None:
        return task != "pretrain"
    return bool(getattr(tokenizer, "chat_template", None))


def encode_prompt(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Mapping[str, Any]],
                  use_template: bool, tools: Sequence[Mapping[str, Any]] | None = None,
                  open_thinking: bool = False) -> list[int]:
    """The prompt's token ids: ChatML with the assistant's header (and the tools in the system turn), or (plain
    continuation) eos + the last message's text. Messages are text throughout: control-token strings in them stay
    text."""
    if not use_template:
        return [tokenizer.eos_token_id, *encode_text(tokenizer, messages[-1]["content"])]
    return encode_chatml(tokenizer, messages, add_generation_prompt=True, tools=tools,
                         open_thinking=open_thinking).input_ids


class ChatSession:
    """Multi-turn chat (use_template=True) or plain continuation (False) with one model; with `tools`, each reply
    runs the tool loop (chat template only)."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, use_template: bool,
                 system_prompt: str | None = None, history_turns: int = 2,
                 settings: GenerationSettings | None = None, engine: GenerationEngine | None = None,
                 tools: Sequence[Mapping[str, Any]] | None = None, open_thinking: bool = False,
                 max_tool_rounds: int = MAX_TOOL_ROUNDS, greedy_tool_calls: bool = True) -> None:
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos token; generation could not stop")
        if max_tool_rounds < 0:
            raise ValueError(f"max_tool_rounds must be 0 or more, got {max_tool_rounds}")
        self.model, self.tokenizer = model, tokenizer
        self.engine = engine or GenerationEngine(model, tokenizer, max_batch=1)
        self.use_template = use_template
        self.system_prompt = system_prompt or None
        self.history_turns = max(0, history_turns)
        self.settings = settings or GenerationSettings()
        self.tools = list(tools or []) if use_template else []  # plain continuation has no turns to call from
        if self.tools and greedy_tool_calls:
            self.settings = dataclasses.replace(self.settings, greedy_span=tool_call_span(tokenizer))
        self.open_thinking = open_thinking and use_template
        self.max_tool_rounds = max_tool_rounds
        # Every exchange, oldest first: a user message, then the assistant's calls, the tool messages and its
        # answer; messages() keeps the last history_turns exchanges (the only place that cut is made).
        self.history: list[dict[str, Any]] = []
        self.max_context = getattr(model.config, "max_position_embeddings", None) or 2048

    def reset(self) -> None:
        self.history.clear()

    def _conversation(self, current: list[dict]) -> list[dict]:
        """System prompt, the last `history_turns` exchanges and the exchange in progress."""
        kept = split_exchanges(self.history)[-self.history_turns:] if self.history_turns else []
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return system + [message for exchange in kept for message in exchange] + current

    def messages(self, user_text: str) -> list[dict[str, Any]]:
        """System prompt, the last `history_turns` exchanges and the new user message."""
        return self._conversation([{"role": "user", "content": user_text}])

    def render(self, user_text: str) -> str:
        """The prompt as text (before any cut to fit the context); the model gets encode_prompt's ids, in which
        a control-token string inside a message is text."""
        messages = self.messages(user_text)
        if not self.use_template:
            return self.tokenizer.eos_token + messages[-1]["content"]
        return render_chatml(messages, add_generation_prompt=True, tools=self.tools or None,
                             open_thinking=self.open_thinking)[0]

    def fit_prompt(self, user_text: str | list[dict]) -> PromptFit:
        """Prompt token ids and the new-token budget, dropping the oldest exchanges to fit the context (the
        exchange in progress -- a user message, or it with calls and results -- is kept); what was cut is
        recorded, for the caller to say. A chat message too long for the context alone is a MessageTooLong; a
        plain text, or an exchange its tool results made too long, keeps its end."""
        current = [{"role": "user", "content": user_text}] if isinstance(user_text, str) else user_text
        if self.use_template and len(current) == 1 and isinstance(current[0].get("content"), str):
            # Refused by its length alone when that proves it too long: a 15 MB line took ~30 s to tokenize first.
            tokens = text_token_range(self.tokenizer, current[0]["content"])
            if tokens is not None and tokens[0] >= self.max_context:
                raise MessageTooLong(tokens[0], self.max_context, bool(self.tools), self.system_prompt is not None,
                                     at_least=True)
        messages = self._conversation(current)
        first_past = 1 if self.system_prompt else 0  # index of the oldest past message
        dropped = 0
        while True:
            ids = encode_prompt(self.tokenizer, messages, self.use_template, self.tools or None, self.open_thinking)
            past = messages[first_past:len(messages) - len(current)]
            if len(ids) + self.settings.max_new_tokens <= self.max_context or not past:
                break
            del messages[first_past:first_past + len(split_exchanges(past)[0])]  # the oldest exchange
            dropped += 1
        uncut = 0
        if len(ids) >= self.max_context and self.use_template and len(current) == 1:
            # Cut to its end, the prompt would lose the system turn (the tools) and the message's own header.
            raise MessageTooLong(len(ids), self.max_context, bool(self.tools), self.system_prompt is not None)
        if len(ids) >= self.max_context:  # a plain text, or an exchange grown by its tool results: keep the end
            uncut, ids = len(ids), ids[-(self.max_context // 2):]
        budget = max(1, min(self.settings.max_new_tokens, self.max_context - len(ids)))
        return PromptFit(ids, budget, dropped, uncut)

    def reply(self, user_text: str, on_text: Callable[[str], None] | None = None,
              on_round: Callable[[ToolRound], None] | None = None) -> Reply:
        """Answer one message; `on_text` receives each generation's text piece by piece as it is generated (a tool
        call's JSON and the thinking included: their control tokens are not text), `on_round` each generation read
        back, after its calls ran."""
        current: list[dict[str, Any]] = [{"role": "user", "content": user_text}]
        rounds: list[ToolRound] = []
        new_tokens, seconds = 0, 0.0
        while True:
            prompt = self.fit_prompt(current)
            settings = dataclasses.replace(self.settings, max_new_tokens=prompt.budget)
            generation = self.engine.generate(prompt.ids, settings, on_text=on_text)
            if generation.finish_reason == FINISH_ERROR:
                raise RuntimeError(f"generation failed: {generation.error}")
            new_tokens, seconds = new_tokens + len(generation.token_ids), seconds + generation.seconds
            if not self.use_template:
                text = generation.text
                break
            # Any tool name counts as a call here (an unknown one gets run_tool's error back); without tools, no
            # call is read and "<tool_call>..." stays text.
            parsed = parse_assistant_ids(self.tokenizer, generation.token_ids, None if self.tools else [])
            text = parsed.content if self.tools or self.open_thinking else generation.text
            message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
            if parsed.reasoning_content:
                message["reasoning_content"] = parsed.reasoning_content
            if parsed.tool_calls:
                message["tool_calls"] = parsed.tool_calls
            current.append(message)
            run_now = len(rounds) < self.max_tool_rounds
            results = [ToolResult(call["name"], call["arguments"], run_tool(call["name"], call["arguments"]))
                       for call in parsed.tool_calls] if run_now else []
            current += [{"role": "tool", "content": result.result} for result in results]
            rounds.append(ToolRound(parsed.reasoning_content, parsed.content, results,
                                    [] if run_now else parsed.tool_calls, parsed.unread_calls, prompt))
            if on_round is not None:
                on_round(rounds[-1])
            if not results:
                break
        if self.use_template:
            self.history += current
        return Reply(text=text, new_tokens=new_tokens, seconds=seconds,
                     stopped_at_eos=generation.finish_reason == FINISH_STOP, token_ids=generation.token_ids,
                     rounds=rounds, fit=prompt)
