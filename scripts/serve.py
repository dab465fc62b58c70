"""Serve a trained model: OpenAI's chat-completions API and a web chat page.

    python scripts/serve.py                                   # out/sft (else out/pretrain), http://127.0.0.1:8000
    python scripts/serve.py --model_path out/sft --port 8001 --api_key secret
    python scripts/serve.py --lora out/lora                   # out/sft with the LoRA adapter, merged at load

Endpoints: POST /v1/chat/completions (streamed as server-sent events when "stream": true), GET /v1/models,
GET /v1/models/{id}, GET /health, and the chat page at /. Requests run through the library's GenerationEngine
(model/generation.py): concurrent requests are decoded together in one batch (--max_batch), and a client that
disconnects gives its slot back at the next step. Bad requests get OpenAI-style JSON errors; messages are encoded
as text, so a control-token string inside one never becomes a control token.
"""

# No `from __future__ import annotations` here: FastAPI reads the endpoints' annotations (Request) at run time.
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script, from the repo root or from scripts/
    if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
        sys.path.pop(0)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import secrets  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from contextlib import asynccontextmanager  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Any, AsyncIterator, Literal  # noqa: E402

from trainer.run_dir import ModelNotFound, add_model_source_flags, locate_model_and_adapter, model_task, report_error  # noqa: E402

WEB_DIR = Path(__file__).resolve().parent / "web"
MAX_BODY_BYTES = 1 << 20
MAX_STOP_STRINGS = 4


# ----------------------------------------------------------------------------------------------- the request
def _request_models():
    """The request schema (pydantic, strict: "0.5" is not a number); built on first use, so --help stays fast."""
    from pydantic import BaseModel, ConfigDict, Field

    class TextPart(BaseModel):
        model_config = ConfigDict(strict=True)
        type: Literal["text"]
        text: str

    class Message(BaseModel):
        model_config = ConfigDict(strict=True)
        role: Literal["system", "developer", "user", "assistant"]
        content: str | list[TextPart]
        name: str | None = None

        def text(self) -> str:
            return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    class StreamOptions(BaseModel):
        model_config = ConfigDict(strict=True)
        include_usage: bool = False

    class ChatRequest(BaseModel):
        model_config = ConfigDict(strict=True)
        model: str | None = None
        messages: list[Message] = Field(min_length=1)
        temperature: float | None = Field(None, ge=0, le=2)
        top_p: float | None = Field(None, gt=0, le=1)
        max_tokens: int | None = Field(None, ge=1)
        max_completion_tokens: int | None = Field(None, ge=1)
        stream: bool = False
        stream_options: StreamOptions | None = None
        seed: int | None = None
        stop: str | list[str] | None = None
        presence_penalty: float = Field(0.0, ge=-2, le=2)
        frequency_penalty: float = Field(0.0, ge=-2, le=2)
        n: int = Field(1, ge=1, le=1)
        logprobs: bool | None = None
        # Extensions that vLLM and llama.cpp's server accept as well.
        top_k: int | None = Field(None, ge=0)
        repetition_penalty: float | None = Field(None, gt=0)

    return ChatRequest


class APIError(Exception):
    """An OpenAI-style error response."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def _validation_error(error) -> APIError:
    """The deepest problem of a pydantic ValidationError (for a union, the branch that got furthest), named by its
    field path ("messages[1].role")."""
    errors = error.errors()
    first = max(errors, key=lambda e: len(e["loc"]))
    param = ""
    for part in first["loc"]:
        if isinstance(part, int):
            param += f"[{part}]"
        elif part not in ("str", "list[TextPart]", "function-after"):  # union branches pydantic names in loc
            param += f".{part}" if param else str(part)
    message = first["msg"]
    if first["type"] == "missing":
        message = "is required"
    elif first["type"] == "too_short" and param == "messages":
        message = "must hold at least one message"
    return APIError(400, f"{param}: {message}", param=param or None)


# ----------------------------------------------------------------------------------------------- the server
@dataclass
class ServedModel:
    model: Any
    tokenizer: Any
    name: str
    use_template: bool
    engine: Any
    max_context: int
    created: int


def _settings_for(request, served: ServedModel, prompt_len: int):
    from model.generation import GenerationSettings

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
        presence_penalty=request.presence_penalty, frequency_penalty=request.frequency_penalty,
        seed=request.seed, stop=tuple(stop))


def _prompt_ids(request, served: ServedModel) -> list[int]:
    from model.chat_session import encode_prompt

    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in request.messages]
    ids = encode_prompt(served.tokenizer, messages, served.use_template)
    if len(ids) >= served.max_context:
        raise APIError(400, f"the prompt is {len(ids)} tokens; the model's context is {served.max_context} tokens, "
                            f"for the prompt and the answer together", param="messages",
                       code="context_length_exceeded")
    return ids


async def _until_done(events: asyncio.Queue) -> None:
    while (await events.get())[0] != "done":
        pass


async def _read_body(request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body is {int(declared)} bytes; the limit is {limit}", code="too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise APIError(413, f"the request body is over the limit of {limit} bytes", code="too_large")
    return bytes(body)


def create_app(served: ServedModel, api_key: str | None = None, max_waiting: int = 64,
               max_body_bytes: int = MAX_BODY_BYTES):
    """The FastAPI application around one loaded model and its running engine."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
    from fastapi.staticfiles import StaticFiles
    from pydantic import ValidationError
    from starlette.exceptions import HTTPException

    from model.generation import FINISH_ERROR

    chat_request = _request_models()
    counters = {"requests": 0}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        served.engine.start()
        yield
        served.engine.close()

    app = FastAPI(title="MiniNorm", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
        return JSONResponse(error.body(), status_code=error.status, headers=headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        return JSONResponse(APIError(error.status_code, str(error.detail)).body(), status_code=error.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        return JSONResponse(APIError(400, str(error.errors()[0].get("msg"))).body(), status_code=400)

    @app.exception_handler(Exception)
    async def server_error(request: Request, error: Exception) -> JSONResponse:
        message = f"internal error: {type(error).__name__}: {error}"
        return JSONResponse(APIError(500, message, kind="server_error").body(), status_code=500)

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "a valid API key is needed: send the header 'Authorization: Bearer KEY'",
                           code="invalid_api_key")

    def model_card() -> dict[str, Any]:
        return {"id": served.name, "object": "model", "created": served.created, "owned_by": "mininorm",
                "max_context": served.max_context}

    @app.get("/health")
    async def health() -> dict[str, Any]:
        running, waiting = served.engine.load
        return {"status": "ok", "model": served.name, "running": running, "waiting": waiting,
                "max_batch": served.engine.max_batch, "requests": counters["requests"],
                "generated_tokens": served.engine.generated_tokens, "decode_steps": served.engine.steps,
                "batched_rows": served.engine.batched_rows}

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict[str, Any]:
        authorize(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, request: Request) -> dict[str, Any]:
        authorize(request)
        if model_id != served.name:
            raise APIError(404, f"no model {model_id!r}; this server has {served.name!r}", param="model",
                           code="model_not_found")
        return model_card()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        authorize(request)
        body = await _read_body(request, max_body_bytes)
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise APIError(400, f"the body is not valid JSON ({error})") from None
        if not isinstance(data, dict):
            raise APIError(400, "the body must be a JSON object")
        try:
            parsed = chat_request.model_validate(data)
        except ValidationError as error:
            raise _validation_error(error) from None
        ids = _prompt_ids(parsed, served)
        settings = _settings_for(parsed, served, len(ids))
        if served.engine.load[1] >= max_waiting:
            raise APIError(503, f"the server is busy ({max_waiting} requests waiting); try again shortly",
                           kind="server_error", code="overloaded")
        counters["requests"] += 1
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def send(kind: str, value: Any) -> None:  # called on the engine's thread
            loop.call_soon_threadsafe(events.put_nowait, (kind, value))

        generation = served.engine.submit(ids, settings, on_text=lambda piece: send("text", piece),
                                          on_finish=lambda done: send("done", done))
        completion_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())

        def usage() -> dict[str, int]:
            completion = len(generation.token_ids)
            return {"prompt_tokens": len(ids), "completion_tokens": completion, "total_tokens": len(ids) + completion}

        def finished(done) -> None:
            if done.finish_reason == FINISH_ERROR:
                raise APIError(500, f"generation failed: {done.error}", kind="server_error")

        if not parsed.stream:
            # Wait for the end, or for the client to hang up (then the generation gives its slot back).
            gone = asyncio.ensure_future(request.receive())  # the body is read: the next message is a disconnect
            done = asyncio.ensure_future(_until_done(events))
            try:
                await asyncio.wait({gone, done}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                gone.cancel()
                done.cancel()
                generation.cancel()  # a no-op once done
            if not generation.done:
                return Response(status_code=499)  # nobody reads it
            finished(generation)
            return {"id": completion_id, "object": "chat.completion", "created": created, "model": served.name,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": generation.text},
                                 "finish_reason": generation.finish_reason, "logprobs": None}],
                    "usage": usage()}

        include_usage = bool(parsed.stream_options and parsed.stream_options.include_usage)

        def chunk(delta: dict[str, Any], finish_reason: str | None = None, **extra: Any) -> str:
            body = {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": served.name,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]}
            if include_usage:
                body["usage"] = None
            body.update(extra)
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        async def stream() -> AsyncIterator[str]:
            try:
                yield chunk({"role": "assistant", "content": ""})
                while (event := await events.get())[0] == "text":
                    yield chunk({"content": event[1]})
                try:
                    finished(generation)
                except APIError as error:  # the status line is sent already: the error goes in the stream
                    yield f"data: {json.dumps(error.body())}\n\n"
                    return
                yield chunk({}, generation.finish_reason)
                if include_usage:
                    yield chunk({}, None, choices=[], usage=usage())
                yield "data: [DONE]\n\n"
            finally:
                generation.cancel()  # the client went away (or a no-op after the end): free the slot

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(WEB_DIR / "index.html")

    app.mount("/static", StaticFiles(directory=WEB_DIR), name="static")
    return app


def load_served_model(path: Path, mode: str = "auto", max_batch: int = 8, name: str | None = None,
                      device: str = "auto", dtype: str = "auto", lora: Path | None = None) -> ServedModel:
    """The model directory `path` (with the LoRA adapter directory `lora` merged into its weights, when given)
    loaded for serving; its id is `name`, else the adapter's or the model's directory name."""
    from model.chat_session import uses_chat_template
    from model.generation import GenerationEngine
    from model.loading import load_model

    model, tokenizer = load_model(path, device=device, dtype=dtype, lora=lora)
    source = lora or path
    use_template = uses_chat_template(mode, model_task(source), tokenizer)
    if use_template:
        from dataset.chat_format import check_chatml_tokenizer
        check_chatml_tokenizer(tokenizer)
    engine = GenerationEngine(model, tokenizer, max_batch=max_batch)
    return ServedModel(model=model, tokenizer=tokenizer, name=name or source.name, use_template=use_template,
                       engine=engine, max_context=engine.max_context, created=int(source.stat().st_mtime))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Serve a MiniNorm model: OpenAI's chat API and a chat page",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_source_flags(parser)
    parser.add_argument("--host", default="127.0.0.1", help="0.0.0.0 listens on every interface")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api_key", default=None, help="require 'Authorization: Bearer KEY' on /v1/ requests")
    parser.add_argument("--model_name", default=None, help="the model id clients see; default: the directory name")
    parser.add_argument("--mode", choices=("auto", "chat", "plain"), default="auto",
                        help="chat template or plain continuation of the last message; auto: chat for SFT models")
    parser.add_argument("--max_batch", type=int, default=8, help="requests decoded together")
    parser.add_argument("--max_waiting", type=int, default=64, help="queued requests beyond which 503 is returned")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.max_batch < 1 or args.max_waiting < 1:
        return report_error(f"--max_batch and --max_waiting must be at least 1, got {args.max_batch} and "
                            f"{args.max_waiting}")
    try:
        path, lora, note = locate_model_and_adapter(args.model_path, args.lora)
    except ModelNotFound as error:
        return report_error(error)
    if note:
        print(f"note: {note}", file=sys.stderr)
    try:
        served = load_served_model(path, args.mode, args.max_batch, args.model_name, args.device, args.dtype, lora)
    except ValueError as error:
        return report_error(error)
    import uvicorn

    style = "chat template" if served.use_template else "plain continuation of the last message (pretrained model)"
    adapter = f" + LoRA {lora}" if lora else ""
    print(f"model {path}{adapter} as {served.name!r} ({style}, context {served.max_context}, up to {args.max_batch} "
          f"requests per batch); chat page and API at http://{args.host}:{args.port}/", file=sys.stderr, flush=True)
    if args.api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: listening on {args.host} without --api_key: anyone who can reach it can use it",
              file=sys.stderr)
    uvicorn.run(create_app(served, args.api_key, args.max_waiting), host=args.host, port=args.port,
                log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
