"""GET /v1/models and /v1/models/{id}: the models this server serves, as OpenAI lists models
(with vLLM's `max_model_len` when the backend knows its context, and each model's `state`
where a server has several) and, in the same objects, as Anthropic does (`type`,
`display_name`, `created_at`; the list's `has_more`, `first_id`, `last_id`), so that both
SDKs' `models.list()` read it; POST /models/load and /models/unload (llama.cpp's router
mode)."""

from __future__ import annotations

import datetime
import time

import anyio
from fastapi import APIRouter, Request
from pydantic import Field

from ..types import ModelEntry, ModelNotFoundError
from .adapter_backend import adapter_names
from .errors import APIError
from .handler import RouteContext
from .openapi_schemas import body_ref
from .protocol import _Body, parse_body
from .streams import JSONBody


class ModelAction(_Body):
    """POST /models/load and /models/unload."""

    model: str = Field(min_length=1)  # (required here)


def router(ctx: RouteContext) -> APIRouter:
    """The model list, each model's card, and loading or unloading one."""
    r = APIRouter()
    created_at = int(time.time())
    created_iso = datetime.datetime.fromtimestamp(created_at, datetime.timezone.utc).isoformat()

    def entries() -> list[ModelEntry]:
        if ctx.models is not None:
            return ctx.models.entries()
        backend = ctx.backend  # read per call: the backend may be swapped
        return [ModelEntry(backend.model_name, "loaded", max_context=backend.max_context,
                           default=True)] + \
            [ModelEntry(f"{backend.model_name}:{a}", "loaded", max_context=backend.max_context)
             for a in adapter_names(backend)]

    def card(entry: ModelEntry) -> JSONBody:
        out: JSONBody = {"id": entry.name, "object": "model", "created": created_at,
                         "owned_by": "nbserve", "type": "model", "display_name": entry.name,
                         "created_at": created_iso}
        if entry.max_context:
            out["max_model_len"] = entry.max_context
        if ctx.models is not None:
            out["state"] = entry.state
            out["default"] = entry.default
            if entry.error:
                out["error"] = entry.error
        return out

    def find(name: str) -> ModelEntry:
        listed = entries()
        for entry in listed:
            if entry.name == name:
                return entry
        raise ModelNotFoundError(name, [e.name for e in listed])

    @r.get("/v1/models")
    async def list_models() -> JSONBody:
        cards = [card(e) for e in entries()]
        return {"object": "list", "data": cards, "has_more": False,
                "first_id": cards[0]["id"], "last_id": cards[-1]["id"]}

    @r.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> JSONBody:
        return card(find(model_id))

    @r.post("/models/load", openapi_extra=body_ref(ModelAction))
    async def load_model(request: Request) -> JSONBody:
        body, _, loaded = await ctx.parse(request, ModelAction)  # resolving a name loads it
        return {"model": loaded.backend.model_name, "state": "loaded", "success": True}

    @r.post("/models/unload", openapi_extra=body_ref(ModelAction))
    async def unload_model(request: Request) -> JSONBody:
        body = parse_body(ModelAction, await request.body(), ctx.fields)
        entry = find(body.model or "")
        if ctx.models is None or entry.default:
            raise APIError(400, f"{entry.name!r} is the default model: it stays loaded while "
                           "the server serves (unload the others, or stop the server).",
                           "invalid_request_error", "model", "default_model")
        was_loaded = await anyio.to_thread.run_sync(ctx.models.unload, entry.name)
        return {"model": entry.name, "state": "unloaded", "was_loaded": was_loaded,
                "success": True}

    return r
