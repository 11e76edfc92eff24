"""What every route family shares: the handler prologue (the body parsed, unknown fields and
the model name checked, the request id), starting a request so that a refusal before its first
event is an HTTP error, the SSE response, and the one way an answer goes back (streamed, or
folded into one JSON body while the client is still there).

A route family is a module of this package (`chat`, `completions`, `responses`, `models`,
`tokenize`, `anthropic`) with a `router(ctx)`; `serving/app.py` mounts them from one list of
`RouteFamily`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.types import Send

from ..types import Backend, ErrorEvent, Event, ModelDirectory, ModelNotFoundError
from ..types import Request as GenRequest
from .adapter_backend import adapter_names, split_adapter, with_adapter
from .errors import APIError, ErrorShape, error_event_to_api, from_exception
from .fields import UnknownFields
from .limits import Limits
from .protocol import _Body, parse_body
from .streams import JSONBody, StreamFailed
from .trace import Trace

log = logging.getLogger("nbserve.server")
T = TypeVar("T")
B = TypeVar("B", bound=_Body)
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
CLIENT_GONE = 499  # nginx's "client closed request"


class SSEResponse(StreamingResponse):
    """A StreamingResponse that always closes its frames (and so the engine request), even
    when the client goes away between two of them."""

    media_type = "text/event-stream"

    def __init__(self, frames: AsyncGenerator[bytes, None], *, rid: str,
                 close: Callable[[], Awaitable[None]] | None = None):
        super().__init__(frames, headers={**SSE_HEADERS, "X-Request-ID": rid})
        self.frames = frames
        self.close = close  # also run at the end: the frames may never have started

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.frames.aclose()
                if self.close is not None:
                    await self.close()


# Characters that str.splitlines() (and so httpx's iter_lines) treats as line ends: escaped so
# that a token holding one cannot split a `data:` line. JSON escapes the C0 controls itself.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse_data(obj: object) -> bytes:
    """One `data:` SSE event holding `obj` as JSON."""
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":")).translate(_LINE_BREAKS)
    return b"data: " + text.encode() + b"\n\n"


def sse_named(name: str, obj: object) -> bytes:
    """One named SSE event (the Responses API's framing)."""
    return b"event: " + name.encode() + b"\n" + sse_data(obj)


async def sse_events(events: AsyncGenerator[tuple[str, JSONBody], None], trace: Trace,
                     on_end: Callable[[], None] | None = None) -> AsyncGenerator[bytes, None]:
    """Frame (name, data) events as named SSE events (the Responses and Messages APIs'); a
    stream the client leaves before its end marks the trace disconnected; `on_end` runs once
    the last event is sent."""
    done = False
    try:
        async for name, data in events:
            yield sse_named(name, data)
        done = True
        if on_end is not None:
            on_end()
    finally:
        if not done:
            trace.disconnected = True
        await events.aclose()


async def guarded_frames(items: AsyncGenerator[JSONBody, None], frame: Callable[[JSONBody], bytes],
                         error_body: Callable[[APIError], JSONBody], trace: Trace, rid: str
                         ) -> AsyncGenerator[bytes, None]:
    """Each of `items` framed; an engine error, or a bug on our side, ends the stream with the
    frame of its `error_body` (the family's error shape) instead of breaking the connection.
    A stream closed before its end is the client's disconnect (in the trace)."""
    done = False
    try:
        async for item in items:
            yield frame(item)
        done = True
    except StreamFailed as exc:
        done = True
        yield frame(error_body(error_event_to_api(exc.event.message, exc.event.kind, rid)))
    except Exception as exc:  # a bug on our side: still end the stream properly
        done = True
        log.exception("stream %s failed", rid)
        trace.error = "server_error"
        yield frame(error_body(from_exception(exc, rid)))
    finally:
        if not done:
            trace.disconnected = True
        await items.aclose()


async def sse_chunks(chunks: AsyncGenerator[JSONBody, None], include_usage: bool, trace: Trace,
                     rid: str) -> AsyncGenerator[bytes, None]:
    """Frame OpenAI chunks (chat, completions) as SSE, the usage chunk only when asked for; an
    engine error becomes a final `data: {"error": ...}` event; `data: [DONE]` ends it."""

    async def shown() -> AsyncGenerator[JSONBody, None]:
        try:
            async for c in chunks:
                if not c["choices"]:  # the usage chunk
                    if include_usage:
                        yield c
                    continue
                if include_usage:
                    c["usage"] = None
                yield c
        finally:
            await chunks.aclose()

    async with contextlib.aclosing(guarded_frames(shown(), sse_data, APIError.body, trace,
                                                  rid)) as frames:
        async for f in frames:
            yield f
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


async def first_event(backend: Backend, req: GenRequest
                      ) -> tuple[Event, AsyncGenerator[Event, None]]:
    """Start `req` and get its first event; a refusal (an exception, or an ErrorEvent before
    anything else: queue timeout, shutdown) closes it and raises its HTTP error."""
    gen = backend.generate(req)
    assert isinstance(gen, AsyncGenerator), "Backend.generate is an async generator"
    try:
        first = await anext(gen)
    except StopAsyncIteration:
        raise APIError(500, "the backend ended the request without any event",
                       "server_error", code="internal_error") from None
    except BaseException:  # refused, or cancelled: the client went away while it waited
        with contextlib.suppress(RuntimeError):
            await gen.aclose()
        raise
    if isinstance(first, ErrorEvent):
        await gen.aclose()
        raise error_event_to_api(first.message, first.kind, first.request_id)
    return first, gen


@dataclass(slots=True)
class RouteContext:
    """What the handlers of every route family share: the backend, the request limits, the
    policy for unknown fields (one per app: each name is logged once) and the log setting."""

    backend: Backend
    limits: Limits
    fields: UnknownFields = field(default_factory=UnknownFields)
    log_messages: bool = False
    models: ModelDirectory | None = None  # several models: each request's is resolved there

    def check_model(self, name: str | None) -> None:
        """An empty or missing name means "the model this server serves" (many clients send
        ""); any other name but the served one is a 404 `model_not_found`."""
        served = self.backend.model_name
        if name and name != served:
            raise ModelNotFoundError(name, [served])

    async def for_model(self, name: str | None, keep_alive: float | None = None
                        ) -> RouteContext:
        """This context with the backend that serves `name` (loaded first where a server has
        several models and that one is not loaded; "base:adapter" its LoRA adapter applied to
        every request; a 404 for a name it does not have);
        `keep_alive` as `ModelDirectory.backend` takes it."""
        if self.models is None:
            parts = split_adapter(name or "") if name != self.backend.model_name else None
            if parts is not None and parts[0] == self.backend.model_name:
                served = [self.backend.model_name] + \
                    [f"{parts[0]}:{a}" for a in adapter_names(self.backend)]
                return replace(self, backend=with_adapter(self.backend, parts[1], served))
            self.check_model(name)
            return self
        backend = await self.models.backend(name, keep_alive)
        return self if backend is self.backend else replace(self, backend=backend)

    async def parse(self, request: Request, schema: type[B],
                    untag: Callable[[str], str] | None = None) -> tuple[B, str, RouteContext]:
        """The handler prologue: the body as `schema` (a 400 naming a bad or unknown field),
        the request's id (the middleware's, or a new one), and this context for the body's
        model (`for_model`; `untag` maps a family's own spelling of a name to the served one,
        Ollama's `name:latest`)."""
        body = parse_body(schema, await request.body(), self.fields)
        name = untag(body.model) if untag is not None and body.model else body.model
        ctx = await self.for_model(name)
        return body, str(request.scope.get("state", {}).get("request_id") or
                         uuid.uuid4().hex[:24]), ctx

    async def start(self, request: Request, req: GenRequest
                    ) -> tuple[Event, AsyncGenerator[Event, None]] | None:
        """`req` started, with its first event (a refusal raises its HTTP error); None if the
        client left while it waited for a slot."""
        return await unless_disconnected(request, first_event(self.backend, req))

    def token_bytes(self, token_id: int, text: str) -> list[int]:
        """A token's bytes for logprobs (its text's UTF-8 without a tokenizer); read per call:
        the backend may be swapped."""
        tokenizer = self.backend.tokenizer
        if tokenizer is None:
            return list(text.encode("utf-8"))
        return list(tokenizer.token_bytes(token_id))

    def detokenize(self, ids: list[int]) -> str:
        """The text of `ids` ("" without a tokenizer)."""
        tokenizer = self.backend.tokenizer
        return tokenizer.decode(ids) if tokenizer is not None else ""

    def begin(self, request: Request, rid: str, inputs: object) -> Trace:
        """The Trace of an accepted request (the middleware logs and counts it at the end)."""
        start = request.scope.get("state", {}).get("start")
        trace = Trace(rid, start=start or time.perf_counter(), model=self.backend.model_name)
        if self.log_messages:
            trace.output = {}
            trace.input_text = json.dumps(inputs, ensure_ascii=False)
        request.state.trace = trace
        return trace


async def answer(request: Request, rid: str, trace: Trace, stream: bool,
                 frames: Callable[[], AsyncGenerator[bytes, None]],
                 fold: Callable[[], Awaitable[JSONBody]],
                 close: Callable[[], Awaitable[None]],
                 stream_class: type[SSEResponse] = SSEResponse) -> Response:
    """The answer of a started request: its streamed `frames` (SSE, or the family's
    `stream_class`), or the JSON body that `fold` makes of the same events, unless the client
    leaves first (499). A request that fails after it started is its HTTP error when folded.
    `close` releases the request even if neither ever starts (the client left first)."""
    if stream:
        return stream_class(frames(), rid=rid, close=close)
    try:
        body = await unless_disconnected(request, fold())
    except StreamFailed as exc:
        raise error_event_to_api(exc.event.message, exc.event.kind, rid) from None
    finally:
        await close()
    if body is None:
        trace.disconnected = True
        return Response(status_code=CLIENT_GONE)
    return JSONResponse(body, headers={"X-Request-ID": rid})


@dataclass(frozen=True, slots=True)
class RouteFamily:
    """One route family as `serving/app.py` mounts it: its router, the request schemas its
    routes document, the paths of its routes that generate (refused while the server shuts
    down, logged at INFO even when refused before they start), and, for a family that speaks
    another API than OpenAI's, the shape of its error bodies and the path prefixes where every
    error takes it (the app's error handlers, body limit and loading gate read them)."""

    router: Callable[[RouteContext], APIRouter]
    schemas: Sequence[type[BaseModel]] = ()
    generation: frozenset[str] = frozenset()
    error_shape: ErrorShape | None = None
    error_paths: frozenset[str] = frozenset()

