"""Generation for chat and serving: one decode loop, shared by eval/chat.py, eval/evaluate.py and the server.

`GenerationEngine` runs requests with continuous batching: each new request is prefilled on its own, then joins
the running batch between two decode steps, and leaves it as soon as it is done (end of turn, its token budget,
a stop string, or a cancel, e.g. a client that disconnected), so its slot is free for the next one. Rows of the
batch have different lengths; their KV caches are left-padded to a common length and the padding is masked
(positions count real tokens only), so a batched row computes what it would compute alone, up to float rounding.

Every request samples with its own settings (temperature, top-p, top-k, penalties) and its own random generator,
seeded from `seed` or, without one, from torch's global generator (so `transformers.set_seed` makes a run
reproducible). How a step runs is `decode`: "forward" calls the model's forward with a DynamicCache (any
transformers model); "static" and "compiled" run MiniNorm models through model/decode_step.py (a preallocated
per-row KV cache, no padding; "compiled" also compiles the step), which computes the same logits up to float
rounding, faster. `greedy_span` decodes a span of a sampled request greedily (chat and the server pass a tool
call's JSON). A request with `logprobs` set records, for each generated token, its log-probability under the
model's raw distribution at that step (log_softmax of the logits, before temperature, penalties, top-k and top-p:
what the model says, not what the sampler made of it) and that many of the most likely tokens; a step computes them
for the rows that ask only. One request's failure (a seed torch's generator rejects, sampling scores that turn NaN
or infinite) ends that request alone, with finish reason "error". Text is produced by `TextStream`: incremental
detokenization that never cuts a multi-byte character and holds back text that could still become a stop string.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Callable, Mapping, Sequence

import torch
from transformers import PreTrainedTokenizerBase
from transformers.cache_utils import DynamicCache
from transformers.generation.logits_process import (LogitsProcessor, RepetitionPenaltyLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from model.decode_step import DecodeStep, StaticKVCache, supports_decode_step
from dataset.shown_value import shown_value

FINISH_STOP = "stop"          # the end-of-turn token or a stop string
FINISH_LENGTH = "length"      # max_new_tokens, or the model's context was full
FINISH_CANCELLED = "cancelled"
FINISH_ERROR = "error"
# A request's error when its sampling scores became NaN or +inf (or left no token possible): numerically extreme
# settings or logits. Only that request ends; the message names no internals, so a server may show it.
NON_FINITE_SCORES = "the sampling scores became NaN or infinite (numerically extreme sampling settings or logits)"
DECODE_MODES = ("forward", "static", "compiled")  # GenerationEngine(decode=...): see the module's docstring


class SamplingError(ValueError):
    """One request's sampling cannot go on; the other requests of the batch are unaffected."""


@dataclass
class GenerationSettings:
    max_new_tokens: int = 256
    temperature: float = 0.7   # 0: greedy
    top_p: float = 0.9
    top_k: int = 0             # 0: off
    repetition_penalty: float = 1.0   # transformers' (CTRL's) multiplicative penalty on every seen token
    presence_penalty: float = 0.0     # OpenAI's: subtracted once from each token already generated
    frequency_penalty: float = 0.0    # OpenAI's: subtracted per occurrence in the generated tokens
    # OpenAI's logit_bias: {token id: value} added to the token's logit at every step, before the penalties' and
    # the sampler's turn (-100 bans a token in practice, 100 all but forces it); log-probabilities stay the model's
    logit_bias: Mapping[int, float] | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()        # stop strings: the text ends before the first one
    # (open, close) token ids of a span decoded greedily whatever the temperature: from `open` through `close` the
    # row takes its top token (after the penalties) instead of drawing one -- a tool call's JSON, which a draw can
    # corrupt and which has one right spelling. A prompt that ends inside the span starts there.
    greedy_span: tuple[int, int] | None = None
    # None: no log-probabilities; n: each generated token's log-probability and the n most likely tokens of the step
    # (Generation.logprobs)
    logprobs: int | None = None
    # Called with the ids generated so far and their text (control tokens skipped) after each token whose text came
    # out: True ends the generation there (FINISH_STOP), as a stop string does. For stop strings that only part of
    # the text may hold (a chat reply's content, not its thoughts or calls), which the text-only `stop` cannot tell.
    stop_when: Callable[[list[int], str], bool] | None = None

    def processors(self) -> list[LogitsProcessor]:
        """transformers' processors for these settings, in generate()'s order (penalty, temperature, top-k,
        top-p); empty for greedy decoding except the repetition penalty. A plain list, applied one by one:
        LogitsProcessorList would inspect each one's signature on every call (6% of a sampled batch's step)."""
        processors: list[LogitsProcessor] = []
        if self.repetition_penalty != 1.0:
            processors.append(RepetitionPenaltyLogitsProcessor(self.repetition_penalty))
        if self.temperature > 0:
            if self.temperature != 1.0:
                processors.append(TemperatureLogitsWarper(self.temperature))
            if self.top_k > 0:
                processors.append(TopKLogitsWarper(self.top_k))
            if self.top_p < 1.0:
                processors.append(TopPLogitsWarper(self.top_p))
        return processors


# The ids already shown that TextStream decodes again before new ones: one is enough for the decoders we know (a
# SentencePiece word mark's space stripped at the start of the input); a few more cost next to nothing.
STREAM_CONTEXT_IDS = 4


class TextStream:
    """Token ids in, text out, piece by piece.

    Each push decodes the ids not yet shown, after a few shown ones whose own text is then taken off (a
    SentencePiece-style decoder strips the first space of what it decodes: the word mark of an imported Llama's
    tokenizer was lost at every piece, running the words together); while that text ends in an incomplete UTF-8
    sequence (a character split across tokens decodes to U+FFFD) nothing is shown. Text that could be the start of
    a stop string is held back until it cannot; once a stop string appears, the text ends right before it and
    `stopped` is set. Special tokens are not shown. The pieces add up to exactly `text`.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.ids: list[int] = []
        self._decoded_upto = 0  # ids[:_decoded_upto] are part of _decoded
        self._decoded = ""      # text of the complete characters decoded so far
        self.text = ""          # the text handed out so far
        self.stopped = False

    def push(self, token_id: int) -> str:
        """The new text that `token_id` makes safe to show ("" when none)."""
        if self.stopped:
            return ""
        self.ids.append(token_id)
        tail = self._undecoded_text()
        if tail.endswith("\ufffd"):
            return ""
        self._decoded += tail
        self._decoded_upto = len(self.ids)
        return self._release(final=False)

    def finish(self) -> str:
        """The text still held back, at the end of generation."""
        if not self.stopped and self._decoded_upto < len(self.ids):
            self._decoded += self._undecoded_text()
            self._decoded_upto = len(self.ids)
        return self._release(final=True)

    def _undecoded_text(self) -> str:
        """The text ids[_decoded_upto:] add to the decoded text: decoded after up to STREAM_CONTEXT_IDS decoded ids,
        whose text is taken off, so that what a decoder does at the start of its input (strip a space) happens to
        the context, as decoding every id at once does it to the first. A context that begins inside a character
        (U+FFFD first) begins earlier: a SentencePiece decoder replaces a whole run of byte-fallback tokens that is
        not UTF-8, the new character's bytes with it. Should the context's text not be the start of the longer one
        (a stray byte after a shown character turns their whole byte run into U+FFFDs: shown text that cannot be
        taken back), the new ids are decoded alone: they begin with byte tokens then, whose text no decoder strips,
        and every character they add is shown once (the whole decode, cut at the shown text's length, would be off
        by the characters the run lost)."""
        decode = partial(self.tokenizer.decode, skip_special_tokens=True)
        start = max(0, self._decoded_upto - STREAM_CONTEXT_IDS)
        context = decode(self.ids[start:self._decoded_upto])
        while start > 0 and context.startswith("\ufffd"):
            start -= 1
            context = decode(self.ids[start:self._decoded_upto])
        text = decode(self.ids[start:])
        if text.startswith(context):
            return text[len(context):]
        return decode(self.ids[self._decoded_upto:])

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        end = len(self._decoded)
        hits = [i for i in (self._decoded.find(s, max(0, len(self.text) - len(s) + 1)) for s in self.stop) if i >= 0]
        if hits:
            end = min(hits)
            self.stopped = True
        elif not final:
            for stop in self.stop:  # hold back a suffix that a stop string starts with
                for size in range(min(len(stop) - 1, end - len(self.text)), 0, -1):
                    if self._decoded.endswith(stop[:size]):
                        end = min(end, len(self._decoded) - size)
                        break
        piece = self._decoded[len(self.text):end]
        self.text += piece
        return piece


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model's raw distribution at its step (log_softmax of the
    logits), and the most likely tokens of that distribution, (id, log-probability), most likely first."""
    logprob: float
    top: tuple[tuple[int, float], ...]


class _StepLogprobs:
    """One step's log-probabilities for the rows of the batch that record them, from the step's raw logits: a
    log_softmax and a top-k for those rows only, and one host copy of the top-k."""

    def __init__(self, logits: torch.Tensor, rows: list[int], counts: list[int]) -> None:
        self.logprobs = torch.log_softmax(logits[rows].float(), dim=-1)
        self.index = {row: i for i, row in enumerate(rows)}
        values, ids = self.logprobs.topk(max(counts), dim=-1)
        self.top = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]

    @classmethod
    def of(cls, logits: torch.Tensor, rows: Sequence[_Row]) -> _StepLogprobs | None:
        """For the rows (in batch order) of `logits` (rows, vocab) that record log-probabilities; None when none do."""
        wanted = [(index, row.logprobs) for index, row in enumerate(rows) if row.logprobs is not None]
        if not wanted:
            return None
        return cls(logits, [index for index, _ in wanted], [count for _, count in wanted])

    def record(self, chosen: Sequence[tuple[int, Generation, int]]) -> None:
        """Add each (batch row, generation, token)'s entry to the generation's log-probabilities: the chosen
        tokens' values come to the host in one copy, not one per row."""
        if not chosen:
            return
        rows = [self.index[row] for row, _, _ in chosen]
        values = self.logprobs[rows, [token for _, _, token in chosen]].tolist()
        for i, (_, generation, _), value in zip(rows, chosen, values):
            generation.logprobs.append(TokenLogprob(value, tuple(self.top[i][:generation.settings.logprobs])))


@dataclass
class Generation:
    """One request: its prompt and settings in, tokens and text out. Thread-safe to wait on and to cancel."""

    prompt_ids: list[int]
    settings: GenerationSettings
    on_text: Callable[[str], None] | None = None       # each new piece of text (called on the engine's thread)
    on_finish: Callable[["Generation"], None] | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token id when settings.logprobs is set
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    failure: Exception | None = None  # what `error` says, for a caller that tells kinds apart (an allocation failure)
    submitted_at: float = field(default_factory=time.perf_counter)
    started_at: float | None = None   # when its prefill began
    finished_at: float | None = None

    def __post_init__(self) -> None:
        self._done = threading.Event()
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        """Stop at the next step (a request nobody waits for any more frees its batch slot)."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    @property
    def seconds(self) -> float:
        """From the start of its prefill to its last token."""
        if self.started_at is None or self.finished_at is None:
            return 0.0
        return self.finished_at - self.started_at


def _ends_inside(ids: Sequence[int], open_id: int, close_id: int) -> bool:
    """Whether `ids` end inside an open...close span: an `open` after the last `close`."""
    for token in reversed(ids):
        if token in (open_id, close_id):
            return token == open_id
    return False


def check_logit_bias(logit_bias: Mapping[int, float], vocab_size: int) -> None:
    """A SamplingError (one line) when a logit_bias names a token outside the vocabulary or a value that is not a
    finite number."""
    for token, value in logit_bias.items():
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            raise SamplingError(f"logit_bias names token {shown_value(token)}; token ids are 0 to {vocab_size - 1}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise SamplingError(f"logit_bias of token {token} is {shown_value(value)}, not a finite number")


def logit_bias_row(settings: GenerationSettings, vocab_size: int, device: torch.device) -> torch.Tensor:
    """A row's logit_bias as one value per token of the vocabulary (0 where it names none); check_logit_bias's
    error when it cannot be one."""
    check_logit_bias(settings.logit_bias or {}, vocab_size)
    row = torch.zeros(vocab_size, device=device)
    if settings.logit_bias:  # the ids and values on the row's device: CUDA refuses a CPU tensor of values
        row[torch.tensor(list(settings.logit_bias), dtype=torch.long, device=device)] = torch.tensor(
            list(settings.logit_bias.values()), dtype=row.dtype, device=device)
    return row


class _Penalties:
    """OpenAI's presence and frequency penalties and logit_bias of a batch's rows: each row's uses of each token in
    its completion so far and the amount taken off the token's logit (frequency_penalty x uses, plus
    presence_penalty once used, less the token's bias), kept up to date as tokens are chosen so that a decode step
    pays one subtraction for the whole batch. A row without either has weights 0 and bias 0, and so amounts 0."""

    def __init__(self, rows: int, vocab_size: int, device: torch.device) -> None:
        self.counts = torch.zeros((rows, vocab_size), device=device)
        self.amounts = torch.zeros((rows, vocab_size), device=device)
        self.bias = torch.zeros((rows, vocab_size), device=device)
        self.weights = torch.zeros((rows, 2), device=device)  # per row: frequency_penalty, presence_penalty

    def add_row(self, settings: GenerationSettings, token: int) -> None:
        """A row joining the batch, with the first token of its completion."""
        weights = self.weights.new_tensor([[settings.frequency_penalty, settings.presence_penalty]])
        bias = logit_bias_row(settings, self.bias.shape[1], self.bias.device)[None]
        self.weights = torch.cat([self.weights, weights])
        self.counts = torch.cat([self.counts, self.counts.new_zeros((1, self.counts.shape[1]))])
        self.bias = torch.cat([self.bias, bias])
        self.amounts = torch.cat([self.amounts, -bias])
        self._count(torch.tensor([len(self.weights) - 1]), torch.tensor([token]))

    def record(self, tokens: Sequence[int]) -> None:
        """Every row's next token, in the batch's order."""
        self._count(torch.arange(len(tokens)), torch.tensor(tokens))

    def _count(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        rows, tokens = rows.to(self.counts.device), tokens.to(self.counts.device)
        self.counts[rows, tokens] += 1
        self.amounts[rows, tokens] = (self.weights[rows, 0] * self.counts[rows, tokens] + self.weights[rows, 1]
                                      - self.bias[rows, tokens])

    def select(self, index: torch.Tensor) -> None:
        self.counts, self.amounts, self.weights = self.counts[index], self.amounts[index], self.weights[index]
        self.bias = self.bias[index]

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The batch's logits (B, vocab), less each row's penalties, plus its logit_bias."""
        return logits - self.amounts


class _Row:
    """A generation in the running batch: its sampler state and its text."""

    def __init__(self, generation: Generation, tokenizer: PreTrainedTokenizerBase, device: torch.device) -> None:
        self.generation = generation
        settings = generation.settings
        self.processors = settings.processors()
        self.seen = torch.tensor([generation.prompt_ids], dtype=torch.long, device=device)  # for the penalty
        self.track_seen = settings.repetition_penalty != 1.0
        # OpenAI's penalties and logit_bias are applied to the whole batch's logits at once, from counts the engine
        # keeps beside the KV cache (_Penalties); a row only says whether it has them. Its first token, drawn at the
        # prefill, has no penalty to pay yet, but its bias.
        self.penalised = bool(settings.presence_penalty or settings.frequency_penalty or settings.logit_bias)
        seed = settings.seed if settings.seed is not None else int(torch.randint(2**62, ()).item())
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.text = TextStream(tokenizer, settings.stop)
        self.position = len(generation.prompt_ids)  # position id of the next input token
        span = settings.greedy_span
        self.in_greedy_span = span is not None and _ends_inside(generation.prompt_ids, *span)
        # inside the span, a greedy row's processors: the repetition penalty alone
        self.span_processors = replace(settings, temperature=0.0).processors() if span is not None else []
        # Greedy without a transformers processor (OpenAI's penalties allowed): the token is the argmax of the
        # (penalised) scores, which the engine takes for all such rows of a batch at once (greedy_token) instead of
        # row by row through sample().
        self.greedy = settings.temperature <= 0 and not self.processors
        self.logprobs = settings.logprobs  # None: this row records none

    def first_scores(self, logits: torch.Tensor) -> torch.Tensor:
        """The scores of the first token (float32, shape [vocab]): the prefill's logits plus the row's logit_bias."""
        settings = self.generation.settings
        return logits + logit_bias_row(settings, logits.shape[-1], logits.device) if settings.logit_bias else logits

    def sample(self, scores: torch.Tensor) -> int:
        """The next token from one row's scores (float32, shape [vocab]): its logits, less OpenAI's penalties, plus
        its logit_bias."""
        scores = scores[None]
        for processor in self.span_processors if self.in_greedy_span else self.processors:
            scores = processor(self.seen, scores)
        # -inf is a filtered-out token; NaN or +inf anywhere, or -inf everywhere, would fail (or corrupt) the draw
        # below: all three, and nothing else, make the maximum non-finite (max propagates NaN).
        if not math.isfinite(scores.max().item()):
            raise SamplingError(NON_FINITE_SCORES)
        settings = self.generation.settings
        if settings.temperature <= 0 or self.in_greedy_span:
            token = int(scores.argmax(-1).item())
        else:
            probs = torch.softmax(scores, dim=-1)
            token = int(torch.multinomial(probs[0], 1, generator=self.generator).item())
        if self.track_seen:
            self.seen = torch.cat([self.seen, self.seen.new_tensor([[token]])], dim=1)
        if settings.greedy_span is not None and token in settings.greedy_span:
            self.in_greedy_span = token == settings.greedy_span[0]
        return token

    @staticmethod
    def greedy_token(argmax: int, maximum: float) -> int:
        """A greedy row's next token, given its scores' argmax and maximum: what sample() returns."""
        if not math.isfinite(maximum):
            raise SamplingError(NON_FINITE_SCORES)
        return argmax


def default_eos_token_ids(model: Any, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """The tokens a generation stops at unless told others: the tokenizer's eos and those the model's generation
    config names (one id or a list)."""
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = {tokenizer.eos_token_id, *(configured if isinstance(configured, list) else [configured])}
    return frozenset(int(i) for i in ids if i is not None)


class GenerationEngine:
    """Continuous batching over one causal LM (ours or any transformers model that takes position_ids, a padding
    attention_mask and a DynamicCache). Use `generate()` from one thread, or `start()` the engine's own thread and
    `submit()` from many. `decode` (DECODE_MODES) picks how a step runs; "static" and "compiled" fall back to
    "forward" for a model that is not MiniNorm's."""

    def __init__(self, model: Any, tokenizer: PreTrainedTokenizerBase, max_batch: int = 8,
                 eos_token_ids: Sequence[int] | None = None, decode: str = "forward") -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        if decode not in DECODE_MODES:
            raise ValueError(f"decode={shown_value(decode)} is not allowed; choose one of "
                             f"{', '.join(map(repr, DECODE_MODES))}")
        self._step = (DecodeStep(model, compiled=decode == "compiled")
                      if decode != "forward" and supports_decode_step(model) else None)
        self.model, self.tokenizer, self.max_batch = model, tokenizer, max_batch
        self.eos_token_ids = frozenset(int(i) for i in (default_eos_token_ids(model, tokenizer)
                                                         if eos_token_ids is None else eos_token_ids) if i is not None)
        if not self.eos_token_ids:
            raise ValueError("no eos token: generation could not stop")
        self.max_context = getattr(model.config, "max_position_embeddings", None) or 2048
        if self.max_context < 2:  # a prompt of 1 token and 1 new one: less cannot generate
            raise ValueError(f"the model's context (max_position_embeddings) is {shown_value(self.max_context)}; "
                             f"generating needs at least 2 positions (a prompt token and a new one)")
        self.device = next(model.parameters()).device
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self._pending: collections.deque[Generation] = collections.deque()
        self._lock = threading.Condition()
        self._rows: list[_Row] = []
        self._cache: DynamicCache | StaticKVCache | None = None
        self._mask: torch.Tensor | None = None       # [B, L] 1 where the cache holds a real token ("forward" only)
        self._next: torch.Tensor | None = None       # [B] the token each row feeds next
        self._penalties: _Penalties | None = None  # None while no row of the batch has OpenAI's penalties
        self._thread: threading.Thread | None = None
        self._closing = False
        self.steps = 0             # decode steps run (for monitoring and measurements)
        self.batched_rows = 0      # sum of the batch sizes of those steps
        self.generated_tokens = 0  # every token sampled, for every request

    # ------------------------------------------------------------------------------------------- requests
    def submit(self, prompt_ids: Sequence[int], settings: GenerationSettings,
               on_text: Callable[[str], None] | None = None,
               on_finish: Callable[[Generation], None] | None = None) -> Generation:
        """Queue a request. The caller checks that the prompt fits: 1 <= len(prompt_ids) < the model's context."""
        if not 0 < len(prompt_ids) < self.max_context:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens; it must have 1 to {self.max_context - 1}")
        if settings.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {settings.max_new_tokens}")
        if settings.logprobs is not None and not 0 <= settings.logprobs <= self.vocab_size:
            raise ValueError(f"logprobs must be None or 0 to {self.vocab_size} (the vocabulary), got "
                             f"{settings.logprobs}")
        generation = Generation(list(prompt_ids), settings, on_text, on_finish)
        with self._lock:
            if self._closing:
                raise RuntimeError("the generation engine is closed")
            self._pending.append(generation)
            self._lock.notify()
        return generation

    def generate(self, prompt_ids: Sequence[int], settings: GenerationSettings,
                 on_text: Callable[[str], None] | None = None) -> Generation:
        """Run one request to its end: on the engine's thread when it runs, else on this one."""
        generation = self.submit(prompt_ids, settings, on_text)
        if self._thread is not None:
            generation.wait()
            return generation
        try:
            while not generation.done:
                self.step()
        except BaseException:  # Ctrl-C in a chat: drop the request, keep the engine usable
            generation.cancel()
            while not generation.done:
                self.step()
            raise
        return generation

    def start(self) -> None:
        """Run requests on a thread of the engine's own, until close()."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="generation-engine", daemon=True)
            self._thread.start()

    def close(self) -> None:
        with self._lock:
            self._closing = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    @property
    def load(self) -> tuple[int, int]:
        """(requests in the batch, requests waiting)."""
        with self._lock:
            return len(self._rows), len(self._pending)

    def _serve(self) -> None:
        while True:
            with self._lock:
                while not self._closing and not self._pending and not self._rows:
                    self._lock.wait()
                if self._closing:
                    pending, self._pending = list(self._pending), collections.deque()
                    break
            self.step()
        for generation in pending:
            self._finish(generation, FINISH_CANCELLED)
        for row in self._rows:
            self._finish(row.generation, FINISH_CANCELLED, row)
        self._clear()

    # ------------------------------------------------------------------------------------------- the loop
    def step(self) -> None:
        """Admit waiting requests up to max_batch, then one decode step for the batch."""
        try:
            with torch.inference_mode():
                self._drop(lambda row: row.generation.cancelled, FINISH_CANCELLED)
                self._admit()
                if self._rows:
                    self._decode()
        except Exception as error:  # a failed step fails its requests, never the engine
            message = f"{type(error).__name__}: {error}"
            for row in self._rows:
                row.generation.error, row.generation.failure = message, error
                self._finish(row.generation, FINISH_ERROR, row)
            self._clear()

    def _admit(self) -> None:
        while len(self._rows) < self.max_batch:
            with self._lock:
                if not self._pending:
                    return
                generation = self._pending.popleft()
            if generation.cancelled:
                self._finish(generation, FINISH_CANCELLED)
                continue
            generation.started_at = time.perf_counter()
            row = None
            try:  # everything of one request, its sampler state included: its error is its own
                row = _Row(generation, self.tokenizer, self.device)
                cache = DynamicCache(config=self.model.config)
                ids = torch.tensor([generation.prompt_ids], dtype=torch.long, device=self.device)
                out = self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
                token = row.sample(row.first_scores(out.logits[0, -1].float()))
                if (logprobs := _StepLogprobs.of(out.logits[:, -1], [row])) is not None:
                    logprobs.record([(0, generation, token)])
            except Exception as error:  # this request fails; the batch goes on
                self._fail(generation, error, row)
                continue
            if self._accept(row, token):
                try:
                    self._join(row, out.past_key_values, token)
                except Exception as error:  # the batch's state is suspect: step() fails and resets it
                    self._fail(generation, error, row)
                    raise

    def _forward(self) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """One step of the batch: the next-token logits (B, vocab), fp32, and their (argmax, max) per row when the
        step computed them."""
        if self._step is not None:
            cache = self._cache
            last = max(row.position for row in self._rows)
            cache.reserve(last + 2)  # a spare column: length == capacity would be a new case for the compiled step
            cache.length = last + 1
            logits, argmax, maximum = self._step(self._next, cache)
            return logits, (argmax, maximum)
        ones = self._mask.new_ones((len(self._rows), 1))
        mask = torch.cat([self._mask, ones], dim=1)
        positions = torch.tensor([[row.position] for row in self._rows], dtype=torch.long, device=self.device)
        out = self.model(input_ids=self._next[:, None], attention_mask=mask, position_ids=positions,
                         past_key_values=self._cache, use_cache=True)
        self._cache, self._mask = out.past_key_values, mask
        return out.logits[:, -1].float(), None

    def _decode(self) -> None:
        batch = len(self._rows)
        scores, best = self._forward()
        self.steps += 1
        self.batched_rows += batch
        logprobs = _StepLogprobs.of(scores, self._rows)  # before the penalties: the model's own distribution
        if self._penalties is not None:
            scores, best = self._penalties.apply(scores), None
        greedy = None
        if any(row.greedy for row in self._rows):  # one argmax and one max for the batch, two syncs in all
            argmax, maximum = best if best is not None else (scores.argmax(-1), scores.amax(-1))
            greedy = list(zip(argmax.tolist(), maximum.tolist()))
        sampled = []
        for index, row in enumerate(self._rows):
            row.position += 1
            try:
                token = row.greedy_token(*greedy[index]) if row.greedy else row.sample(scores[index])
            except Exception as error:  # this row's sampling failed (e.g. NaN scores): it ends, the others go on
                self._fail(row.generation, error, row)
                continue
            sampled.append((index, row, token))
        if logprobs is not None:  # before _accept, whose callbacks may read them
            logprobs.record([(index, row.generation, token) for index, row, token in sampled
                             if row.logprobs is not None])
        keep, tokens = [], [0] * batch  # a failed row's 0 is never read: the row leaves the batch
        for index, row, token in sampled:
            tokens[index] = token
            if self._accept(row, token):
                self._next[index] = token
                keep.append(index)
        if self._penalties is not None:
            self._penalties.record(tokens)
        if self._step is not None:
            self._cache.positions += 1
        if len(keep) < batch:
            self._select(keep)

    def _accept(self, row: _Row, token: int) -> bool:
        """Record a sampled token; False (and the generation finished) when it ends the row."""
        generation = row.generation
        generation.token_ids.append(token)
        self.generated_tokens += 1
        if token in self.eos_token_ids:
            self._finish(generation, FINISH_STOP, row)
            return False
        piece = row.text.push(token)
        self._notify(generation, generation.on_text, piece)
        if row.text.stopped or (piece and generation.settings.stop_when is not None
                                and generation.settings.stop_when(generation.token_ids, row.text.text)):
            self._finish(generation, FINISH_STOP, row)
        elif len(generation.token_ids) >= generation.settings.max_new_tokens or row.position + 1 >= self.max_context:
            self._finish(generation, FINISH_LENGTH, row)
        elif generation.cancelled:
            self._finish(generation, FINISH_CANCELLED, row)
        else:
            return True
        return False

    def _fail(self, generation: Generation, error: Exception, row: _Row | None) -> None:
        """End one request with FINISH_ERROR; a SamplingError's message is the request's, others name the
        exception."""
        generation.error = str(error) if isinstance(error, SamplingError) else f"{type(error).__name__}: {error}"
        generation.failure = error
        self._finish(generation, FINISH_ERROR, row)

    def _finish(self, generation: Generation, reason: str, row: _Row | None = None) -> None:
        if row is not None:
            piece = row.text.finish()
            if reason != FINISH_ERROR:
                self._notify(generation, generation.on_text, piece)
            generation.text = row.text.text
        generation.finish_reason = reason
        generation.finished_at = time.perf_counter()
        generation._done.set()
        self._notify(generation, generation.on_finish, generation)

    @staticmethod
    def _notify(generation: Generation, callback: Callable[[Any], None] | None, value: Any) -> None:
        """Call a request's callback; one that fails cancels its own request and nothing else."""
        if callback is None or value == "":
            return
        try:
            callback(value)
        except Exception:
            generation.cancel()

    # ------------------------------------------------------------------------------------------- the KV cache
    @staticmethod
    def _layers(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(layer.keys, layer.values) for layer in cache.layers]

    def _rebuild(self, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
        cache = DynamicCache(config=self.model.config)
        for index, (keys, values) in enumerate(layers):
            cache.update(keys, values, index)
        return cache

    def _join(self, row: _Row, cache: DynamicCache, token: int) -> None:
        """Add a prefilled row to the batch: into the static cache as it is ("static", "compiled"), or left-padding
        its cache or the batch's to a common length ("forward"); its first token counted for the penalties."""
        if row.penalised and self._penalties is None:
            self._penalties = _Penalties(len(self._rows), self.vocab_size, self.device)
        if self._penalties is not None:
            self._penalties.add_row(row.generation.settings, token)
        next_token = torch.tensor([token], dtype=torch.long, device=self.device)
        if self._step is not None:
            layers = self._layers(cache)
            if not self._rows:
                self._cache = StaticKVCache(self.model.config, 0, 0, layers[0][0].dtype, self.device)
                self._next = next_token[:0]
            self._cache.append_row(layers)
            self._cache.positions[-1] = row.position
            self._next = torch.cat([self._next, next_token])
            self._rows.append(row)
            return
        new_len = len(row.generation.prompt_ids)
        new_mask = torch.ones((1, new_len), dtype=torch.long, device=self.device)
        if not self._rows:
            self._rows, self._cache, self._mask, self._next = [row], cache, new_mask, next_token
            return
        old_len = self._mask.shape[1]
        width = max(old_len, new_len)

        def left_pad(tensor: torch.Tensor, length: int) -> torch.Tensor:  # pads dim -2 (the sequence)
            if length == width:
                return tensor
            shape = list(tensor.shape)
            shape[-2] = width - length
            return torch.cat([tensor.new_zeros(shape), tensor], dim=-2)

        layers = [(torch.cat([left_pad(k, old_len), left_pad(nk, new_len)]),
                   torch.cat([left_pad(v, old_len), left_pad(nv, new_len)]))
                  for (k, v), (nk, nv) in zip(self._layers(self._cache), self._layers(cache))]
        self._cache = self._rebuild(layers)
        self._mask = torch.cat([torch.nn.functional.pad(self._mask, (width - old_len, 0)),
                                torch.nn.functional.pad(new_mask, (width - new_len, 0))])
        self._next = torch.cat([self._next, next_token])
        self._rows.append(row)

    def _select(self, keep: list[int]) -> None:
        """Keep these rows of the batch, and drop the columns that are padding in every remaining row."""
        self._rows = [self._rows[i] for i in keep]
        if not keep:
            self._clear()
            return
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        if self._penalties is not None:
            self._penalties.select(index)
            if not any(row.penalised for row in self._rows):
                self._penalties = None
        if self._step is not None:
            self._cache.select_rows(keep)
            self._next = self._next[index]
            return
        mask = self._mask[index]
        first = int(mask.any(dim=0).nonzero()[0].item())  # the first column some row still uses
        self._mask, self._next = mask[:, first:], self._next[index]
        self._cache = self._rebuild([(k[index, :, first:], v[index, :, first:]) for k, v in self._layers(self._cache)])

    def _clear(self) -> None:
        """An empty batch."""
        self._rows, self._cache, self._mask, self._next, self._penalties = [], None, None, None, None

    def _drop(self, condition: Callable[[_Row], bool], reason: str) -> None:
        keep = [i for i, row in enumerate(self._rows) if not condition(row)]
        if len(keep) == len(self._rows):
            return
        for i, row in enumerate(self._rows):
            if i not in keep:
                self._finish(row.generation, reason, row)
        self._select(keep)
