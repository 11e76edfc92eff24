"""POST /v1/embeddings (OpenAI's shape) and `embed_texts`, the one way every route family
(this one, Ollama's `/api/embed`, `/v1/rerank`) turns inputs into prefill-only engine
requests: one `Request` with an `EmbedSpec` per input, submitted together so that the
engine batches them, each answered by one `Embedded` event. The body's schema, the shared
function, then the route."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response

from ..types import (
    Backend,
    Embedded,
    EmbedSpec,
    ErrorEvent,
    Finished,
    InvalidRequestError,
    Request,
    Started,
)
from .errors import APIError, error_event_to_api
from .handler import CLIENT_GONE, RouteContext, unless_disconnected
from .limits import Limits
from .openapi_schemas import body_ref
from .protocol import PromptInput, _Body, prompt_list
from .streams import JSONBody

EmbedInput = str | list[int]
WINDOW = 64  # requests of one call in the engine at once: the rest wait for them, not in its queue


class EmbeddingRequest(_Body):
    """POST /v1/embeddings: `input` a string, a list of them, token ids or lists of them."""

    input: PromptInput
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: int | None = None
    user: str | None = None

    def inputs(self, limits: Limits) -> list[EmbedInput]:
        """The input as a list: one string or token-id list per embedding, at most
        `limits.max_embedding_inputs` of them, none empty (a 400 naming it)."""
        items = prompt_list(self.input, "input", limits.max_embedding_inputs, limits)
        for i, item in enumerate(items):
            if not item:
                where = f"input[{i}]" if len(items) > 1 else "input"
                raise InvalidRequestError(f"{where} is empty: every input needs a text or a "
                                          "token", param="input")
        return items


@dataclass(frozen=True, slots=True)
class Embedding:
    """One embed request's answer: its values, its prompt's tokens, and when the engine
    started it (Ollama reports the wait before as its load time)."""

    values: list[float]
    prompt_tokens: int
    started: float


async def _embed_one(backend: Backend, req: Request) -> Embedding:
    """The answer of one embed request; an ErrorEvent raises its APIError. Leaving early
    (cancelled, or failed) closes the request, which cancels it."""
    values: list[float] | None = None
    tokens, started = 0, time.perf_counter()
    gen = backend.generate(req)
    try:
        async for ev in gen:
            if isinstance(ev, Started):
                started = time.perf_counter()
            elif isinstance(ev, Embedded):
                values = ev.values
            elif isinstance(ev, Finished):
                tokens = ev.usage.prompt_tokens
            elif isinstance(ev, ErrorEvent):
                raise error_event_to_api(ev.message, ev.kind, ev.request_id)
    finally:
        with contextlib.suppress(RuntimeError):
            await gen.aclose()  # type: ignore[attr-defined]
    if values is None:
        raise APIError(500, f"request {req.request_id} ended without its embedding",
                       "server_error", code="internal_error")
    return Embedding(values, tokens, started)


async def embed_requests(backend: Backend, reqs: Sequence[Request], window: int = WINDOW
                         ) -> list[Embedding]:
    """The answers of embed requests (each with an `EmbedSpec`), in order, up to `window` of
    them in the engine at once (they batch; a long list does not fill the engine's queue).
    A refusal raises the backend's exception (`InvalidRequestError`, `BusyError`, ...) or, for
    an ErrorEvent, its `APIError`; the other requests are then cancelled, as they are when
    the caller is cancelled (a client that left)."""
    slots = asyncio.Semaphore(max(1, window))

    async def one(req: Request) -> Embedding:
        async with slots:
            return await _embed_one(backend, req)

    tasks = [asyncio.ensure_future(one(r)) for r in reqs]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def embed_texts(backend: Backend, inputs: Sequence[EmbedInput],
                      spec: EmbedSpec | None = None, *, request_id: str = "embd",
                      user: str | None = None, window: int = WINDOW
                      ) -> tuple[list[list[float]], int]:
    """The embeddings of `inputs` (texts encoded as the engine encodes a raw prompt, or token
    ids), in order, and the prompt tokens they took in all: one engine request each, through
    `embed_requests`."""
    spec = spec or EmbedSpec()
    reqs = []
    for i, item in enumerate(inputs):
        rid = request_id if len(inputs) == 1 else f"{request_id}-{i}"
        if isinstance(item, str):
            r = Request(prompt=item, embed=spec, request_id=rid)
        else:
            r = Request(prompt_ids=list(item), embed=spec, request_id=rid)
        if user:
            r.metadata["user"] = user
        reqs.append(r)
    done = await embed_requests(backend, reqs, window)
    return [e.values for e in done], sum(e.prompt_tokens for e in done)


# ----------------------------------------------------------------------------- the route


def encode_base64(values: list[float]) -> str:
    """A vector as OpenAI's base64 encoding: little-endian float32s."""
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")


def router(base: RouteContext) -> APIRouter:
    """POST /v1/embeddings: one JSON answer (embeddings do not stream)."""
    r = APIRouter(prefix="/v1")

    @r.post("/embeddings", openapi_extra=body_ref(EmbeddingRequest))
    async def embeddings(request: HTTPRequest) -> Response:
        body, rid, ctx = await base.parse(request, EmbeddingRequest)
        items = body.inputs(ctx.limits)
        trace = ctx.begin(request, rid, items)
        spec = EmbedSpec(dimensions=body.dimensions)
        done = await unless_disconnected(request, embed_texts(
            ctx.backend, items, spec, request_id=rid, user=body.user))
        if done is None:
            trace.disconnected = True
            return Response(status_code=CLIENT_GONE)
        vectors, tokens = done
        trace.prompt_tokens = tokens
        trace.finish_reasons.append("stop")
        b64 = body.encoding_format == "base64"
        answer: JSONBody = {
            "object": "list",
            "data": [{"object": "embedding", "index": i,
                      "embedding": encode_base64(v) if b64 else v}
                     for i, v in enumerate(vectors)],
            "model": ctx.backend.model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
        return JSONResponse(answer, headers={"X-Request-ID": rid})

    return r
