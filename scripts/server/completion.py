"""One chat completion on the engine: the request in the engine's terms (prompt ids, generation settings), its
submission, and its text, its tokens' log-probabilities and its end as they arrive."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from dataset.chat_format import encode_chatml, tool_call_span
from dataset.tokenization import text_token_range, token_bytes
from model.chat_session import encode_prompt
from model.generation import FINISH_ERROR, NON_FINITE_SCORES, Generation, GenerationSettings, check_logit_bias
from scripts.server.errors import APIError
from scripts.server.protocol import ChatRequest, logprobs_body, token_logprob_body, usage_body
from scripts.server.replies import ReplyReader, forced_call_prefix
from scripts.server.served_model import ServedModel
from trainer.inference_flags import CHAT_FREQUENCY_PENALTY

MAX_STOP_STRINGS = 4
GENERATION_FAILED = "the generation failed; the server's log has the details"
logger = logging.getLogger(__name__)


def prompt_ids(request: ChatRequest, served: ServedModel,
               tools: list[dict[str, Any]]) -> tuple[list[int], ReplyReader | None]:
    """The prompt's token ids (`tools`, the request's offered_tools(), and its open_thinking rendered by the
    library's chat format, and the start of a call when tool_choice demands one) and the reader of the reply; an
    APIError when they leave no room in the context for an answer."""
    messages = request.prompt_messages()
    # Refused by the texts' lengths alone when they prove it too long, untokenized (text_token_range; a message of
    # the body's 1 MB took ~1 s to tokenize first): the template renders every message's content whole, a plain
    # continuation the last one after an eos.
    texts = [message["content"] for message in messages] if served.use_template else [messages[-1]["content"]]
    ranges = [text_token_range(served.tokenizer, text) for text in texts]
    fewest = None if None in ranges else sum(low for low, _ in ranges) + (not served.use_template)
    if fewest is not None and fewest >= served.max_context:
        raise APIError(400, f"the prompt is at least {fewest} tokens; the model's context is {served.max_context} "
                            f"tokens, for the prompt and the answer together", param="messages",
                       code="context_length_exceeded")
    forced = request.forced_tool()
    if served.use_template:
        # A demanded call starts right after the empty think block: the model does not think first.
        ids = encode_chatml(served.tokenizer, messages, add_generation_prompt=True, tools=tools,
                            open_thinking=request.open_thinking() and forced is None).input_ids
        prefix = forced_call_prefix(served.tokenizer, forced)
    else:
        if forced is not None:  # a plain continuation cannot be made to call: the demand was dropped silently
            raise APIError(400, "tool_choice: this server continues plain text (--mode plain, or a pretrained "
                                "model), which has no tool calls; use tool_choice 'auto' or 'none'",
                           param="tool_choice")
        ids, prefix = encode_prompt(served.tokenizer, messages, use_template=False), []
    ids = ids + prefix
    if len(ids) >= served.max_context:
        raise APIError(400, f"the prompt is {len(ids)} tokens; the model's context is {served.max_context} tokens, "
                            f"for the prompt and the answer together", param="messages",
                       code="context_length_exceeded")
    # A named tool_choice allows that tool only: a reply that names another (say by a key given twice) is no call.
    names = [forced] if forced else [t["function"]["name"] for t in tools]
    reader = ReplyReader(served.tokenizer, names, prefix, request.stop_strings(),
                         request.parallel_tool_calls is not False) if served.use_template else None
    return ids, reader


def generation_settings(request: ChatRequest, served: ServedModel, prompt_len: int, tools: list[dict[str, Any]],
                        reader: ReplyReader | None = None) -> GenerationSettings:
    """The request's sampling and limits; what it leaves out is eval/chat.py's default (the library's sampling,
    chat's frequency penalty, tool calls decoded greedily when `tools` are offered), and with no max_tokens the
    answer may fill the context. With the chat template's `reader`, the stop strings are its content's: the engine
    ends the reply at one there, not at one inside a thought or a call."""
    defaults = GenerationSettings()
    budget = served.max_context - prompt_len
    max_tokens = request.max_completion_tokens or request.max_tokens
    param = "max_completion_tokens" if request.max_completion_tokens else "max_tokens"
    if max_tokens is not None and max_tokens > budget:
        raise APIError(400, f"{param}={max_tokens} is beyond the model's context of {served.max_context} tokens: "
                            f"the prompt takes {prompt_len}, so at most {budget} can be generated",
                       param=param, code="context_length_exceeded")
    stop = request.stop_strings()
    if len(stop) > MAX_STOP_STRINGS or any(not s for s in stop):
        raise APIError(400, f"stop: up to {MAX_STOP_STRINGS} non-empty strings", param="stop")
    logit_bias = request.token_biases()
    try:
        check_logit_bias(logit_bias or {}, served.engine.vocab_size)  # the rows of the logits it biases
    except ValueError as error:
        raise APIError(400, str(error), param="logit_bias") from None
    return GenerationSettings(
        max_new_tokens=max_tokens or budget,
        temperature=defaults.temperature if request.temperature is None else request.temperature,
        top_p=defaults.top_p if request.top_p is None else request.top_p,
        top_k=defaults.top_k if request.top_k is None else request.top_k,
        repetition_penalty=request.repetition_penalty or defaults.repetition_penalty,
        presence_penalty=defaults.presence_penalty if request.presence_penalty is None else request.presence_penalty,
        frequency_penalty=(CHAT_FREQUENCY_PENALTY if request.frequency_penalty is None
                           else request.frequency_penalty),
        logit_bias=logit_bias,
        # With the chat template the reply's reader looks for the stop strings, in the content only
        seed=request.seed, stop=() if reader is not None else tuple(stop), logprobs=request.logprob_count(),
        stop_when=reader.content_stopped if reader is not None and reader.stop else None,
        greedy_span=tool_call_span(served.tokenizer) if served.use_template and tools else None)


class Completion:
    """A prompt submitted to the engine. The engine decodes on a thread of its own; its text pieces and its end
    come back to the event loop through a queue."""

    def __init__(self, served: ServedModel, ids: list[int], settings: GenerationSettings,
                 reader: ReplyReader | None = None) -> None:
        loop = asyncio.get_running_loop()
        self._events: asyncio.Queue = asyncio.Queue()

        def send(kind: str, value: Any) -> None:  # called on the engine's thread
            loop.call_soon_threadsafe(self._events.put_nowait, (kind, value))

        def text(piece: str) -> None:  # with the number of ids generated when the piece came out
            send("text", (piece, len(submitted[0].token_ids) if submitted else 0))

        submitted: list[Generation] = []
        self.prompt_tokens = len(ids)
        self.reader = reader  # None: plain continuation, the text is the reply
        self.tokenizer = served.tokenizer
        self.generation = served.engine.submit(ids, settings, on_text=text, on_finish=lambda done: send("done", done))
        submitted.append(self.generation)

    async def pieces(self) -> AsyncIterator[tuple[str, int]]:
        """The text as it is generated, each piece with the number of ids generated up to it, until the end."""
        while (event := await self._events.get())[0] == "text":
            yield event[1]

    async def until_done(self) -> None:
        while (await self._events.get())[0] != "done":
            pass

    def cancel(self) -> None:
        """Give the engine's slot back (a no-op once done)."""
        self.generation.cancel()

    def check_finished(self) -> None:
        """An APIError (500) when the generation failed: the library's own message when its scores turned
        non-finite, else a generic one (the exception, internal, goes to the log only)."""
        if self.generation.finish_reason == FINISH_ERROR:
            error = self.generation.error
            logger.error("a generation failed: %s", error)
            message = f"the generation failed: {error}" if error == NON_FINITE_SCORES else GENERATION_FAILED
            raise APIError(500, message, kind="server_error")

    def message(self) -> dict[str, Any]:
        """The finished reply's message fields (content, and reasoning_content and tool_calls where there are)."""
        if self.reader is None:
            return {"content": self.generation.text}
        return self.reader.message(self.generation.token_ids)

    def finish_reason(self) -> str | None:
        if self.reader is None:
            return self.generation.finish_reason
        return self.reader.finish_reason(self.generation.token_ids, self.generation.finish_reason)

    def logprobs(self, start: int = 0, end: int | None = None) -> dict[str, Any] | None:
        """The choice's "logprobs" for generated tokens [start, end) (all by default): one entry per token, in
        order -- every generated token, a thought's, a call's and the closing <|im_end|> included; None when the
        request did not ask for them, or the range is empty."""
        if self.generation.settings.logprobs is None:
            return None
        ids = self.generation.token_ids[start:end]
        records = self.generation.logprobs[start:start + len(ids)]
        if not ids:
            return None
        every = list(dict.fromkeys(ids + [top_id for record in records for top_id, _ in record.top]))
        data = dict(zip(every, token_bytes(self.tokenizer, every)))
        return logprobs_body([token_logprob_body(data[token], record.logprob,
                                                 [token_logprob_body(data[i], value) for i, value in record.top])
                              for token, record in zip(ids, records)])

    def usage(self) -> dict[str, int]:
        return usage_body(self.prompt_tokens, len(self.generation.token_ids))
