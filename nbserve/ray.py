"""Serve nbserve on Ray Serve: each replica builds its own engine (or Pool) and serves the
unchanged `create_app` app; Ray routes, queues, scales and places the replicas.

    import nbserve.ray
    app = nbserve.ray.deployment("smollm2", num_replicas=2)
    nbserve.ray.run(app)        # or `serve run mymodule:app` on a cluster (see docs/ray.md)
"""

from __future__ import annotations

import functools
import json
import logging
import os
import types
from collections.abc import Iterable
from typing import Any

try:
    import ray
    from ray import serve
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("nbserve.ray needs Ray Serve: pip install 'nbserve[ray]' "
                      "(or pip install 'ray[serve]>=2.30')") from exc

from starlette.datastructures import MutableHeaders
from starlette.middleware import Middleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("nbserve.ray")

REPLICA_HEADER = "x-nbserve-replica"
PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_CALLBACK = "nbserve.ray:proxy_middlewares"
#: `serve.run(app, controller_options=CONTROLLER_OPTIONS)` makes Ray's own overload and
#: timeout answers (plain text) OpenAI-shaped JSON; `nbserve.ray.run` passes it for you.
CONTROLLER_OPTIONS: dict[str, Any] = {"runtime_env": {"env_vars": {PROXY_CALLBACK_ENV:
                                                                   PROXY_CALLBACK}}}
DEFAULT_MAX_BATCH = 16  # Engine's default, for the defaults derived from it below
_REPLICA_PATHS = ("/health", "/stats")


# ----------------------------------------------------------------------------- the replica


@serve.ingress()
class NbserveReplica:
    """One Ray Serve replica: builds its backend in its own process, serves `create_app`."""

    def __init__(self, model: Any, build_options: dict[str, Any], app_options: dict[str, Any]):
        from .backend_ref import build_backend

        source = model() if _is_factory(model) else model
        self.backend, self._owned = build_backend(source, **build_options)
        self._app_options = app_options
        self.replica = replica_info()
        log.info("replica %s serves %s", self.replica["id"], self.backend.model_name)

    def __serve_build_asgi_app__(self) -> ASGIApp:
        from .server import create_app

        app = create_app(self.backend, **self._app_options)
        app.add_middleware(ReplicaMiddleware, replica=self.replica)  # outermost
        return app

    def replica_stats(self) -> dict[str, Any]:
        """This replica's identity and its backend's stats (for `replica_stats()`)."""
        return {"replica": self.replica, "model": self.backend.model_name,
                **self.backend.stats()}

    def check_health(self) -> None:
        """Ray Serve calls this periodically; raising makes Ray replace the replica."""
        health = self.backend.health() if hasattr(self.backend, "health") else {"ready": True}
        if not health.get("ready", False):
            raise RuntimeError(f"nbserve backend not ready: {health}")

    def __del__(self) -> None:
        backend = getattr(self, "backend", None)
        if backend is not None and getattr(self, "_owned", False):
            backend.close()


def replica_info() -> dict[str, Any]:
    """Who is answering: replica id, deployment, app, node id and address, process id."""
    info: dict[str, Any] = {"id": "local", "pid": os.getpid()}
    try:
        ctx = serve.get_replica_context()
        info.update(id=ctx.replica_tag, deployment=ctx.deployment, app=ctx.app_name,
                    rank=getattr(getattr(ctx, "rank", None), "rank", None))
    except Exception:  # noqa: BLE001 - outside a replica (unit use): keep the defaults
        pass
    if ray.is_initialized():
        info["node_id"] = ray.get_runtime_context().get_node_id()
        info["node_ip"] = ray.util.get_node_ip_address()
    return info


class ReplicaMiddleware:
    """Names the answering replica: an `x-nbserve-replica` header on every response, and a
    `replica` field in the JSON of /health and /stats."""

    def __init__(self, app: ASGIApp, replica: dict[str, Any]):
        self.app, self.replica = app, replica
        self.header = str(replica["id"]).encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, root = scope["path"], scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):] or "/"
        rewrite = path in _REPLICA_PATHS
        start: Message | None = None
        chunks: list[bytes] = []

        async def send_named(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message).append(REPLICA_HEADER, self.header.decode())
                if rewrite:
                    start = message  # held until the (small) JSON body is complete
                    return
            elif message["type"] == "http.response.body" and start is not None:
                chunks.append(message.get("body", b""))
                if message.get("more_body", False):
                    return
                body = self._with_replica(b"".join(chunks))
                headers = MutableHeaders(scope=start)
                headers["content-length"] = str(len(body))
                await send(start)
                await send({"type": "http.response.body", "body": body, "more_body": False})
                return
            await send(message)

        await self.app(scope, receive, send_named)

    def _with_replica(self, body: bytes) -> bytes:
        try:
            data = json.loads(body)
        except ValueError:
            return body
        if not isinstance(data, dict):
            return body
        return json.dumps({**data, "replica": self.replica}).encode()


# ----------------------------------------------------------------------------- the proxy


class OpenAIErrorsMiddleware:
    """On Ray's HTTP proxy: turns Ray Serve's own plain-text answers (429/503 when every queue
    is full, 503 when no replica is up, 408 on timeout) into OpenAI-shaped JSON errors. The
    app's own errors are JSON already and pass through untouched."""

    KINDS = {429: ("rate_limit_error", "server_busy"),
             503: ("service_unavailable", "no_replica_available"),
             408: ("timeout", "request_timeout")}

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        chunks: list[bytes] = []

        async def translate(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start" and self._is_ray_error(message):
                start = message
                return
            if message["type"] == "http.response.body" and start is not None:
                chunks.append(message.get("body", b""))
                if message.get("more_body", False):
                    return
                await self._send_json(send, start, b"".join(chunks).decode("utf-8", "replace"))
                start = None
                return
            await send(message)

        await self.app(scope, receive, translate)

    def _is_ray_error(self, message: Message) -> bool:
        if message["status"] not in self.KINDS:
            return False
        ctype = MutableHeaders(scope=message).get("content-type", "")
        return ctype.startswith("text/plain")

    async def _send_json(self, send: Send, start: Message, detail: str) -> None:
        status = start["status"]
        kind, code = self.KINDS[status]
        headers = MutableHeaders(scope=start)
        retry = headers.get("retry-after")
        if status == 429:
            hint = f" Retry after {retry} s." if retry else " Retry in a moment."
            text = "Every replica is busy and the queue is full." + hint
        elif status == 503:
            text = "No replica can take the request now; retry in a few seconds."
        else:
            text = "The request timed out in Ray Serve."
        body = json.dumps({"error": {"message": f"{text} ({detail.strip()})", "type": kind,
                                     "param": None, "code": code}}).encode()
        headers["content-type"] = "application/json"
        headers["content-length"] = str(len(body))
        await send(start)
        await send({"type": "http.response.body", "body": body, "more_body": False})


def proxy_middlewares() -> list[Middleware]:
    """Ray's proxy callback (`RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`)."""
    return [Middleware(OpenAIErrorsMiddleware)]


# ----------------------------------------------------------------------------- building


def deployment(model: Any, *, num_replicas: int = 1, gpus_per_replica: float = 0,
               cpus_per_replica: float = 1, autoscaling: dict[str, Any] | None = None,
               max_ongoing_requests: int | None = None, max_queued_requests: int = 64,
               retry_after_s: float = 1.0, name: str = "nbserve", route_prefix: str = "/",
               api_keys: str | Iterable[str] | None = None, ui: bool | None = None,
               app_options: dict[str, Any] | None = None,
               ray_actor_options: dict[str, Any] | None = None,
               **engine_options: Any) -> serve.Application:
    """A bound Ray Serve application serving `model`, for `nbserve.ray.run(app)`,
    `serve.run(app)` or `serve run module:app`.

    model: a source every replica can load ("smollm2", a hub id, a path present on every node),
        or a function called in each replica that returns a model (never pickled loaded).
    gpus_per_replica: 0 serves on CPU; 1 (or a fraction) one GPU; N > 1 a Pool over N GPUs.
    autoscaling: Ray Serve's `autoscaling_config` (min_replicas, max_replicas,
        target_ongoing_requests, ...); replaces num_replicas.
    max_ongoing_requests: per replica (default 2 x max_batch); beyond it requests wait in
        Ray's queue, up to max_queued_requests, then get 429 with Retry-After: retry_after_s.
    route_prefix: used by `nbserve.ray.run(app)` (plain `serve.run` takes its own).
    api_keys, ui, app_options: passed to `create_app` (the UI defaults to on with one replica
        only: Gradio's queue needs all requests of a chat on the same replica).
    engine_options: go to each Engine (max_batch, max_context, ...) and the loader (dtype).
    """
    build_options = _build_options(gpus_per_replica, engine_options)
    max_batch = int(engine_options.get("max_batch", DEFAULT_MAX_BATCH))
    multi = num_replicas > 1 or bool(autoscaling and autoscaling.get("max_replicas", 1) > 1)
    if ui is None:
        ui = not multi
    elif ui and multi:
        log.warning("ui=True with several replicas: Gradio's queue needs every request of a chat "
                    "on one replica, which Ray Serve does not guarantee; prefer ui=False")
    options: dict[str, Any] = {
        "name": name,
        "max_ongoing_requests": max_ongoing_requests or 2 * max_batch,
        "max_queued_requests": max_queued_requests,
        "backpressure_config": {"status_code": 429, "retry_after_s": retry_after_s},
        "ray_actor_options": {"num_cpus": cpus_per_replica, "num_gpus": gpus_per_replica,
                              **(ray_actor_options or {})},
        **_replica_count(num_replicas, autoscaling, max_batch),
    }
    _check(options)
    app_opts = {"api_keys": api_keys, "ui": ui, **(app_options or {})}
    os.environ.setdefault(PROXY_CALLBACK_ENV, PROXY_CALLBACK)  # for a Ray started from here
    app = serve.deployment(NbserveReplica, **options).bind(_portable(model), build_options,
                                                           app_opts)
    app._nbserve_run = {"name": name, "route_prefix": route_prefix}  # read by run()
    return app


def _build_options(gpus: float, engine_options: dict[str, Any]) -> dict[str, Any]:
    opts = dict(engine_options)
    if gpus < 0:
        raise ValueError(f"gpus_per_replica must be >= 0, got {gpus}")
    if gpus > 1:
        if gpus != int(gpus):
            raise ValueError(f"gpus_per_replica above 1 must be a whole number (one engine per "
                             f"GPU in a Pool), got {gpus}")
        if "devices" in opts or "device" in opts:
            raise ValueError("gpus_per_replica > 1 builds a Pool over the GPUs Ray assigns to "
                             "the replica: drop devices=/device=")
        opts["devices"] = int(gpus)
    else:
        opts.setdefault("device", "cuda" if gpus > 0 else "cpu")
    return opts


def _replica_count(num_replicas: int, autoscaling: dict[str, Any] | None,
                   max_batch: int) -> dict[str, Any]:
    if autoscaling is None:
        if not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"num_replicas must be an integer >= 1, got {num_replicas!r}")
        return {"num_replicas": num_replicas}
    if num_replicas != 1:
        raise ValueError("pass either num_replicas or autoscaling (with min_replicas and "
                         "max_replicas), not both")
    config = dict(autoscaling)
    config.setdefault("target_ongoing_requests", max(1, max_batch // 2))
    return {"autoscaling_config": config}


def _check(options: dict[str, Any]) -> None:
    """Validate the Ray options now, with the fix in the message, not at serve.run time."""
    from ray.serve.config import AutoscalingConfig

    if "autoscaling_config" in options:
        try:
            AutoscalingConfig(**options["autoscaling_config"])
        except Exception as exc:  # noqa: BLE001 - pydantic's message names the bad key
            raise ValueError(f"bad autoscaling config {options['autoscaling_config']}: {exc}. "
                             "Example: autoscaling={'min_replicas': 1, 'max_replicas': 4}") \
                from None
    if options["max_ongoing_requests"] < 1:
        raise ValueError("max_ongoing_requests must be >= 1")
    if options["max_queued_requests"] < 1 and options["max_queued_requests"] != -1:
        raise ValueError("max_queued_requests must be >= 1 (or -1 for no limit: then no 429)")


def _portable(model: Any) -> Any:
    """What the replicas receive: a source (absolute path if local) or a factory function."""
    if isinstance(model, (str, os.PathLike)):
        path = os.path.expanduser(os.fspath(model))
        return os.path.abspath(path) if os.path.exists(path) else os.fspath(model)
    if _is_factory(model):
        return model
    raise TypeError(f"nbserve.ray.deployment needs a model source or a function that returns "
                    f"a model, not a {type(model).__name__}: each replica builds its own engine. "
                    "Example: deployment('smollm2') or deployment(lambda: load_my_model())")


def _is_factory(model: Any) -> bool:
    return isinstance(model, (types.FunctionType, functools.partial))


# ----------------------------------------------------------------------------- running


def run(app: serve.Application, *, name: str | None = None, route_prefix: str | None = None,
        host: str | None = None, port: int | None = None,
        blocking: bool = False) -> Any:
    """`serve.run(app)` with nbserve's proxy settings (OpenAI-shaped 429s); starts Ray and
    Serve on 127.0.0.1:8000 unless told otherwise (host/port apply when Serve first starts).
    Returns the deployment handle."""
    defaults = getattr(app, "_nbserve_run", {})
    if host is not None or port is not None:
        http = {"host": host or "127.0.0.1", "port": 8000 if port is None else port}
        serve.start(http_options=http, controller_options=CONTROLLER_OPTIONS)
    return serve.run(app, name=name or defaults.get("name", "nbserve"),
                     route_prefix=route_prefix or defaults.get("route_prefix", "/"),
                     blocking=blocking, controller_options=CONTROLLER_OPTIONS)


def replica_stats(name: str = "nbserve", app_name: str | None = None) -> list[dict[str, Any]]:
    """Every running replica's stats (its `replica` identity, tokens, latencies), one dict
    each, from a broadcast call: the way to see all replicas, since HTTP reaches only one."""
    handle = serve.get_deployment_handle(name, app_name or name)
    return list(handle.broadcast("replica_stats").results())


def url(port: int = 8000, host: str = "127.0.0.1", route_prefix: str = "/") -> str:
    """The base URL of the app behind Ray's proxy (add /v1 for the OpenAI API base)."""
    return f"http://{host}:{port}{route_prefix.rstrip('/')}"


__all__ = ["CONTROLLER_OPTIONS", "REPLICA_HEADER", "NbserveReplica", "deployment", "run",
           "replica_stats", "proxy_middlewares", "url"]
