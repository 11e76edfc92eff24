"""Serve nbserve on Ray Serve: each replica builds its own engine (or Pool) and serves the
unchanged `create_app` app; Ray routes, queues, scales and places the replicas.

    import nbserve.ray
    app = nbserve.ray.deployment("smollm2", num_replicas=2)
    nbserve.ray.run(app)        # or `serve run mymodule:app` on a cluster (see docs/ray.md)
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import types
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeGuard

try:
    import ray
    from ray import serve
    from ray.serve.handle import DeploymentHandle
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("nbserve.ray needs Ray Serve: pip install 'nbserve[ray]' "
                      "(or pip install 'ray[serve]>=2.60')") from exc
from starlette.types import ASGIApp

from .engine.config import PAGED_MAX_BATCH
from .serving.ray_asgi import (
    PROXY_CALLBACK,
    PROXY_CALLBACK_ENV,
    REPLICA_HEADER,
    ReplicaMiddleware,
    proxy_middlewares,
)
from .types import JSONObject


def _missing_features() -> list[str]:
    """Ray Serve features nbserve.ray relies on that the installed Ray lacks."""
    import inspect

    from ray.serve.handle import DeploymentHandle

    checks = {
        "serve.deployment(backpressure_config=...)":
            "backpressure_config" in inspect.signature(serve.deployment).parameters,
        "serve.run(controller_options=...)":
            "controller_options" in inspect.signature(serve.run).parameters,
        "serve.ingress() without an app": "app" in inspect.signature(serve.ingress).parameters
            and inspect.signature(serve.ingress).parameters["app"].default is None,
        "DeploymentHandle.broadcast": hasattr(DeploymentHandle, "broadcast"),
    }
    return [name for name, ok in checks.items() if not ok]


if _missing_features():  # pragma: no cover - depends on the environment
    raise ImportError(f"nbserve.ray needs a newer Ray Serve (found ray {ray.__version__}, "
                      f"missing {', '.join(_missing_features())}): "
                      "pip install -U 'ray[serve]>=2.60'")

log = logging.getLogger("nbserve.ray")

#: `serve.run(app, controller_options=CONTROLLER_OPTIONS)` puts Ray's own overload and timeout
#: answers (plain text) in the OpenAI error shape; `nbserve.ray.run` passes it for you.
CONTROLLER_OPTIONS: JSONObject = {
    "runtime_env": {"env_vars": {PROXY_CALLBACK_ENV: PROXY_CALLBACK}}}
DEFAULT_MAX_BATCH = PAGED_MAX_BATCH  # the Engine's, for the defaults derived from it below
_AUTOSCALING_KEYS = ("min_replicas", "max_replicas", "initial_replicas",
                     "target_ongoing_requests", "upscale_delay_s", "downscale_delay_s")


# ----------------------------------------------------------------------------- the replica


@serve.ingress()
class NbserveReplica:
    """One Ray Serve replica: builds its backend in its own process, serves `create_app`."""

    def __init__(self, model: object, build_options: dict[str, Any], app_options: dict[str, Any]):
        from .serving.backend_ref import build_backend

        self._owned = False  # first: __del__ runs even when building the backend fails

        source = model() if _is_factory(model) else model
        self.backend, self._owned = build_backend(source, **build_options)
        self._app_options = app_options
        self.replica = replica_info()
        log.info("replica %s serves %s", self.replica["id"], self.backend.model_name)

    def __serve_build_asgi_app__(self) -> ASGIApp:
        from .serving.app import create_app

        app = create_app(self.backend, **self._app_options)
        app.add_middleware(ReplicaMiddleware, replica=self.replica)  # outermost
        self._metrics = app.state.metrics
        return app

    def replica_stats(self) -> JSONObject:
        """This replica's identity and its backend's stats (for `replica_stats()`)."""
        return {"replica": self.replica, "model": self.backend.model_name,
                **self.backend.stats()}

    def replica_metrics(self) -> tuple[str, str]:
        """(replica id, this replica's Prometheus text: what its /metrics would answer)."""
        body, _ = self._metrics.render()
        return str(self.replica["id"]), body.decode()

    def check_health(self) -> None:
        """Ray Serve calls this periodically; raising makes Ray replace the replica."""
        health = self.backend.health()
        if not health.get("ready", False):
            raise RuntimeError(f"nbserve backend not ready: {health}")

    def __del__(self) -> None:
        if self._owned:
            self.backend.close()


def replica_info() -> JSONObject:
    """Who is answering: replica id, deployment, app, node id and address, process id."""
    info: JSONObject = {"id": "local", "pid": os.getpid()}
    try:
        ctx = serve.get_replica_context()
        info.update(id=ctx.replica_tag, deployment=ctx.deployment, app=ctx.app_name,
                    rank=getattr(getattr(ctx, "rank", None), "rank", None))
    except Exception as exc:  # noqa: BLE001 - outside a replica: keep the defaults
        log.debug("no replica context (%s)", exc)
    if ray.is_initialized():
        info["node_id"] = ray.get_runtime_context().get_node_id()
        info["node_ip"] = ray.util.get_node_ip_address()
    return info


# ----------------------------------------------------------------------------- building


def deployment(model: object, *, num_replicas: int = 1, gpus_per_replica: float = 0,
               cpus_per_replica: float = 1, autoscaling: dict[str, float] | None = None,
               max_ongoing_requests: int | None = None, max_queued_requests: int = 64,
               retry_after_s: float = 1.0, name: str = "nbserve", route_prefix: str = "/",
               api_keys: str | Iterable[str] | None = None, ui: bool | None = None,
               app_options: dict[str, Any] | None = None,
               ray_actor_options: dict[str, object] | None = None,
               serve_options: dict[str, object] | None = None,
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
    ray_actor_options, serve_options: extra Ray settings (resources, runtime_env; or
        logging_config, health_check_period_s, graceful_shutdown_timeout_s, ...).
    engine_options: go to each Engine (max_batch, max_context, ...) and the loader (dtype,
        weights, exact).
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
        **(serve_options or {}),
    }
    _check(options)
    app_opts = {"api_keys": api_keys, "ui": ui, **(app_options or {})}
    os.environ.setdefault(PROXY_CALLBACK_ENV, PROXY_CALLBACK)  # for a Ray started from here
    # Ray annotates serve.deployment(cls, ...) as returning the decorator, not the Deployment
    app = serve.deployment(NbserveReplica, **options).bind(  # type: ignore[attr-defined]
        _portable(model), build_options, app_opts)
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


def _replica_count(num_replicas: int, autoscaling: dict[str, float] | None,
                   max_batch: int) -> dict[str, object]:
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
        config = options["autoscaling_config"]
        unknown = sorted(set(config) - set(AutoscalingConfig.model_fields))
        if unknown:
            raise ValueError(f"unknown autoscaling key(s) {unknown}: use Ray Serve's "
                             f"autoscaling_config keys ({', '.join(_AUTOSCALING_KEYS)}, ...)")
        try:
            AutoscalingConfig(**config)
        except Exception as exc:  # noqa: BLE001 - pydantic's message names the bad key
            raise ValueError(f"bad autoscaling config {options['autoscaling_config']}: {exc}. "
                             "Example: autoscaling={'min_replicas': 1, 'max_replicas': 4}") \
                from None
    if options["max_ongoing_requests"] < 1:
        raise ValueError("max_ongoing_requests must be >= 1")
    if options["max_queued_requests"] < 1 and options["max_queued_requests"] != -1:
        raise ValueError("max_queued_requests must be >= 1 (or -1 for no limit: then no 429)")


def _portable(model: object) -> object:
    """What the replicas receive: a source (absolute path if local) or a factory function."""
    if isinstance(model, (str, os.PathLike)):
        path = os.path.expanduser(os.fspath(model))
        return os.path.abspath(path) if os.path.exists(path) else os.fspath(model)
    if _is_factory(model):
        return model
    raise TypeError(f"nbserve.ray.deployment needs a model source or a function that returns "
                    f"a model, not a {type(model).__name__}: each replica builds its own engine. "
                    "Example: deployment('smollm2') or deployment(lambda: load_my_model())")


def _is_factory(model: object) -> TypeGuard[Callable[[], object]]:
    return isinstance(model, (types.FunctionType, functools.partial))


# ----------------------------------------------------------------------------- running


def run(app: serve.Application, *, name: str | None = None, route_prefix: str | None = None,
        host: str | None = None, port: int | None = None,
        blocking: bool = False) -> DeploymentHandle:
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


def replica_stats(name: str = "nbserve", app_name: str | None = None) -> list[JSONObject]:
    """Every running replica's stats (its `replica` identity, tokens, latencies), one dict
    each, from a broadcast call: the way to see all replicas, since HTTP reaches only one.
    `name` is the deployment's; `app_name` defaults to the application that holds it."""
    return [r for r in _broadcast(name, app_name, "replica_stats") if isinstance(r, dict)]


def replica_metrics(name: str = "nbserve", app_name: str | None = None) -> dict[str, str]:
    """Every running replica's Prometheus text, by replica id (label them when scraping)."""
    return dict(r for r in _broadcast(name, app_name, "replica_metrics")
                if isinstance(r, tuple))


def _broadcast(name: str, app_name: str | None, method: str) -> list[object]:
    """Call `method` on every replica; from a thread when an event loop runs here (a notebook
    kernel), where Ray refuses blocking calls."""
    def call() -> list[object]:
        handle = serve.get_deployment_handle(name, app_name or _app_of(name))
        return list(handle.broadcast(method).results())

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return call()
    with ThreadPoolExecutor(1, thread_name_prefix="nbserve-ray") as pool:
        return pool.submit(call).result()


def _app_of(deployment_name: str) -> str:
    apps = serve.status().applications
    for app_name, status in apps.items():
        if deployment_name in status.deployments:
            return app_name
    raise ValueError(f"no running Ray Serve application has a deployment named "
                     f"{deployment_name!r} (running: {sorted(apps) or 'none'}); pass "
                     "name=/app_name= as given to deployment() and serve.run()")


def url(port: int = 8000, host: str = "127.0.0.1", route_prefix: str = "/") -> str:
    """The base URL of the app behind Ray's proxy (add /v1 for the OpenAI API base)."""
    return f"http://{host}:{port}{route_prefix.rstrip('/')}"


__all__ = ["CONTROLLER_OPTIONS", "REPLICA_HEADER", "NbserveReplica", "deployment",
           "proxy_middlewares", "replica_metrics", "replica_stats", "run", "url"]
