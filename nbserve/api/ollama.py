"""Ollama's generation routes: POST /api/chat, /api/generate and /api/embed, over the same
Backend, request types and limits as the OpenAI routes (keys, rate limit, body limit, cancel
on disconnect, metrics by route come from the app). The answers stream as NDJSON by default
(`ollama_stream.py`), or fold into one JSON object with `"stream": false`; errors are
Ollama's `{"error": message}` (`ollama_stream.error_record`, under the /api/ prefix).

A request with nothing to generate (no messages, an empty prompt) is Ollama's load request:
it answers `done_reason: "load"` at once (the model is always loaded)."""

from __future__ import annotations

import time
from typing import TypeVar

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response

from ..types import ModelNotFoundError, Request
from .chat import chat_chunks
from .embeddings import embed_requests
from .handler import CLIENT_GONE, RouteContext, answer, unless_disconnected
from .ollama_models import PREFIX, not_found, tag_name, untagged
from .ollama_schemas import OllamaChatRequest, OllamaEmbedRequest, OllamaGenerateRequest
from .ollama_stream import (
    NDJSONResponse,
    RecordMaker,
    Shape,
    Timings,
    _ns,
    fold_records,
    ndjson_frames,
    ollama_records,
    one_record,
)
from .openapi_schemas import body_ref
from .protocol import _Body
from .streams import StreamInfo

SCHEMAS = (OllamaChatRequest, OllamaGenerateRequest, OllamaEmbedRequest)
GENERATION_PATHS = frozenset({f"{PREFIX}chat", f"{PREFIX}generate", f"{PREFIX}embed"})
B = TypeVar("B", bound=_Body)


def router(base: RouteContext) -> APIRouter:
    """POST /api/chat, /api/generate and /api/embed."""
    r = APIRouter(prefix=PREFIX.rstrip("/"))

    async def parse(request: HTTPRequest, schema: type[B]) -> tuple[B, str, RouteContext]:
        """The prologue with Ollama's names (`name:latest`) and its 404 wording."""
        try:
            return await base.parse(request, schema, untagged)
        except ModelNotFoundError as exc:
            raise not_found(exc.name, exc) from None

    def model_label(ctx: RouteContext, name: str | None) -> str:
        return name or tag_name(ctx.backend.model_name)

    def load_answer(shape: Shape, model: str, stream: bool, rid: str) -> Response:
        return one_record(RecordMaker(shape, model, Timings(0.0, 0.0)).load(), stream, rid)

    async def generated(ctx: RouteContext, request: HTTPRequest, rid: str, req: Request,
                        model: str, shape: Shape, stream: bool, tools: set[str] | None
                        ) -> Response:
        """The answer of `req`: NDJSON records, or their fold (one code path)."""
        started = await ctx.start(request, req)
        if started is None:
            return Response(status_code=CLIENT_GONE)
        first, gen = started
        inputs = req.messages if req.messages is not None else req.prompt or req.prompt_ids
        trace = ctx.begin(request, rid, inputs)
        timings = Timings.of(trace, first)
        info = StreamInfo(f"ollama-{rid}", model, int(time.time()), trace, ctx.token_bytes)
        chunks = chat_chunks(timings.watch(gen), first, info, 1, tools)
        records = ollama_records(chunks, RecordMaker(shape, model, timings,
                                                     context=shape == "generate"))
        return await answer(request, rid, trace, stream,
                            lambda: ndjson_frames(records, trace, rid),
                            lambda: fold_records(records, shape), gen.aclose, NDJSONResponse)

    @r.post("/chat", openapi_extra=body_ref(OllamaChatRequest))
    async def chat(request: HTTPRequest) -> Response:
        body, rid, ctx = await parse(request, OllamaChatRequest)
        if not body.messages:
            return load_answer("chat", model_label(ctx, body.model), body.stream, rid)
        req = body.to_request(ctx.limits, ctx.backend.max_context, rid)
        return await generated(ctx, request, rid, req, model_label(ctx, body.model), "chat",
                               body.stream, body.tool_names)

    @r.post("/generate", openapi_extra=body_ref(OllamaGenerateRequest))
    async def generate(request: HTTPRequest) -> Response:
        body, rid, ctx = await parse(request, OllamaGenerateRequest)
        if not body.prompt and not body.suffix:
            return load_answer("generate", model_label(ctx, body.model), body.stream, rid)
        req = body.to_request(ctx.limits, ctx.backend.max_context, rid, ctx.backend.tokenizer)
        if body.context:
            req = body.after_context(req, ctx.backend.prompt_token_ids(req))
        return await generated(ctx, request, rid, req, model_label(ctx, body.model),
                               "generate", body.stream, None)

    @r.post("/embed", openapi_extra=body_ref(OllamaEmbedRequest))
    async def embed(request: HTTPRequest) -> Response:
        body, rid, ctx = await parse(request, OllamaEmbedRequest)
        reqs = body.to_requests(ctx.limits, rid, ctx.backend.tokenizer, ctx.backend.max_context)
        # no input ("" or []): a load request, answered with no embeddings
        trace = ctx.begin(request, rid, [r.prompt or r.prompt_ids for r in reqs])
        done = await unless_disconnected(request, embed_requests(ctx.backend, reqs))
        if done is None:
            trace.disconnected = True
            return Response(status_code=CLIENT_GONE)
        trace.prompt_tokens = sum(e.prompt_tokens for e in done)
        last_start = max((e.started for e in done), default=time.perf_counter())
        return JSONResponse({
            "model": model_label(ctx, body.model), "embeddings": [e.values for e in done],
            "total_duration": _ns(time.perf_counter() - trace.start),
            "load_duration": _ns(last_start - trace.start),
            "prompt_eval_count": trace.prompt_tokens}, headers={"X-Request-ID": rid})

    return r

