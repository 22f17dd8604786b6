"""HTTP errors, written in the format of the API the client speaks.

OpenAI routes (/v1/...): `{"error": {"message", "type", "param", "code"}}`.
Anthropic's (/v1/messages): `{"type": "error", "error": {"type", "message"}}`.
TGI routes (everything else): `{"error": message, "error_type": ...}`, the shape TGI's own client
parses (`validation` -> ValidationError, `overloaded` -> OverloadedError, ...).
Bad parameters are 400 in both (FastAPI would say 422; the APIs we imitate say 400).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmserve.errors import InvalidRequestError, PromptTooLongError

logger = logging.getLogger("llmserve.serve")

# status -> Anthropic's error type (its 529 overloaded is our 503)
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                    429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}
# status -> (OpenAI error type, TGI error_type)
_TYPES = {
    400: ("invalid_request_error", "validation"),
    401: ("invalid_request_error", "authentication"),
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "validation"),
    429: ("rate_limit_exceeded", "overloaded"),
    500: ("server_error", "generation"),
    503: ("service_unavailable", "unavailable"),
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    @classmethod
    def from_invalid(cls, e: InvalidRequestError, param_names: dict[str, str] | None = None) -> ApiError:
        """An engine/config refusal as a 400; `param_names` maps our field names to the API's."""
        param = (param_names or {}).get(e.param or "", e.param)
        message = str(e)
        if e.param and param != e.param and message.startswith(e.param + ":"):
            message = param + message[len(e.param):]  # "max_new_tokens: ..." -> "max_tokens: ..."
        code = "context_length_exceeded" if isinstance(e, PromptTooLongError) else None
        return cls(400, message, param, code)


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIError(BaseModel):
    error: OpenAIErrorDetail


class TgiError(BaseModel):
    error: str
    error_type: str


def error_responses(model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """The error answers of a router's routes, for the OpenAPI schema: any 4xx (400 for a bad body, where FastAPI
    would document 422), and 503 while the model loads or the server drains, all in `model`'s shape."""
    return {"4XX": {"model": model, "description": "The request was refused (the message says what to change)"},
            503: {"model": model, "description": "The model is still loading, or the server is shutting down"}}


def is_anthropic_path(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def is_openai_path(path: str) -> bool:
    return path.startswith("/v1/") and not is_anthropic_path(path)


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error body (its clients read error.type and error.message; the field is named in the message)."""
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}


def error_body(path: str, status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    openai_type, tgi_type = _TYPES.get(status, ("server_error", "generation"))
    if is_anthropic_path(path):
        return anthropic_error(status, message)
    if is_openai_path(path):
        return {"error": {"message": message, "type": openai_type, "param": param, "code": code}}
    return {"error": message, "error_type": tgi_type}


def error_response(path: str, status: int, message: str, param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    # 503s are expected while loading and draining (and probes ask often): not warnings.
    level = logging.WARNING if status >= 500 and status != 503 else logging.INFO
    if path != "/health":
        logger.log(level, "%s refused with %d: %s", path, status, message)
    return JSONResponse(error_body(path, status, message, param, code), status_code=status, headers=headers)


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """FastAPI's list of pydantic errors as one sentence, and the first offending field."""
    parts, param = [], None
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            parts.append(f"the body is not valid JSON ({err.get('ctx', {}).get('error', 'parse error')})")
            continue
        field = ".".join(loc)
        param = param or (loc[0] if loc else None)
        got = err.get("input")
        parts.append(f"{field or 'body'}: {err.get('msg')}" + (f" (got {got!r})" if field and got is not None else ""))
    return "; ".join(parts) or "invalid request", param


def _count_rejection(request: Request, status: int) -> None:
    state = getattr(request.app.state, "llm", None)
    if state is not None:
        state.metrics.on_rejected(status)


def install_error_handlers(app: FastAPI) -> None:
    from llmserve.serve.streaming import ClientGone

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        _count_rejection(request, exc.status)
        return error_response(request.url.path, exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(request: Request, exc: InvalidRequestError) -> JSONResponse:
        e = ApiError.from_invalid(exc)
        _count_rejection(request, 400)
        return error_response(request.url.path, 400, e.message, e.param, e.code)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        _count_rejection(request, 400)
        return error_response(request.url.path, 400, message, param)

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(request.url.path, exc.status_code, str(exc.detail), headers=exc.headers)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return error_response(request.url.path, 500, f"internal error: {type(exc).__name__}: {exc}")
