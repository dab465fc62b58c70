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
    """The events of one completion; leaving early (the client went away) gives its slot back."""
    try:
        yield _chunk_event(chunk_body(completion_id, {"role": "assistant", "content": ""}, None, include_usage))
        deltas = DeltaStream(completion.reader) if completion.reader is not None else None
        async for piece, generated in completion.pieces():
            for delta in deltas.deltas(completion.generation.token_ids[:generated]) if deltas else [{"content": piece}]:
                yield _chunk_event(chunk_body(completion_id, delta, None, include_usage))
        try:
            completion.check_finished()
        except APIError as error:  # the status line is sent already: the error goes in the stream
            yield _event(json.dumps(error.body()))
            return
        for delta in deltas.deltas(completion.generation.token_ids, final=True) if deltas else []:
            yield _chunk_event(chunk_body(completion_id, delta, None, include_usage))
        yield _chunk_event(chunk_body(completion_id, {}, completion.finish_reason(), include_usage))
        if include_usage:
            yield _chunk_event(usage_chunk_body(completion_id, completion.usage()))
        yield _event("[DONE]")
    finally:
        completion.cancel()  # a no-op after the end


def streaming_response(completion: Completion, completion_id: CompletionId, include_usage: bool) -> StreamingResponse:
    return StreamingResponse(completion_events(completion, completion_id, include_usage),
                             media_type="text/event-stream", headers=_HEADERS)
