"""Errors in the OpenAI shape `{"error": {"message", "type", "param", "code"}}` and the handlers
that turn every failure (nbserve errors, bad JSON, unknown routes, crashes) into one."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..types import (
    BusyError,
    ContextLengthError,
    EngineError,
    EngineStoppedError,
    InvalidRequestError,
    JSONObject,
    ModelNotFoundError,
    NbserveError,
)

log = logging.getLogger("nbserve.server")


class APIError(Exception):
    """An HTTP error to answer in the OpenAI shape."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers or {}

    def body(self) -> JSONObject:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


# How a route family writes an error body: (the error, the request id) -> the JSON body. The
# OpenAI shape is `openai_shape`; a family that speaks another API declares its own (see
# `RouteFamily.error_shape`), and every error answered under its paths takes it.
ErrorShape = Callable[[APIError, str], JSONObject]


def openai_shape(err: APIError, request_id: str = "") -> JSONObject:
    """`{"error": {"message", "type", "param", "code"}}`."""
    return err.body()


class ErrorShapes:
    """The error shape of each path: a route family's own under its path prefixes (a prefix
    covers itself and the paths below it), OpenAI's everywhere else. The error handlers, the
    body limit and the loading gate answer through it, so that a client of another API reads
    every error of its paths (401, 404, 413, 429, 503, validation) in its own shape."""

    def __init__(self, shapes: Iterable[tuple[str, ErrorShape]] = ()):
        self._shapes = tuple(sorted(shapes, key=lambda s: -len(s[0])))  # longest prefix first

    def for_path(self, path: str) -> ErrorShape:
        for prefix, shape in self._shapes:
            if path == prefix or path.startswith(prefix.rstrip("/") + "/"):
                return shape
        return openai_shape

    def response(self, err: APIError, path: str, request_id: str = "") -> JSONResponse:
        """`err` as the JSON response a client of `path` reads."""
        return JSONResponse(self.for_path(path)(err, request_id), status_code=err.status,
                            headers=err.headers)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> JSONObject:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _retry_after(seconds: float) -> dict[str, str]:
    return {"Retry-After": str(max(1, math.ceil(seconds)))}


def from_exception(exc: BaseException, request_id: str = "") -> APIError:
    """Map any exception to the APIError the client should see."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValidationError):
        exc = validation_error(exc.errors())
    if isinstance(exc, ContextLengthError):
        return APIError(400, str(exc), "invalid_request_error", exc.param,
                        "context_length_exceeded")
    if isinstance(exc, ModelNotFoundError):
        return APIError(404, str(exc), "invalid_request_error", "model", "model_not_found")
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc), "invalid_request_error", exc.param, exc.code)
    if isinstance(exc, BusyError):
        return APIError(429, str(exc), "rate_limit_error", None, "server_busy",
                        _retry_after(exc.retry_after))
    if isinstance(exc, EngineStoppedError):
        return APIError(503, f"{exc} Retry in a few seconds.", "service_unavailable", None,
                        "engine_unavailable", _retry_after(5))
    if isinstance(exc, (EngineError, NbserveError)):
        return server_error(str(exc), request_id)
    return server_error(f"{type(exc).__name__}: {exc}", request_id)


def server_error(detail: str, request_id: str) -> APIError:
    return APIError(500, f"The server failed on request {request_id or '(no id)'}: {detail}. "
                    "Retry; if it persists, report it with the request id.", "server_error",
                    None, "internal_error")


def error_event_to_api(message: str, kind: str, request_id: str) -> APIError:
    """An ErrorEvent from the engine, as the HTTP error a non-streaming client gets."""
    if kind == "service_unavailable":
        return APIError(503, f"{message}. Retry in a few seconds.", "service_unavailable", None,
                        "engine_unavailable", _retry_after(5))
    if kind == "queue_timeout":
        return APIError(503, f"{message}.", "service_unavailable", None, "queue_timeout",
                        _retry_after(5))
    if kind == "client_too_slow":
        return APIError(408, f"{message}.", "invalid_request_error", None, "client_too_slow")
    return server_error(message, request_id)


# ----------------------------------------------------------------------------- validation


def _param(loc: tuple[int | str, ...]) -> str | None:
    """('messages', 0, 'user', 'content', 'str') -> 'messages[0].content'."""
    out = ""
    prev: int | str | None = None
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(prev, int) and part in {"developer", "system", "user", "assistant",
                                                 "tool", "function"}:
            pass  # the discriminated-union tag pydantic adds after a message index
        elif any(c in str(part) for c in "[] -") or part in {"str", "int", "float", "bool",
                                                              "list", "dict", "none"}:
            pass  # a union member label, not a field
        else:
            out += ("." if out else "") + str(part)
        prev = part
    return out or None


def validation_error(errors: Sequence[Mapping[str, Any]]) -> InvalidRequestError:
    """The first pydantic/FastAPI validation error as a 400 that names the field."""
    if not errors:
        return InvalidRequestError("the request body is invalid")
    e = errors[0]
    loc = tuple(x for x in e.get("loc", ()) if x != "body")
    kind = e.get("type", "")
    if kind == "json_invalid":
        detail = (e.get("ctx") or {}).get("error", e.get("msg", ""))
        return InvalidRequestError(
            f"The request body is not valid JSON ({detail}). Send a JSON object with "
            "Content-Type: application/json.", code="invalid_json")
    param = _param(loc)
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        tag = (e.get("ctx") or {}).get("tag")
        expected = (e.get("ctx") or {}).get("expected_tags", "")
        param = f"{param}.role" if param else "role"
        what = f"{tag!r} is not a valid role" if tag else "the role is missing"
        return InvalidRequestError(f"{param}: {what}; use one of {expected}.".replace("'", ""),
                                   param=param)
    if kind == "missing":
        return InvalidRequestError(f"Missing required field: {param}", param=param)
    if kind == "model_type" and not loc:
        return InvalidRequestError("The request body must be a JSON object.", code="invalid_json")
    got = e.get("input")
    shown = repr(got) if isinstance(got, (int, float, str, bool)) or got is None else type(
        got).__name__
    if isinstance(got, str) and len(shown) > 60:
        shown = shown[:57] + "...'"
    msg = f"{param}: {e.get('msg', 'invalid value')} (got {shown})" if param else e.get("msg", "")
    return InvalidRequestError(msg, param=param)


# ----------------------------------------------------------------------------- handlers

_HTTP_CODES = {404: "unknown_url", 405: "method_not_allowed", 413: "request_too_large"}


def install_error_handlers(app: FastAPI, shapes: ErrorShapes | None = None) -> None:
    """Answer every error (including 404/405 and crashes) in the shape of its path: OpenAI's
    unless `shapes` gives the path another."""
    shapes = shapes or ErrorShapes()

    def rid(request: Request) -> str:
        return str(request.scope.get("state", {}).get("request_id", ""))

    def respond(request: Request, err: APIError) -> JSONResponse:
        return shapes.response(err, request.url.path, rid(request))

    async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
        return respond(request, from_exception(exc, rid(request)))

    async def on_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return respond(request, from_exception(validation_error(list(exc.errors())),
                                               rid(request)))

    async def on_http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        status = exc.status_code
        if status == 404:
            message = f"Unknown URL: {request.method} {request.url.path}. See GET /v1/models " \
                      "and POST /v1/chat/completions."
        elif status == 405:
            message = f"Method {request.method} is not allowed on {request.url.path}."
        else:
            message = str(exc.detail)
        err = APIError(status, message, "invalid_request_error", None,
                       _HTTP_CODES.get(status), dict(exc.headers or {}))
        return respond(request, err)

    async def on_crash(request: Request, exc: Exception) -> JSONResponse:
        log.error("request %s failed", rid(request), exc_info=exc)
        return respond(request, from_exception(exc, rid(request)))

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(NbserveError, on_api_error)
    app.add_exception_handler(ValidationError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_crash)
