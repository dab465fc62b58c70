"""OpenAI's error shape, {"error": {"message", "type", "param", "code"}}, for every failure: the server's own
(APIError), a request that fails the schema, an HTTP error of the framework (unknown path, wrong method) and an
internal error."""

from collections.abc import Iterable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from dataset.shown_value import shown_text

INTERNAL_ERROR = "internal server error; the server's log has the details"

# Where pydantic names the branch of a union in an error's location; a client knows only the field path.
_UNION_BRANCHES = ("str", "list[str]", "dict[str,any]", "list[TextPart]", "function-after",
                   "literal['auto','none','required']", "NamedToolChoice")


class APIError(Exception):
    """An OpenAI-style error response."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def field_path(parts: Iterable[str | int]) -> str:
    """The keys and indices down to a value of the body as an error names it ("messages[1].tool_calls[0].id"); a
    key of a client's object (logit_bias) is a part too: cut (shown_text)."""
    path = ""
    for part in parts:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{shown_text(part)}" if path else shown_text(str(part))
    return path


def validation_error(error: ValidationError) -> APIError:
    """The deepest problem of a pydantic ValidationError (for a union, the branch that got furthest), named by its
    field path ("messages[1].role")."""
    errors = error.errors()
    first = max(errors, key=lambda e: len(e["loc"]))
    param = field_path(part for part in first["loc"] if isinstance(part, int) or part not in _UNION_BRANCHES)
    message = first["msg"]
    if first["type"] == "missing":
        message = "is required"
    elif first["type"] == "too_short" and param == "messages":
        message = "must hold at least one message"
    return APIError(400, f"{param}: {message}", param=param or None)


async def _api_error(request: Request, error: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


async def _http_error(request: Request, error: HTTPException) -> JSONResponse:
    # The framework's headers go along: a 405's Allow names the methods the route takes (HTTP requires it).
    return JSONResponse(APIError(error.status_code, str(error.detail)).body(), status_code=error.status_code,
                        headers=error.headers)


async def _request_validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
    return JSONResponse(APIError(400, str(error.errors()[0].get("msg"))).body(), status_code=400)


async def _server_error(request: Request, error: Exception) -> JSONResponse:
    """A generic 500: exception text is internal, and the server logs it with its traceback (Starlette re-raises
    the exception to uvicorn, which logs it)."""
    return JSONResponse(APIError(500, INTERNAL_ERROR, kind="server_error").body(), status_code=500)


def add_error_handlers(app: FastAPI) -> None:
    """Every error `app` answers, in OpenAI's shape."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _request_validation_error)
    app.add_exception_handler(Exception, _server_error)
