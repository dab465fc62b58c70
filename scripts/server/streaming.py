"""A completion streamed as server-sent events: the role, the reply piece by piece (reasoning_content, content
and tool_calls deltas, read from the generated ids), the finish reason, the usage when asked for, then [DONE]."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse

from scripts.server.completion import Completion
from scripts.server.errors import APIError
from scripts.server.protocol import CompletionId, chunk_body, usage_chunk_body
from scripts.server.replies import DeltaStream

_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no caching or buffering on the way


def _event(data: str) -> str:
    return f"data: {data}\n\n"


def _chunk_event(body: dict[str, Any]) -> str:
    return _event(json.dumps(body, ensure_ascii=False))


async def completion_events(completion: Completion, completion_id: CompletionId,
                            include_usage: bool) -> AsyncIterator[str]:
    """The events of one completion; leaving early (the client went away) gives its slot back. With logprobs, a
    chunk carries the entries of the tokens generated since the chunk before it that carried any: joined, they are
    the whole completion's, in order; text the stream holds back (a possible stop string, a character or a call not
    yet complete) arrives after its tokens' entries, and the closing token's entry comes with the last chunks."""
    sent = 0  # the tokens whose logprobs entries have been sent

    def chunk(delta: dict[str, Any], generated: int, finish_reason: str | None = None) -> str:
        nonlocal sent
        logprobs = completion.logprobs(sent, generated)
        sent = generated
        return _chunk_event(chunk_body(completion_id, delta, finish_reason, include_usage, logprobs))

    try:
        yield _chunk_event(chunk_body(completion_id, {"role": "assistant", "content": ""}, None, include_usage))
        deltas = DeltaStream(completion.reader) if completion.reader is not None else None
        async for piece, generated in completion.pieces():
            # The engine's list, uncopied: the stream reads the ids generated since the last piece, up to this one's.
            new = deltas.deltas(completion.generation.token_ids, end=generated) if deltas else [{"content": piece}]
            for delta in new:
                yield chunk(delta, generated)
        try:
            completion.check_finished()
        except APIError as error:  # the status line is sent already: the error goes in the stream
            yield _event(json.dumps(error.body()))
            return
        generated = len(completion.generation.token_ids)
        for delta in deltas.deltas(completion.generation.token_ids, final=True) if deltas else []:
            yield chunk(delta, generated)
        yield chunk({}, generated, completion.finish_reason())
        if include_usage:
            yield _chunk_event(usage_chunk_body(completion_id, completion.usage()))
        yield _event("[DONE]")
    finally:
        completion.cancel()  # a no-op after the end


def streaming_response(completion: Completion, completion_id: CompletionId, include_usage: bool) -> StreamingResponse:
    return StreamingResponse(completion_events(completion, completion_id, include_usage),
                             media_type="text/event-stream", headers=_HEADERS)
