"""The FastAPI application around one served model: the API key, the routes of the OpenAI API, the built-in tools
for clients' tool loops (/tools), /health and the chat page (scripts/web/)."""

# No `from __future__ import annotations` here: FastAPI reads the endpoints' annotations (Request) at run time.
import asyncio
import secrets
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import FileResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.requests import ClientDisconnect

from model.generation import GenerationSettings
from dataset.shown_value import shown_value
from scripts.server.builtin_tools import (RUN_REQUEST_BODY, OfferedTools, offered_tools, parse_run_request,
                                          run_call)
from scripts.server.completion import Completion, generation_settings, prompt_ids
from scripts.server.errors import APIError, add_error_handlers
from scripts.server.protocol import (ChatRequest, CompletionId, completion_body, model_card, model_list,
                                     parse_chat_request, request_schemas)
from scripts.server.replies import ReplyReader
from scripts.server.served_model import ServedModel
from scripts.server.streaming import streaming_response

WEB_DIR = Path(__file__).resolve().parents[1] / "web"
MAX_BODY_BYTES = 1 << 20
OPENAPI_URL = "/openapi.json"
# The route reads its body itself (to bound its size and answer in OpenAI's error shape); the document still
# describes it with the request model that validates it.
_CHAT_REQUEST_BODY = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": {"$ref": "#/components/schemas/ChatRequest"}}}}}


def authorize(request: Request, api_key: str | None) -> None:
    """Nothing without an API key; else an APIError (401) unless the request carries it (compared in constant
    time)."""
    if api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
        raise APIError(401, "a valid API key is needed: send the header 'Authorization: Bearer KEY'",
                       code="invalid_api_key")


def check_json_content_type(request: Request) -> None:
    """An APIError (415) unless the body is declared JSON (application/json or application/*+json) or not declared
    at all. A form or another site's page can send text/plain or a form type without the browser asking first (a
    CORS "simple request"), so reading those as JSON would let any page a user visits drive this server; FastAPI
    refuses them for its own JSON bodies in the same way."""
    declared = request.headers.get("content-type")
    if declared is None:
        return
    media_type = declared.partition(";")[0].strip().lower()
    kind, _, subtype = media_type.partition("/")
    if kind != "application" or not (subtype == "json" or subtype.endswith("+json")):
        raise APIError(415, f"Content-Type must be application/json, got {shown_value(declared)}",
                       code="unsupported_media_type")


async def read_body(request: Request, limit: int) -> bytes:
    """The request's JSON body; an APIError: 415 when it is declared as another type, 413 as soon as it is known to
    be over `limit` bytes (read no further), 499 (read by nobody) when the client hangs up before its end."""
    check_json_content_type(request)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body is {int(declared)} bytes; the limit is {limit}", code="too_large")
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise APIError(413, f"the request body is over the limit of {limit} bytes", code="too_large")
    except ClientDisconnect:  # not the server's error: no 500, no traceback in its log
        raise APIError(499, "the client closed the connection before its body ended") from None
    return bytes(body)


def refuse_when_busy(served: ServedModel, max_waiting: int) -> None:
    if served.engine.load[1] >= max_waiting:
        raise APIError(503, f"the server is busy ({max_waiting} requests waiting); try again shortly",
                       kind="server_error", code="overloaded")


async def whole_answer(request: Request, completion: Completion,
                       completion_id: CompletionId) -> Response | dict[str, Any]:
    """The completion in one body once it ends; 499 (read by nobody) when the client hangs up first, which gives
    the engine's slot back."""
    gone = asyncio.ensure_future(request.receive())  # the body is read: the next message is a disconnect
    done = asyncio.ensure_future(completion.until_done())
    try:
        await asyncio.wait({gone, done}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        done.cancel()
        completion.cancel()  # a no-op once done
    if not completion.generation.done:
        return Response(status_code=499)
    completion.check_finished()
    return completion_body(completion_id, completion.message(), completion.finish_reason(), completion.usage(),
                           completion.logprobs())


def prepare_request(served: ServedModel, body: bytes
                    ) -> tuple[ChatRequest, list[int], ReplyReader | None, GenerationSettings]:
    """The request, its prompt's ids, the reply's reader and the generation settings; APIError on bad input."""
    chat = parse_chat_request(body)
    tools = chat.offered_tools()
    ids, reader = prompt_ids(chat, served, tools)
    return chat, ids, reader, generation_settings(chat, served, len(ids), tools, reader)


def engine_lifespan(served: ServedModel, preparing: ThreadPoolExecutor) -> Callable[[FastAPI], Any]:
    """The app's lifespan: the engine runs while the app does; at the end the preparing thread stops too."""
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        served.engine.start()
        yield
        served.engine.close()
        preparing.shutdown(wait=False, cancel_futures=True)
    return lifespan


def openapi_with_request_schemas(app: FastAPI) -> Callable[[], dict[str, Any]]:
    """app.openapi: FastAPI's document of the routes, with the chat request's schemas added (made once)."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version, routes=app.routes)
            document.setdefault("components", {}).setdefault("schemas", {}).update(request_schemas())
            app.openapi_schema = document
        return app.openapi_schema
    return openapi


def add_model_routes(app: FastAPI, served: ServedModel, api_key: str | None, counters: dict[str, int]) -> None:
    """/health (no key needed) and the model list and card of /v1/models."""
    def served_card() -> dict[str, Any]:
        return model_card(served.name, served.created, served.max_context)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        running, waiting = served.engine.load
        return {"status": "ok", "model": served.name, "running": running, "waiting": waiting,
                "max_batch": served.engine.max_batch, "requests": counters["requests"],
                "generated_tokens": served.engine.generated_tokens, "decode_steps": served.engine.steps,
                "batched_rows": served.engine.batched_rows}

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict[str, Any]:
        authorize(request, api_key)
        return model_list([served_card()])

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, request: Request) -> dict[str, Any]:
        authorize(request, api_key)
        if model_id != served.name:
            raise APIError(404, f"no model {shown_value(model_id)}; this server has {served.name!r}", param="model",
                           code="model_not_found")
        return served_card()


def add_chat_route(app: FastAPI, served: ServedModel, api_key: str | None, max_waiting: int, max_body_bytes: int,
                   preparing: ThreadPoolExecutor, counters: dict[str, int]) -> None:
    """/v1/chat/completions: the body read and prepared on `preparing`, then streamed or answered whole."""
    @app.post("/v1/chat/completions", openapi_extra=_CHAT_REQUEST_BODY)
    async def chat_completions(request: Request):  # no return annotation: FastAPI would take it for the schema
        authorize(request, api_key)
        body = await read_body(request, max_body_bytes)
        chat, ids, reader, settings = await asyncio.get_running_loop().run_in_executor(preparing, prepare_request,
                                                                                       served, body)
        refuse_when_busy(served, max_waiting)
        counters["requests"] += 1
        completion = Completion(served, ids, settings, reader)
        completion_id = CompletionId.new(served.name)
        if chat.stream:
            return streaming_response(completion, completion_id, chat.include_usage())
        return await whole_answer(request, completion, completion_id)


def add_tool_routes(app: FastAPI, offered: OfferedTools, api_key: str | None, max_body_bytes: int) -> None:
    """/tools (the offered tools) and /tools/run (one call of one of them)."""
    @app.get("/tools")
    async def list_tools(request: Request) -> dict[str, Any]:
        authorize(request, api_key)
        return offered.body()

    @app.post("/tools/run", openapi_extra=RUN_REQUEST_BODY)
    async def run_tool_call(request: Request) -> dict[str, Any]:
        authorize(request, api_key)
        name, arguments = parse_run_request(await read_body(request, max_body_bytes), offered)
        return await run_call(name, arguments)


def add_chat_page(app: FastAPI) -> None:
    """/ (the chat page) and /static (its files, scripts/web/)."""
    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(WEB_DIR / "index.html")

    app.mount("/static", StaticFiles(directory=WEB_DIR), name="static")


def create_app(served: ServedModel, api_key: str | None = None, max_waiting: int = 64,
               max_body_bytes: int = MAX_BODY_BYTES, tools: bool = True) -> FastAPI:
    """The FastAPI application around one loaded model and its running engine; `tools`: offer the built-in tools
    (when the model can use them: builtin_tools.offered_tools)."""
    counters = {"requests": 0}
    offered = offered_tools(served, tools)
    # Parsing a request and tokenizing its prompt take a second or two for a body near the size limit: on a thread
    # of their own, not the event loop's, whose other requests and streams would wait. One thread: requests are
    # prepared one at a time, in the order they came, as on the event loop before.
    preparing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prepare-request")
    app = FastAPI(title="MiniNorm", docs_url=None, redoc_url=None, openapi_url=OPENAPI_URL,
                  lifespan=engine_lifespan(served, preparing))
    add_error_handlers(app)
    app.openapi = openapi_with_request_schemas(app)
    add_model_routes(app, served, api_key, counters)
    add_chat_route(app, served, api_key, max_waiting, max_body_bytes, preparing, counters)
    add_tool_routes(app, offered, api_key, max_body_bytes)
    add_chat_page(app)
    return app
