"""Every route that does work sits behind the API keys, the body limit and the rate limit, the
ones there are today and any added later: one test walks a real app's routes on a real port.
The routes left outside are listed here, each with its reason; a new one must be added here."""

from __future__ import annotations

import re
from typing import Any

import httpx
from fastapi.routing import APIRoute
from server_util import running_server
from starlette.routing import BaseRoute, Mount, Route

from nbserve.server import create_app

# Outside the keys and the rate limit (the body limit still holds), and why.
OPEN = {"/health": "probes and load balancers poll it without a key",
        "/docs": "the API's documentation page (static)",
        "/docs/oauth2-redirect": "part of the documentation page (static)",
        "/openapi.json": "the API's schema, which /docs reads (built once)"}
# Behind the keys, outside the rate limit: monitors poll them on a schedule, and reading a few
# counters must not take a key's budget for generation.
UNMETERED = {"/metrics": "Prometheus scrapes it", "/stats": "dashboards poll it"}
# The chat UI at /: its own login (the keys), and each chat turn takes the rate limit itself
# (tests/test_ui_limits.py, tests/test_ui_access.py); only the body limit is checked here.
UI_MOUNT = ""

BODY_LIMIT = 4096
RATE = 2  # requests per minute per key


def _routes(app: Any) -> list[BaseRoute]:
    """The app's routes, each included router opened up (newer FastAPI versions keep an
    included router as one entry of app.routes; older ones list its routes there)."""
    try:
        from fastapi.routing import iter_route_contexts
    except ImportError:
        return list(app.routes)
    return [c.original_route for c in iter_route_contexts(app.routes)]


def _concrete(path: str) -> str:
    return re.sub(r"\{[^}]*\}", "no-such-id", path)


# The error type Anthropic's shape gives each status (the Messages API's paths answer in it).
ANTHROPIC_TYPES = {401: "authentication_error", 413: "request_too_large",
                   429: "rate_limit_error", 503: "overloaded_error"}


def _error(resp: httpx.Response, status: int, code: str) -> None:
    """The error in its route family's shape: Ollama's `{"error": message}` under /api/ (no
    code there), OpenAI's everywhere else."""
    assert resp.status_code == status, (resp.request.method, resp.request.url, resp.text)
    if resp.request.url.path.startswith("/v1/messages"):
        body = resp.json()
        assert body["type"] == "error" and body["error"]["message"], body
        assert body["error"]["type"] == ANTHROPIC_TYPES[status], body
        return
    err = resp.json()["error"]
    if resp.request.url.path.startswith("/api/"):
        assert set(resp.json()) == {"error"} and isinstance(err, str) and err, resp.text
        return
    assert set(err) >= {"message", "type", "param", "code"} and err["code"] == code, err


def test_every_route_that_does_work_is_behind_the_keys_the_body_limit_and_the_rate_limit(
        tiny_engine: Any) -> None:
    keys = [f"sk-route-{i}" for i in range(64)]
    app = create_app(tiny_engine, api_keys=keys, rate_limit_per_minute=RATE,
                     limits={"max_body_bytes": BODY_LIMIT})
    unused = iter(keys)
    seen: set[str] = set()
    with running_server(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        def call(method: str, path: str, key: str | None = None,
                 body: bytes = b"{}") -> httpx.Response:
            headers = {"content-type": "application/json"}
            if key:
                headers["authorization"] = f"Bearer {key}"
            return http.request(method, path, content=body, headers=headers)

        too_large = b"x" * (BODY_LIMIT + 1)
        for route in _routes(app):
            if isinstance(route, Mount):
                assert route.path == UI_MOUNT, f"a mount that is not the UI: {route.path!r}"
                _error(call("POST", "/gradio_api/upload", body=too_large), 413,
                       "request_too_large")
                continue
            assert isinstance(route, (APIRoute, Route)), f"an unknown kind of route: {route!r}"
            seen.add(route.path)
            path = _concrete(route.path)
            for method in sorted((route.methods or set()) - {"HEAD"}):
                _error(call(method, path, keys[0], too_large), 413, "request_too_large")
                if route.path in OPEN:
                    answers = [call(method, path).status_code for _ in range(RATE + 1)]
                    assert 401 not in answers and 429 not in answers, (method, path, answers)
                    continue
                _error(call(method, path), 401, "missing_api_key")
                key = next(unused)
                answers = [call(method, path, key).status_code for _ in range(RATE)]
                assert 401 not in answers and 429 not in answers, (method, path, answers)
                if route.path in UNMETERED:
                    assert call(method, path, key).status_code == 200, (method, path)
                else:
                    _error(call(method, path, key), 429, "rate_limit_exceeded")
    # The exempt lists hold only routes that exist: they cannot grow stale and wide.
    assert set(OPEN) | set(UNMETERED) <= seen, (set(OPEN) | set(UNMETERED)) - seen
    assert {"/tokenize", "/detokenize", "/v1/chat/completions", "/v1/models", "/v1/messages",
            "/v1/messages/count_tokens"} <= seen


def test_the_generation_routes_of_the_route_list_are_refused_while_shutting_down(
        tiny_engine: Any) -> None:
    """serving/app.py's ROUTE_FAMILIES names the paths that generate: each is a POST route of
    the app, refused with a 503 `shutting_down` once the server stops accepting work, while
    the routes that only read still answer."""
    from nbserve.serving.app import GENERATION_PATHS

    app = create_app(tiny_engine, ui=False)
    posts = {r.path for r in _routes(app) if isinstance(r, APIRoute) and "POST" in r.methods}
    assert GENERATION_PATHS == {"/v1/chat/completions", "/v1/completions", "/v1/responses",
                                "/v1/embeddings", "/api/chat", "/api/generate", "/api/embed",
                                "/v1/rerank", "/rerank", "/v2/rerank",
                                "/v1/messages"}
    assert GENERATION_PATHS <= posts
    with running_server(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        app.state.accepting = False
        for path in sorted(GENERATION_PATHS):
            _error(http.post(path, json={}), 503, "shutting_down")
        assert http.get("/v1/models").status_code == 200
        _error(http.get("/v1/responses/resp_none"), 404, "not_found")
        assert http.post("/tokenize", json={"prompt": "hi"}).status_code == 200
        app.state.accepting = True
