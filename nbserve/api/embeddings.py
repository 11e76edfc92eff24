"""POST /v1/embeddings (OpenAI's shape) and `embed_texts`, the one way every route family
(this one, Ollama's `/api/embed`, `/v1/rerank`) turns inputs into prefill-only engine
requests: one `Request` with an `EmbedSpec` per input, all submitted at once so that the
engine batches them, each answered by one `Embedded` event."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

from ..types import Backend, Embedded, EmbedSpec, ErrorEvent, Finished, Request
from .errors import APIError, error_event_to_api

EmbedInput = str | list[int]


async def _embed_one(backend: Backend, req: Request) -> tuple[list[float], int]:
    """The values and prompt tokens of one embed request; an ErrorEvent raises its APIError.
    Leaving early (cancelled, or failed) closes the request, which cancels it."""
    values: list[float] | None = None
    tokens = 0
    gen = backend.generate(req)
    try:
        async for ev in gen:
            if isinstance(ev, Embedded):
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
    return values, tokens


async def embed_texts(backend: Backend, inputs: Sequence[EmbedInput],
                      spec: EmbedSpec | None = None, *, request_id: str = "embd",
                      user: str | None = None) -> tuple[list[list[float]], int]:
    """The embeddings of `inputs` (texts encoded as the engine encodes a raw prompt, or token
    ids), in order, and the prompt tokens they took in all.

    Every input is one engine request, all submitted before any is awaited (they batch). A
    refusal raises the backend's exception (`InvalidRequestError`, `BusyError`, ...) or, for
    an ErrorEvent, its `APIError`; the other requests are then cancelled, as they are when
    the caller is cancelled (a client that left)."""
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
    tasks = [asyncio.ensure_future(_embed_one(backend, r)) for r in reqs]
    try:
        done = await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return [v for v, _ in done], sum(n for _, n in done)
