"""The ASGI pieces of nbserve on Ray, without Ray: the replica name on responses, and Ray's
plain-text overload answers rewritten into OpenAI-shaped errors on the proxy."""

from __future__ import annotations

import json

import httpx
from starlette.applications import Starlette
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from nbserve.serving.ray_asgi import REPLICA_HEADER, OpenAIErrorsMiddleware, ReplicaMiddleware

REPLICA = {"id": "r1", "node_id": "n1", "node_ip": "127.0.0.1"}


def _app() -> Starlette:
    async def health(request):
        return JSONResponse({"status": "ready", "ready": True})

    async def stream(request):
        async def gen():
            for i in range(3):
                yield f"data: {i}\n\n"
        return StreamingResponse(gen(), media_type="text/event-stream")

    async def ray_busy(request):  # what Ray's proxy answers on backpressure
        return PlainTextResponse("Request dropped due to backpressure (num_queued_requests=2, "
                                 "max_queued_requests=2).", 429, headers={"Retry-After": "3"})

    async def app_busy(request):  # nbserve's own 429: JSON already
        return JSONResponse({"error": {"message": "busy", "type": "rate_limit_error",
                                       "param": None, "code": "server_busy"}}, 429)

    async def not_found(request):
        return PlainTextResponse("Path '/x' not found.", 404)

    return Starlette(routes=[Route("/health", health), Route("/stream", stream),
                             Route("/ray-busy", ray_busy), Route("/app-busy", app_busy),
                             Route("/nf", not_found)])


def _client(app, root_path: str = "") -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app, root_path=root_path),
                             base_url="http://t")


async def test_replica_named_in_header_and_in_health_json():
    async with _client(ReplicaMiddleware(_app(), replica=REPLICA)) as c:
        r = await c.get("/health")
        assert r.headers[REPLICA_HEADER] == "r1"
        assert r.json() == {"status": "ready", "ready": True, "replica": REPLICA}
        assert int(r.headers["content-length"]) == len(r.content)
        s = await c.get("/stream")
        assert s.headers[REPLICA_HEADER] == "r1"
        assert s.text == "data: 0\n\ndata: 1\n\ndata: 2\n\n"  # other bodies untouched


async def test_replica_json_under_a_route_prefix():
    inner = Starlette(routes=[Route("/health", lambda r: JSONResponse({"ready": True}))])
    async with _client(ReplicaMiddleware(inner, replica=REPLICA), root_path="/llm") as c:
        r = await c.get("/llm/health")
        assert r.json()["replica"]["id"] == "r1"


async def test_ray_plain_text_429_becomes_an_openai_error_with_retry_after():
    async with _client(OpenAIErrorsMiddleware(_app())) as c:
        r = await c.get("/ray-busy")
        assert r.status_code == 429 and r.headers["retry-after"] == "3"
        assert r.headers["content-type"] == "application/json"
        err = r.json()["error"]
        assert err["type"] == "rate_limit_error" and err["code"] == "server_busy"
        assert err["param"] is None and "Retry after 3 s" in err["message"]
        assert "max_queued_requests=2" in err["message"]  # Ray's detail kept
        assert int(r.headers["content-length"]) == len(r.content)


async def test_json_errors_and_other_answers_pass_untouched():
    async with _client(OpenAIErrorsMiddleware(_app())) as c:
        r = await c.get("/app-busy")
        assert r.status_code == 429 and r.json()["error"]["message"] == "busy"
        assert (await c.get("/nf")).text == "Path '/x' not found."
        s = await c.get("/stream")
        assert s.text.count("data:") == 3
        assert json.loads((await c.get("/health")).text)["ready"] is True


def test_nothing_but_nbserve_ray_imports_ray():
    import subprocess
    import sys

    code = ("import pkgutil, importlib, sys, nbserve\n"
            "for m in pkgutil.walk_packages(nbserve.__path__, 'nbserve.'):\n"
            "    if m.name != 'nbserve.ray':\n"
            "        importlib.import_module(m.name)\n"
            "assert 'ray' not in sys.modules, 'something imported ray'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


def test_the_proxy_callback_path_names_the_middlewares():
    """Ray imports PROXY_CALLBACK ("module:function") in its proxy process: the path must name
    this module's function (it is a string, so nothing else checks it when modules move)."""
    import importlib

    from nbserve.serving import ray_asgi

    module, _, name = ray_asgi.PROXY_CALLBACK.partition(":")
    assert getattr(importlib.import_module(module), name) is ray_asgi.proxy_middlewares
