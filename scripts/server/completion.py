"""One chat completion on the engine: the request in the engine's terms (prompt ids, generation settings), its
submission, and its text and end as they arrive."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from model.chat_session import encode_prompt
from model.generation import FINISH_ERROR, NON_FINITE_SCORES, GenerationSettings
from scripts.server.errors import APIError
from scripts.server.protocol import ChatRequest, usage_body
from scripts.server.served_model import ServedModel

MAX_STOP_STRINGS = 4
GENERATION_FAILED = "the generation failed; the server's log has the details"
logger = logging.getLogger(__name__)


def prompt_ids(request: ChatRequest, served: ServedModel) -> list[int]:
    """The prompt's token ids; an APIError when they leave no room in the context for an answer."""
    ids = encode_prompt(served.tokenizer, request.prompt_messages(), served.use_template)
    if len(ids) >= served.max_context:
        raise APIError(400, f"the prompt is {len(ids)} tokens; the model's context is {served.max_context} tokens, "
                            f"for the prompt and the answer together", param="messages",
                       code="context_length_exceeded")
    return ids


def generation_settings(request: ChatRequest, served: ServedModel, prompt_len: int) -> GenerationSettings:
    """The request's sampling and limits; what it leaves out is the library's default (eval/chat.py's), and with
    no max_tokens the answer may fill the context."""
    defaults = GenerationSettings()
    budget = served.max_context - prompt_len
    max_tokens = request.max_completion_tokens or request.max_tokens
    param = "max_completion_tokens" if request.max_completion_tokens else "max_tokens"
    if max_tokens is not None and max_tokens > budget:
        raise APIError(400, f"{param}={max_tokens} is beyond the model's context of {served.max_context} tokens: "
                            f"the prompt takes {prompt_len}, so at most {budget} can be generated",
                       param=param, code="context_length_exceeded")
    if request.logprobs:
        raise APIError(400, "logprobs are not supported", param="logprobs")
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    if len(stop) > MAX_STOP_STRINGS or any(not s for s in stop):
        raise APIError(400, f"stop: up to {MAX_STOP_STRINGS} non-empty strings", param="stop")
    return GenerationSettings(
        max_new_tokens=max_tokens or budget,
        temperature=defaults.temperature if request.temperature is None else request.temperature,
        top_p=defaults.top_p if request.top_p is None else request.top_p,
        top_k=defaults.top_k if request.top_k is None else request.top_k,
        repetition_penalty=request.repetition_penalty or defaults.repetition_penalty,
        presence_penalty=defaults.presence_penalty if request.presence_penalty is None else request.presence_penalty,
        frequency_penalty=(defaults.frequency_penalty if request.frequency_penalty is None
                           else request.frequency_penalty),
        seed=request.seed, stop=tuple(stop))


class Completion:
    """A prompt submitted to the engine. The engine decodes on a thread of its own; its text pieces and its end
    come back to the event loop through a queue."""

    def __init__(self, served: ServedModel, ids: list[int], settings: GenerationSettings) -> None:
        loop = asyncio.get_running_loop()
        self._events: asyncio.Queue = asyncio.Queue()

        def send(kind: str, value: Any) -> None:  # called on the engine's thread
            loop.call_soon_threadsafe(self._events.put_nowait, (kind, value))

        self.prompt_tokens = len(ids)
        self.generation = served.engine.submit(ids, settings, on_text=lambda piece: send("text", piece),
                                               on_finish=lambda done: send("done", done))

    async def pieces(self) -> AsyncIterator[str]:
        """The text as it is generated, until the end."""
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

    def usage(self) -> dict[str, int]:
        return usage_body(self.prompt_tokens, len(self.generation.token_ids))
