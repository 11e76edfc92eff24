"""The OpenAI routes: /v1/chat/completions, /v1/completions, /v1/models[/{id}].

Each generation route gets the first engine event before answering (so refusals become 4xx),
then either streams the chunks as SSE or folds the same chunks into one JSON answer. A list of
completion prompts answers once any prompt has its first event: the others may still wait for
a slot, and one refused after the stream started ends it with an error event.
`model` must be the served name (GET /v1/models) or empty/absent, which means the served model;
any other name is a 404 `model_not_found`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Match
from starlette.types import Send

from ..types import Backend, ErrorEvent, Event
from .errors import APIError, error_event_to_api, from_exception
from .fields import UnknownFields
from .limits import Limits
from .openapi_schemas import body_ref
from .protocol import ChatCompletionRequest, CompletionRequest, parse_body
from .response_store import ResponseStore
from .responses import ResponsesRequest
from .responses_stream import ResponseBuilder
from .streams import (
    Merge,
    StreamFailed,
    StreamInfo,
    chat_chunks,
    completion_chunks,
    fold_chat,
    fold_completion,
)
from .trace import Trace

log = logging.getLogger("nbserve.server")
T = TypeVar("T")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
CLIENT_GONE = 499  # nginx's "client closed request"
UNKNOWN_ROUTE = "v1_unknown"


class SSEResponse(StreamingResponse):
    """A StreamingResponse that always closes its iterator (and so the engine request), even
    when the client goes away between two chunks."""

    media_type = "text/event-stream"

    def __init__(self, content: Any, *, close: Callable[[], Awaitable[None]] | None = None,
                 **kwargs: Any):
        super().__init__(content, **kwargs)
        self.close = close  # also run at the end: the iterator may never have started

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            with anyio.CancelScope(shield=True):
                if aclose is not None:
                    await aclose()
                if self.close is not None:
                    await self.close()


# Characters that str.splitlines() (and so httpx's iter_lines) treats as line ends: escaped so
# that a token holding one cannot split a `data:` line. JSON escapes the C0 controls itself.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse_named(name: str, obj: Any) -> bytes:
    """One named SSE event (the Responses API's framing)."""
    return b"event: " + name.encode() + b"\n" + sse_data(obj)


def sse_data(obj: Any) -> bytes:
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":")).translate(_LINE_BREAKS)
    return b"data: " + text.encode() + b"\n\n"


async def sse_events(chunks: AsyncIterator[dict[str, Any]], include_usage: bool, trace: Trace,
                     request_id: str) -> AsyncIterator[bytes]:
    """Frame chunks as SSE; an engine error becomes a final `data: {"error": ...}` event."""
    done = False
    try:
        async for c in chunks:
            if not c["choices"]:  # the usage chunk
                if include_usage:
                    yield sse_data(c)
                continue
            if include_usage:
                c["usage"] = None
            yield sse_data(c)
        done = True
    except StreamFailed as exc:
        done = True
        err = error_event_to_api(exc.event.message, exc.event.kind, request_id)
        yield sse_data(err.body())
    except Exception as exc:  # a bug on our side: still end the stream properly
        done = True
        log.exception("stream %s failed", request_id)
        trace.error = "server_error"
        yield sse_data(from_exception(exc, request_id).body())
    finally:
        if not done:
            trace.disconnected = True
        await chunks.aclose()  # type: ignore[attr-defined]
    yield b"data: [DONE]\n\n"


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Run `work`; if the client disconnects first, cancel it and return None."""
    task = asyncio.ensure_future(work)

    async def wait_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        return None
    return task.result()


async def first_events(backend: Backend, reqs: Sequence[Any]
                       ) -> list[tuple[Event, AsyncIterator[Event]]]:
    """Start every request and get its first event; if any is refused, close all and raise."""
    gens = [backend.generate(r) for r in reqs]
    try:
        firsts = await asyncio.gather(*(anext(g) for g in gens), return_exceptions=True)
    except BaseException:  # cancelled: the client went away while the requests waited
        for g in gens:
            with contextlib.suppress(RuntimeError):
                await g.aclose()  # type: ignore[attr-defined]
        raise
    failed = next((f for f in firsts if isinstance(f, BaseException)), None)
    if failed is not None:
        for g, f in zip(gens, firsts):
            if not isinstance(f, BaseException):
                await g.aclose()  # type: ignore[attr-defined]
        if isinstance(failed, StopAsyncIteration):
            raise APIError(500, "the backend ended the request without any event",
                           "server_error", code="internal_error")
        raise failed
    refused = next((f for f in firsts if isinstance(f, ErrorEvent)), None)
    if refused is not None:  # failed before it started (queue timeout, shutdown): an HTTP error
        for g in gens:
            await g.aclose()  # type: ignore[attr-defined]
        raise error_event_to_api(refused.message, refused.kind, refused.request_id)
    return list(zip(firsts, gens))  # type: ignore[arg-type]


async def first_of_merged(merged: Merge, request_id: str) -> bool:
    """Wait for the first event of any request in `merged`; a request refused so far (bad
    input, busy queue, queue timeout, shutdown) becomes its HTTP error. Returns True."""
    try:
        await merged.first()
    except StreamFailed as exc:
        raise error_event_to_api(exc.event.message, exc.event.kind, request_id) from None
    return True


def build_router(backend: Backend, limits: Limits, *, log_messages: bool = False,
                 dependencies: Sequence[Any] = (), gen_dependencies: Sequence[Any] = (),
                 accept_unknown_fields: bool = False) -> APIRouter:
    """The /v1 router. `dependencies` guard every route (auth); `gen_dependencies` only the
    generation routes (rate limit). `accept_unknown_fields`: drop body fields nbserve does not
    know (each name logged once) instead of answering 400 `unknown_parameter`."""
    router = APIRouter(prefix="/v1", dependencies=list(dependencies))
    field_policy = UnknownFields(accept=accept_unknown_fields)

    def token_bytes(token_id: int, text: str) -> list[int]:
        tokenizer = getattr(backend, "tokenizer", None)  # per call: the backend may be swapped
        if tokenizer is None or not hasattr(tokenizer, "token_bytes"):
            return list(text.encode("utf-8"))
        return list(tokenizer.token_bytes(token_id))

    def detokenize(ids: list[int]) -> str:
        tokenizer = getattr(backend, "tokenizer", None)
        return tokenizer.decode(ids) if tokenizer is not None else ""

    def model_card() -> dict[str, Any]:
        card = {"id": backend.model_name, "object": "model", "created": created_at,
                "owned_by": "nbserve"}
        max_context = getattr(backend, "max_context", None)
        if max_context:
            card["max_model_len"] = max_context
        return card

    created_at = int(time.time())

    def check_model(name: str | None) -> None:
        # An empty or missing name means "the model this server serves" (many clients send "").
        if name and name != backend.model_name:
            raise APIError(404, f"The model {name!r} does not exist here; this server serves "
                           f"{backend.model_name!r} (see GET /v1/models).",
                           "invalid_request_error", "model", "model_not_found")

    def request_id(request: Request) -> str:
        return getattr(request.state, "request_id", "") or uuid.uuid4().hex[:24]

    def begin(request: Request, rid: str, inputs: Any) -> Trace:
        """The Trace of an accepted request (the middleware logs and counts it at the end)."""
        trace = Trace(rid, start=getattr(request.state, "start", None) or time.perf_counter())
        if log_messages:
            trace.output = {}
            trace.input_text = json.dumps(inputs, ensure_ascii=False)
        request.state.trace = trace
        return trace

    async def answer(request: Request, chunks: AsyncIterator[dict[str, Any]], stream: bool,
                     include_usage: bool, trace: Trace, rid: str,
                     fold: Callable[[AsyncIterator[dict[str, Any]]], Awaitable[dict[str, Any]]],
                     close: Callable[[], Awaitable[None]] | None = None) -> Response:
        """The SSE stream or the folded JSON answer. `close` releases what `chunks` reads
        from even if `chunks` never starts (the client left first)."""
        headers = {"X-Request-ID": rid}
        if stream:
            return SSEResponse(sse_events(chunks, include_usage, trace, rid),
                               headers={**SSE_HEADERS, **headers}, close=close)
        try:
            body = await unless_disconnected(request, fold(chunks))
        except StreamFailed as exc:
            raise error_event_to_api(exc.event.message, exc.event.kind, rid) from None
        finally:
            if close is not None:
                await close()
        if body is None:
            trace.disconnected = True
            return Response(status_code=CLIENT_GONE)
        return JSONResponse(body, headers=headers)

    @router.get("/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @router.get("/models/{model_id:path}")
    async def get_model(model_id: str) -> dict[str, Any]:
        if model_id != backend.model_name:
            raise APIError(404, f"The model {model_id!r} does not exist here; this server serves "
                           f"{backend.model_name!r}.", "invalid_request_error", "model",
                           "model_not_found")
        return model_card()

    @router.post("/chat/completions", dependencies=list(gen_dependencies),
                 openapi_extra=body_ref(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        body: ChatCompletionRequest = parse_body(ChatCompletionRequest, await request.body(),
                                                 field_policy)
        check_model(body.model)
        rid = request_id(request)
        req = body.to_request(limits, request_id=rid)
        started = await unless_disconnected(request, first_events(backend, [req]))
        if started is None:
            return Response(status_code=CLIENT_GONE)
        ((first, gen),) = started
        trace = begin(request, rid, req.messages)
        info = StreamInfo(f"chatcmpl-{rid}", backend.model_name, int(time.time()), trace,
                          token_bytes)
        tools = body.tool_names if body.use_tools else None
        chunks = chat_chunks(gen, first, info, req.params.n, tools,
                             body.parallel_tool_calls is not False)
        return await answer(request, chunks, bool(body.stream), body.include_usage, trace, rid,
                            fold_chat)

    @router.post("/completions", dependencies=list(gen_dependencies),
                 openapi_extra=body_ref(CompletionRequest))
    async def completions(request: Request) -> Response:
        body: CompletionRequest = parse_body(CompletionRequest, await request.body(),
                                             field_policy)
        check_model(body.model)
        rid = request_id(request)
        reqs = body.to_requests(limits, request_id=rid)
        echo = None
        if body.echo:
            tokenizer = getattr(backend, "tokenizer", None)
            echo = [r.prompt if r.prompt is not None else _decode(tokenizer, r.prompt_ids)
                    for r in reqs]
        merged = Merge([backend.generate(r) for r in reqs])
        started = None
        try:
            started = await unless_disconnected(request, first_of_merged(merged, rid))
        finally:
            if started is None:  # refused, or the client left
                await merged.aclose()
        if started is None:
            return Response(status_code=CLIENT_GONE)
        trace = begin(request, rid, [r.prompt or r.prompt_ids for r in reqs])
        info = StreamInfo(f"cmpl-{rid}", backend.model_name, int(time.time()), trace,
                          token_bytes, detokenize)
        chunks = completion_chunks(merged.events(), info, reqs[0].params.n, echo,
                                   body.logprobs is not None)
        return await answer(request, chunks, bool(body.stream), body.include_usage, trace, rid,
                            fold_completion, merged.aclose)

    store = ResponseStore()

    @router.post("/responses", dependencies=list(gen_dependencies),
                 openapi_extra=body_ref(ResponsesRequest))
    async def responses(request: Request) -> Response:
        body: ResponsesRequest = parse_body(ResponsesRequest, await request.body(),
                                            field_policy)
        check_model(body.model)
        rid = request_id(request)
        history: list[dict[str, Any]] = []
        if body.previous_response_id:
            stored = store.get(body.previous_response_id)
            if stored is None:
                raise APIError(404, f"Previous response with id {body.previous_response_id!r} "
                               "not found (responses are kept in memory, a bounded number, "
                               "until the server stops).", "invalid_request_error",
                               "previous_response_id", "previous_response_not_found")
            history = stored.conversation
        req = body.to_request(limits, history, rid)
        started = await unless_disconnected(request, first_events(backend, [req]))
        if started is None:
            return Response(status_code=CLIENT_GONE)
        ((first, gen),) = started
        trace = begin(request, rid, req.messages)
        builder = ResponseBuilder(f"resp_{rid}", backend.model_name, _echoed(body), trace,
                                  {t["function"]["name"] for t in req.tools or []} or None,
                                  req.parallel_tool_calls)
        events = builder.events(gen, first)
        keep = body.store is not False
        conversation = history + body.input_messages()

        def remember() -> None:
            if keep and builder.response["status"] in ("completed", "incomplete"):
                store.put(builder.response, conversation + builder.output_messages())

        if body.stream:
            async def framed() -> AsyncIterator[bytes]:
                done = False
                try:
                    async for name, data in events:
                        yield sse_named(name, data)
                    done = True
                    remember()
                finally:
                    if not done:
                        trace.disconnected = True
                    await events.aclose()  # type: ignore[attr-defined]

            return SSEResponse(framed(), headers={**SSE_HEADERS, "X-Request-ID": rid},
                               close=events.aclose)  # type: ignore[attr-defined]

        async def drain() -> bool:
            async for _ in events:
                pass
            return True

        try:
            if await unless_disconnected(request, drain()) is None and \
                    builder.response["status"] == "in_progress":
                trace.disconnected = True
                return Response(status_code=CLIENT_GONE)
        finally:
            await events.aclose()  # type: ignore[attr-defined]
        if builder.response["status"] == "failed":
            err = builder.response["error"]
            raise error_event_to_api(err["message"], err["code"], rid)
        remember()
        return JSONResponse(builder.response, headers={"X-Request-ID": rid})

    @router.get("/responses/{response_id}")
    async def get_response(response_id: str) -> dict[str, Any]:
        stored = store.get(response_id)
        if stored is None:
            raise APIError(404, f"No response with id {response_id!r} is kept here.",
                           "invalid_request_error", "response_id", "not_found")
        return stored.response

    @router.delete("/responses/{response_id}")
    async def delete_response(response_id: str) -> dict[str, Any]:
        if not store.delete(response_id):
            raise APIError(404, f"No response with id {response_id!r} is kept here.",
                           "invalid_request_error", "response_id", "not_found")
        return {"id": response_id, "object": "response", "deleted": True}

    @router.api_route("/{rest:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD",
                                               "OPTIONS"], include_in_schema=False,
                      name=UNKNOWN_ROUTE)
    async def unknown(request: Request, rest: str) -> Response:
        """OpenAI-shaped 404/405 for /v1 paths (the UI mounted at / would answer otherwise)."""
        allowed = {m for r in router.routes if r is not unknown_route
                   for m in getattr(r, "methods", ())
                   if r.matches(request.scope)[0] == Match.PARTIAL}
        if allowed:
            raise APIError(405, f"Method {request.method} is not allowed on {request.url.path}; "
                           f"use {', '.join(sorted(allowed))}.", code="method_not_allowed",
                           headers={"Allow": ", ".join(sorted(allowed))})
        raise APIError(404, f"Unknown URL: {request.method} {request.url.path}. The OpenAI "
                       "routes are /v1/chat/completions, /v1/completions, /v1/responses and "
                       "/v1/models.",
                       code="unknown_url")

    unknown_route = router.routes[-1]
    return router


def _decode(tokenizer: Any, ids: list[int] | None) -> str:
    if tokenizer is None:
        raise APIError(400, "echo with a token-id prompt needs a backend with a tokenizer",
                       param="echo")
    return tokenizer.decode(ids or [])


# ----------------------------------------------------------------------------- OpenAPI


def _echoed(body: ResponsesRequest) -> dict[str, Any]:
    """The request's settings as a Response object repeats them."""
    effort = (body.reasoning or {}).get("effort")
    return {"instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "tool_choice": body.tool_choice or "auto", "tools": body.tools or [],
            "text": body.text or {"format": {"type": "text"}},
            "reasoning": {"effort": effort, "summary": None} if body.reasoning else None,
            "store": body.store is not False, "metadata": body.metadata or {},
            "truncation": "disabled", "user": body.user}
