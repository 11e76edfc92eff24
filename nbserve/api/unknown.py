"""The 404 and 405 for /v1 (and /api) paths no route family serves (the UI mounted at /
would answer them otherwise), in the path's error shape. Mounted after every family, as the
last route of its prefix."""

from __future__ import annotations

from collections.abc import Sequence

from fastapi import APIRouter, Request
from fastapi.responses import Response
from fastapi.routing import APIRoute
from starlette.routing import Match

from .errors import APIError

UNKNOWN_ROUTE = "v1_unknown"  # its name: the request log and metrics count it as "other"


OPENAI_ROUTES = ("The OpenAI routes are /v1/chat/completions, /v1/completions, /v1/responses, "
                 "/v1/embeddings and /v1/models; Anthropic's, /v1/messages and "
                 "/v1/messages/count_tokens.")


def router(served: Sequence[APIRouter], prefix: str = "/v1", routes: str = OPENAI_ROUTES
           ) -> APIRouter:
    """The catch-all for `prefix`; a path that `served` routes know under another method is a
    405 naming the allowed ones; any other a 404 that names the prefix's `routes`."""
    r = APIRouter(prefix=prefix)
    known = [route for s in served for route in s.routes if isinstance(route, APIRoute)]

    @r.api_route("/{rest:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD",
                                          "OPTIONS"], include_in_schema=False,
                 name=UNKNOWN_ROUTE)
    async def unknown(request: Request, rest: str) -> Response:
        allowed = {m for route in known for m in route.methods or ()
                   if route.matches(request.scope)[0] == Match.PARTIAL}
        if allowed:
            raise APIError(405, f"Method {request.method} is not allowed on {request.url.path}; "
                           f"use {', '.join(sorted(allowed))}.", code="method_not_allowed",
                           headers={"Allow": ", ".join(sorted(allowed))})
        raise APIError(404, f"Unknown URL: {request.method} {request.url.path}. {routes}",
                       code="unknown_url")

    return r
