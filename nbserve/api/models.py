"""GET /v1/models and /v1/models/{id}: the one model this server serves, as OpenAI lists
models (with vLLM's `max_model_len` when the backend knows its context) and, in the same
objects, as Anthropic does (`type`, `display_name`, `created_at`; the list's `has_more`,
`first_id`, `last_id`), so that both SDKs' `models.list()` read it."""

from __future__ import annotations

import datetime
import time

from fastapi import APIRouter

from .errors import APIError
from .handler import RouteContext
from .streams import JSONBody


def router(ctx: RouteContext) -> APIRouter:
    """The model list and the served model's card."""
    r = APIRouter(prefix="/v1")
    created_at = int(time.time())
    created_iso = datetime.datetime.fromtimestamp(created_at, datetime.timezone.utc).isoformat()

    def model_card() -> JSONBody:
        backend = ctx.backend  # read per call: the backend may be swapped
        card: JSONBody = {"id": backend.model_name, "object": "model", "created": created_at,
                          "owned_by": "nbserve", "type": "model",
                          "display_name": backend.model_name, "created_at": created_iso}
        if backend.max_context:
            card["max_model_len"] = backend.max_context
        return card

    @r.get("/models")
    async def list_models() -> JSONBody:
        card = model_card()
        return {"object": "list", "data": [card], "has_more": False, "first_id": card["id"],
                "last_id": card["id"]}

    @r.get("/models/{model_id:path}")
    async def get_model(model_id: str) -> JSONBody:
        served = ctx.backend.model_name
        if model_id != served:
            raise APIError(404, f"The model {model_id!r} does not exist here; this server serves "
                           f"{served!r}.", "invalid_request_error", "model", "model_not_found")
        return model_card()

    return r
