"""The 404 and 405 for /v1 paths no route family serves, in the path's error shape (the UI
mounted at / would answer them otherwise). Mounted after every family, as the last /v1 route."""

from __future__ import annotations

from collections.abc import Sequence

from fastapi import APIRouter, Request
from fastapi.responses import Response
from fastapi.routing import APIRoute
from starlette.routing import Match

from .errors import APIError

UNKNOWN_ROUTE = "v1_unknown"  # its name: the request log and metrics count it as "other"


def router(served: Sequence[APIRouter]) -> APIRouter:
    """The catch-all for /v1; a path that `served` routes know under another method is a 405
    naming the allowed ones."""
    r = APIRouter(prefix="/v1")
    routes = [route for s in served for route in s.routes if isinstance(route, APIRoute)]

    @r.api_route("/{rest:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD",
                                          "OPTIONS"], include_in_schema=False,
                 name=UNKNOWN_ROUTE)
    async def unknown(request: Request, rest: str) -> Response:
        allowed = {m for route in routes for m in route.methods or ()
                   if route.matches(request.scope)[0] == Match.PARTIAL}
        if allowed:
            raise APIError(405, f"Method {request.method} is not allowed on {request.url.path}; "
                           f"use {', '.join(sorted(allowed))}.", code="method_not_allowed",
                           headers={"Allow": ", ".join(sorted(allowed))})
        raise APIError(404, f"Unknown URL: {request.method} {request.url.path}. The OpenAI "
                       "routes are /v1/chat/completions, /v1/completions, /v1/responses and "
                       "/v1/models; Anthropic's, /v1/messages and /v1/messages/count_tokens.",
                       code="unknown_url")

    return r
