"""create_app(): one FastAPI app with the OpenAI routes and Anthropic's Messages routes under /v1,
Ollama's under /api, /health, /stats, /metrics, API keys, a rate limit, size limits, errors in
each API's shape, request logs, then the Gradio UI.

The app never binds a socket: the launcher does (127.0.0.1 by default).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.datastructures import Headers, MutableHeaders
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..api import (
    anthropic,
    chat,
    completions,
    embeddings,
    models,
    ollama,
    ollama_models,
    ollama_stream,
    rerank,
    responses,
    tokenize,
    unknown,
)
from ..api.auth import KeyAuth, RateLimiter
from ..api.errors import APIError, ErrorShapes, install_error_handlers
from ..api.fields import UnknownFields
from ..api.handler import RouteContext, RouteFamily
from ..api.limits import Limits
from ..api.openapi_schemas import add_request_schemas
from ..api.trace import Trace
from ..types import Backend, JSONObject, ModelDirectory
from .metrics import Metrics
from .options import ServerOptions

log = logging.getLogger("nbserve.server")
# The route families, mounted in this order (then the /v1 catch-all of api/unknown.py), each
# with the request schemas its routes document and its paths that generate: those are refused
# with a 503 while the server shuts down, and logged at INFO even when refused before starting.
ROUTE_FAMILIES: tuple[RouteFamily, ...] = (
    RouteFamily(tokenize.router, (tokenize.TokenizeRequest, tokenize.DetokenizeRequest)),
    RouteFamily(models.router, (models.ModelAction,)),
    RouteFamily(chat.router, (chat.ChatCompletionRequest,),
                generation=frozenset({"/v1/chat/completions"})),
    RouteFamily(completions.router, (completions.CompletionRequest,),
                generation=frozenset({"/v1/completions"})),
    RouteFamily(responses.router, (responses.ResponsesRequest,),
                generation=frozenset({"/v1/responses"})),
    RouteFamily(anthropic.router, (anthropic.MessagesRequest, anthropic.CountTokensRequest),
                generation=frozenset({"/v1/messages"}),
                error_shape=anthropic.anthropic_error_shape, error_paths=anthropic.PATHS),
    RouteFamily(embeddings.router, (embeddings.EmbeddingRequest,),
                generation=frozenset({"/v1/embeddings"})),
    RouteFamily(ollama_models.router, (ollama_models.ShowRequest, ollama_models.PullRequest),
                error_shape=ollama_stream.error_record,
                error_paths=frozenset({ollama_models.PREFIX})),
    RouteFamily(ollama.router, ollama.SCHEMAS, generation=ollama.GENERATION_PATHS,
                error_shape=ollama_stream.error_record,
                error_paths=frozenset({ollama_models.PREFIX})),
    RouteFamily(rerank.router, (rerank.RerankRequest,), generation=frozenset(rerank.RERANK_PATHS)),
)
GENERATION_PATHS = frozenset().union(*(f.generation for f in ROUTE_FAMILIES))
# Each family's error shape under its paths (OpenAI's elsewhere): every error handler, the body
# limit and the loading gate answer through it.
ERROR_SHAPES = ErrorShapes((path, f.error_shape) for f in ROUTE_FAMILIES if f.error_shape
                           for path in f.error_paths)
# Every route is behind the API keys and the rate limit (an app-level dependency, so a route
# added later is too) and every path behind the body limit (a middleware), except these, which
# tests/test_route_limits.py lists again with their reasons. Open: probes and the static docs.
OPEN_PATHS = frozenset({"/health", "/docs", "/docs/oauth2-redirect", "/openapi.json"})
# Behind the keys, outside the rate limit: monitors poll them, and reading counters must not
# take a key's budget for generation.
UNMETERED_PATHS = frozenset({"/metrics", "/stats"})


class ObservabilityMiddleware:
    """Gives each HTTP request an id (X-Request-ID), counts it by route and status, and logs
    one line per request (INFO for generation routes, DEBUG for the rest)."""

    def __init__(self, app: ASGIApp, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = uuid.uuid4().hex[:24]
        start = time.perf_counter()
        state = scope.setdefault("state", {})
        state["request_id"], state["start"] = rid, start
        status = 500

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = MutableHeaders(scope=message)
                if "x-request-id" not in headers:
                    headers.append("X-Request-ID", rid)
            await send(message)

        self.metrics.begin()
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            matched = scope.get("route")
            route = matched.path if isinstance(matched, Route) and \
                matched.name != unknown.UNKNOWN_ROUTE and matched.path else "other"
            trace: Trace | None = state.get("trace")
            duration = time.perf_counter() - start
            self.metrics.end(route, status, duration, trace)
            if trace is not None:
                log.info("%s", trace.log_line(route, status, duration))
            elif route in GENERATION_PATHS or status >= 500:
                log.info("%s %s %s %s time=%.3fs", rid, scope.get("method"), scope["path"],
                         status, duration)
            else:
                log.debug("%s %s %s %s time=%.3fs", rid, scope.get("method"), scope["path"],
                          status, duration)


class BodyLimitMiddleware:
    """Refuses request bodies over `max_bytes` with a 413 in the path's error shape, on every
    path (the API's routes, the UI's, and any added later)."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def _too_large(self, scope: Scope, send: Send, close: bool) -> None:
        err = APIError(413, f"The request body is over the limit of {self.max_bytes} bytes. "
                       "Send a shorter conversation.", code="request_too_large")
        resp = ERROR_SHAPES.response(err, scope["path"],
                                     str(scope.get("state", {}).get("request_id", "")))
        if close:
            resp.headers["Connection"] = "close"
        await resp({"type": "http"}, _no_receive, send)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > 8 * self.max_bytes:
            await self._too_large(scope, send, close=True)  # not worth reading: answer and close
            return
        chunks: list[bytes] = []
        size, too_large = 0, False
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # client left before sending its body
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                too_large = True  # keep reading (bounded) so the client sees the 413 cleanly
                if size > 8 * self.max_bytes:
                    break
            else:
                chunks.append(body)
            if not message.get("more_body", False):
                break
        if too_large:
            await self._too_large(scope, send, close=size > 8 * self.max_bytes)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}


def create_app(backend: Backend | ModelDirectory, *, api_keys: str | Iterable[str] | None = None,
               cors_origins: str | Iterable[str] | None = None,
               limits: Limits | Mapping[str, Any] | None = None,
               rate_limit_per_minute: float | None = None, ui: bool = True,
               log_messages: bool = False, accept_unknown_fields: bool = False,
               options: ServerOptions | None = None) -> FastAPI:
    """The ASGI app serving `backend` (an Engine or a Pool; or several models, a
    `ModelDirectory` such as `serving.model_set.ModelSet`, routed by each request's `model`).

    api_keys: required bearer keys for every route but /health and the docs (none: open).
    cors_origins: browser origins allowed to call the API (none by default).
    limits: request size and parameter limits (see `Limits`; a dict of its fields works too).
    rate_limit_per_minute: requests per minute per key (per client address without keys), on
        every route but /health, the docs, /stats and /metrics.
    ui: mount the Gradio chat at / (after the API routes); it asks for a key as its login when
        there are keys, and its turns obey the same limits and rate limit (one bucket with /v1
        per key or address); its routes are behind the body limit, as every path is.
    log_messages: put message contents in the request log lines (off by default).
    accept_unknown_fields: drop request fields nbserve does not know, logging each name once
        (off by default: a 400 `unknown_parameter` naming the field, so a typo is never
        silently ignored). Fields nbserve knows and cannot serve are refused either way.
    options: the same as one `ServerOptions` record (what launch and the CLI build), instead of
        the keywords; its TLS files are the launcher's business, not the app's.
    The caller owns `backend`: the app does not close it on shutdown.
    """
    # Every keyword but backend and options is a ServerOptions field (a test checks that).
    given = {k: v for k, v in locals().items() if k not in ("backend", "options")}
    directory: ModelDirectory | None = None
    if isinstance(backend, ModelDirectory):  # several models: the default is the app's own
        directory, backend = backend, backend.default
    if not isinstance(backend, Backend):
        raise TypeError(f"create_app needs a Backend: an Engine, a Pool, or an object with every "
                        f"member of nbserve.types.Backend (BackendDefaults gives the optional "
                        f"ones); got {type(backend).__name__}. "
                        "Example: create_app(Engine(load('smollm2')))")
    opts = ServerOptions.from_app_keywords(given, options)
    if options is not None:  # the record form is its keywords: the body below reads either
        return create_app(directory or backend, **opts.app_kwargs())
    limits, log_messages = opts.limits, opts.log_messages
    key_list = list(opts.api_keys)
    keys = KeyAuth(key_list)
    limiter = RateLimiter(opts.rate_limit_per_minute) if opts.rate_limit_per_minute else None
    metrics = Metrics(backend.stats)

    # async (they do no I/O): FastAPI would run plain functions in a worker thread per request
    async def guard(request: Request) -> None:
        """The keys, then the rate limit, for every route of the app but OPEN_PATHS; then, on
        a generation route, whether the server still admits work."""
        route = request.scope.get("route")
        path = route.path if isinstance(route, APIRoute) else ""  # "": nothing is exempt
        if path in OPEN_PATHS:
            return
        request.state.client_key = client = keys.check(request) if keys else None
        if limiter is not None and path not in UNMETERED_PATHS:
            limiter.check(client or (request.client.host if request.client else "unknown"))
        if path in GENERATION_PATHS and not app.state.accepting:
            raise APIError(503, "The server is shutting down; retry on another replica or "
                           "in a few seconds.", "service_unavailable", None, "shutting_down",
                           {"Retry-After": "5"})

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.accepting = True
        log.info("serving %r: OpenAI and Anthropic APIs at /v1, Ollama's at /api%s",
                 backend.model_name,
                 " (API keys required)" if keys else "")
        yield
        app.state.accepting = False

    app = FastAPI(title="nbserve", summary="OpenAI-compatible API for one model",
                  lifespan=lifespan, docs_url="/docs", redoc_url=None,
                  dependencies=[Depends(guard)])
    app.state.backend, app.state.metrics, app.state.limits = backend, metrics, limits
    app.state.models = directory  # the chat UI's model picker (None: one model)
    # The chat UI checks its turns with these same objects (one rate-limit bucket per client).
    app.state.key_auth, app.state.rate_limiter = keys, limiter
    app.state.accepting = True  # False once the server shuts down
    install_error_handlers(app, ERROR_SHAPES)

    def health_body() -> tuple[int, JSONObject]:
        h: JSONObject
        try:
            h = dict(backend.health())
        except Exception as exc:  # noqa: BLE001 - a broken backend is "not ready", not a 500
            h = {"ready": False, "status": "error", "detail": str(exc)}
        ready = bool(h.get("ready")) and app.state.accepting
        if not app.state.accepting:
            h["status"] = "shutting_down"
        h.setdefault("status", "ready" if ready else "loading")
        h.setdefault("model", backend.model_name)
        body = {"status": h["status"], "ready": ready, "model": h["model"],
                "replicas": h.get("replicas", 1), "running": h.get("running", 0),
                "waiting": h.get("waiting", 0), **h}
        body["ready"] = ready
        return (200 if ready else 503), body

    @app.get("/health")
    async def health() -> JSONResponse:
        status, body = health_body()
        return JSONResponse(body, status_code=status)

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        return {**backend.stats(), "model": backend.model_name, "server": metrics.snapshot()}

    @app.get("/metrics")
    async def prometheus() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    ctx = RouteContext(backend, limits, UnknownFields(accept=opts.accept_unknown_fields),
                       log_messages, directory)
    routers = [family.router(ctx) for family in ROUTE_FAMILIES]
    catch_alls = [unknown.router(routers),
                  unknown.router(routers, ollama_models.PREFIX.rstrip("/"),
                                 ollama_models.ROUTES)]
    for router in [*routers, *catch_alls]:
        app.include_router(router)
    base_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            add_request_schemas(base_openapi(), [s for f in ROUTE_FAMILIES for s in f.schemas])
        return app.openapi_schema  # type: ignore[return-value]

    app.openapi = openapi  # type: ignore[method-assign]
    app.add_middleware(BodyLimitMiddleware, max_bytes=limits.max_body_bytes)
    if opts.cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(opts.cors_origins),
                           allow_methods=["GET", "POST", "OPTIONS"],
                           allow_headers=["Authorization", "Content-Type", "x-api-key",
                                          "anthropic-version", "anthropic-beta"],
                           expose_headers=["X-Request-ID", "Retry-After"])
    app.add_middleware(ObservabilityMiddleware, metrics=metrics)
    if opts.ui:
        _mount_ui(app, backend)
    return app


def _mount_ui(app: FastAPI, backend: Backend) -> None:
    """Mount the Gradio chat at / (after /v1, so the API routes win); it takes the app's
    limits, rate limiter and keys (with API keys, it asks for one as its login password)."""
    try:
        from .ui import mount_ui
    except ImportError as exc:
        log.warning("chat UI not mounted (%s); the API still works. Install gradio or pass "
                    "ui=False to silence this.", exc)
        return
    mount_ui(app, backend)
