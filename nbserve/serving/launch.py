"""launch() and serve(): the app on uvicorn in a background thread, and the `Server` handle.

The server runs on its own asyncio loop in a daemon thread, so it works inside a Jupyter kernel
(whose loop is already running) and never blocks the cell; the model loads on another thread
while the server already answers (`/health` says "loading", see `startup`). In a Jupyter kernel
launch() returns at once; elsewhere it returns once the model is ready. One server per port per
process: launching again on a port that one of ours holds stops that one first; launching the
same model again without a port (a notebook cell run twice) stops the server already serving it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import errno
import gc
import html
import http.client
import json
import os
import signal
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn

from ..types import Backend, JSONValue
from .access import Access, decide_access
from .backend_ref import SwappableBackend, backend_option_names, build_backend, is_backend
from .options import ServerOptions, option_names, suggest
from .share import close_share_links, open_share_link
from .startup import LoadingBackend, LoadingGate, LoadState

if TYPE_CHECKING:
    import openai
    from fastapi import FastAPI

_SERVERS: dict[int, Server] = {}
_FLUSH_S = 3.0  # after the grace period: time for cancelled answers to reach their clients
_TLS_CLOSE_S = 0.5  # at stop, a closed TLS connection gets this long to end before it is aborted
_REGISTRY_LOCK = threading.Lock()


# ----------------------------------------------------------------------------- sockets


def _bind(host: str, port: int | None) -> socket.socket:
    """A listening-ready socket on (host, port); port None or 0 picks a free one."""
    if port is not None and (not isinstance(port, int) or not 0 <= port <= 65535):
        raise ValueError(f"port must be an integer between 0 and 65535 (or None), got {port!r}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # rebind right after a stop()
    try:
        sock.bind((host, port or 0))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise OSError(exc.errno, f"port {port} on {host} is already in use by another "
                          "process: pass another port=, or port=None to pick a free one") from None
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", "", "::"):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def _get_json(host: str, port: int, path: str, timeout: float = 2.0,
              tls: bool = False) -> tuple[int, JSONValue]:
    """GET our own server's `path`; with `tls`, over HTTPS without checking the certificate
    (it is our own, possibly self-signed, possibly naming another host)."""
    if tls:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        conn: http.client.HTTPConnection = http.client.HTTPSConnection(
            host.strip("[]"), port, timeout=timeout, context=context)
    else:
        conn = http.client.HTTPConnection(host.strip("[]"), port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        body = resp.read()
        try:
            return resp.status, json.loads(body or b"null")
        except ValueError:
            return resp.status, None
    finally:
        conn.close()


# ----------------------------------------------------------------------------- the handle


class Server:
    """A running nbserve server: its URLs, its backend, `ready`/`wait()` (the model loads in
    the background), `update()` and `stop()`."""

    def __init__(self, app: FastAPI, ref: SwappableBackend, sock: socket.socket, host: str,
                 *, owned: bool, options: ServerOptions, share_url: str | None,
                 model: object, build_options: dict[str, Any], drain_s: float = 5.0,
                 load: LoadState | None = None, ui_password: str | None = None):
        self.app, self._ref, self._sock = app, ref, sock
        self._load = load or LoadState.loaded(ref.model_name)
        self._ui_password = ui_password
        self._loader: threading.Thread | None = None
        self._loop_ready = threading.Event()
        self._app_started = False  # the app's lifespan (and its UI's) has run
        self._announce_load = False  # print when the background load ends (launch(wait=False))
        self.host, self.port = host, sock.getsockname()[1]
        self.options = options
        scheme = "https" if options.tls else "http"
        self.url = f"{scheme}://{_url_host(host)}:{self.port}"
        self.api_base = self.url + "/v1"
        self.share_url = share_url
        self.api_keys = list(options.api_keys)
        self.ui = options.ui
        self._owned, self._model, self._build_options = owned, model, build_options
        self._model_key = _model_key(model)
        self._drain_s = drain_s
        self._stop_lock = threading.Lock()
        self._closing_since: dict[int, float] = {}  # TLS connections closing at stop (by id)
        self._stopped = False
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # uvicorn annotates timeout_graceful_shutdown as int; it waits with asyncio, seconds
        self._gate = LoadingGate(app, self._load, options.ui)
        config = uvicorn.Config(self._gate, log_level="warning",
                                access_log=False, lifespan="on",
                                timeout_graceful_shutdown=drain_s,  # type: ignore[arg-type]
                                ssl_certfile=options.ssl_certfile, ssl_keyfile=options.ssl_keyfile)
        self._uvicorn = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._run, name=f"nbserve-server-{self.port}",
                                        daemon=True)

    # ------------------------------------------------------------------ lifecycle

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        self._loop_ready.set()
        try:
            loop.run_until_complete(self._uvicorn.serve(sockets=[self._sock]))
        except BaseException as exc:  # noqa: BLE001 -- reported by _start
            self._error = exc
        finally:
            try:
                _cancel_leftover_tasks(loop)  # e.g. the UI queue's background loops
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.run_until_complete(loop.shutdown_default_executor())
            finally:
                loop.close()

    def _start(self, timeout: float) -> None:
        self._thread.start()
        deadline = time.monotonic() + timeout
        host = _url_host(self.host)
        while time.monotonic() < deadline:
            if not self._thread.is_alive():
                self.stop()
                raise RuntimeError(f"the server on port {self.port} failed to start: "
                                   f"{self._error or 'see the log above'}") from self._error
            if self._uvicorn.started:
                try:  # it answers (ready, or 503 while the model loads)
                    status, body = _get_json(host, self.port, "/health", tls=self.options.tls)
                    if status in (200, 503) and isinstance(body, dict):
                        return
                except OSError:
                    pass
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"the server on port {self.port} did not answer /health "
                           f"within {timeout:.0f} s")

    def _load_in_background(self, model: object, build: dict[str, Any]) -> None:
        """On a thread: build the backend of `model`; `_loaded` then serves it."""
        def run() -> None:
            try:
                backend, owned = build_backend(model, **build)
            except BaseException as exc:  # noqa: BLE001 -- surfaced by wait() and /health
                self._loaded(None, False, exc)
            else:
                self._loaded(backend, owned, None)

        self._loader = threading.Thread(target=run, name=f"nbserve-load-{self.port}",
                                        daemon=True)
        self._loader.start()

    def _start_app_once(self) -> None:
        """Mount the chat UI (built for the backend now served: it reads the context length)
        and run the app's startup, the first time a backend is there to serve."""
        if self._app_started:
            return
        if self.ui:
            self._mount_ui()
        self._on_loop(self._start_app())
        self._app_started = True

    def _mount_ui(self) -> None:
        """Mount the chat UI on the app; without gradio the UI is off (a warning) and the API
        serves, as `create_app` does."""
        try:
            from .ui import mount_ui
        except ImportError as exc:
            print(f"nbserve: WARNING: chat UI not mounted ({exc}); the API still works. "
                  "Install gradio, or pass ui=False to silence this.", flush=True)
            self.ui = self._gate.ui = False
            self.options = dataclasses.replace(self.options, ui=False)
            return
        mount_ui(self.app, self._ref, password=self._ui_password)  # the app's keys and limits

    async def _start_app(self) -> None:
        """Run the app's startup (its UI's too) on the server's loop."""
        if self.ui:
            from .ui import reset_ui

            reset_ui(self.app)  # a fresh stop event, bound to this loop
        await self._gate.lifespan.start()

    def _on_loop(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run `coro` on the server's loop (from another thread) and wait for it."""
        while not self._loop_ready.wait(0.1):
            if self._stopped:
                coro.close()
                raise RuntimeError("the server stopped before it started")
        assert self._loop is not None
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        while True:
            try:
                future.result(timeout=0.1)
                return
            except concurrent.futures.TimeoutError:
                if not self._thread.is_alive():
                    future.cancel()
                    raise RuntimeError("the server stopped before its app started") from None

    def _loaded(self, backend: Backend | None, owned: bool, error: BaseException | None) -> None:
        """The load ended: serve `backend` (with the UI and the app started), or report `error`;
        a server stopped meanwhile closes what was built."""
        with self._stop_lock:
            stopped = self._stopped
            if not stopped and backend is not None:
                self._ref.swap(backend, close_old=False)  # the placeholder: nothing to close
                self._owned = owned
        if stopped:
            if backend is not None and owned:
                backend.close()
            return
        if error is None:
            try:
                self._start_app_once()
            except BaseException as exc:  # noqa: BLE001 -- surfaced by wait() and /health
                error = exc
        with self._stop_lock:
            if not self._load.done:  # (a stop meanwhile has finished it)
                self._load.finish(error)
            announce = self._announce_load and not self._stopped
        if announce:
            print(self._load_line(), flush=True)

    def _load_line(self) -> str:
        """What a finished load prints in a notebook."""
        if self._load.error is not None:
            return (f"nbserve: loading {self._load.name} failed: {self._load.describe_error()};"
                    " srv.wait() raises it, srv.update(model) serves another model")
        return (f"nbserve: {self._ref.model_name} is ready at {self.url} (loaded in "
                f"{self._load.seconds or 0:.1f} s)")

    @property
    def ready(self) -> bool:
        """Whether the model has loaded and the server answers requests with it."""
        return self._load.ready and self.running

    def wait(self, timeout: float | None = None) -> Server:
        """Block until the model has loaded (at most `timeout` s: then TimeoutError) and return
        this server. Raises the load's own error if the load failed, RuntimeError if the
        server was stopped before it loaded."""
        if not self._load.wait(timeout):
            raise TimeoutError(f"the model {self._load.name!r} is still loading after "
                               f"{timeout:g} s")
        if self._load.error is not None:
            raise self._load.error
        loader = self._loader
        if loader is not None and loader is not threading.current_thread():
            loader.join()  # it ends right after finishing the load
        return self

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self._stopped

    def stop(self, timeout: float | None = None) -> None:
        """Stop serving: new requests get 503 at once, in-flight ones get up to `timeout` s
        (default: launch's `stop_timeout`, 5 s) to finish; the rest are then cancelled (streams
        end with a final chunk and [DONE], other answers return the text so far, both with a
        finish_reason). The port is freed, the engine closed, no thread left. Idempotent."""
        with self._stop_lock:
            if self._stopped:
                return
            self._stopped = True
            if not self._load.done:  # what was built is closed once the load ends
                self._load.finish(RuntimeError("this server was stopped before its model "
                                               f"{self._load.name!r} loaded"))
        with _REGISTRY_LOCK:
            if _SERVERS.get(self.port) is self:
                del _SERVERS[self.port]
        if self.share_url:
            close_share_links(self.port)
        if self._thread.is_alive():
            self._drain(self._drain_s if timeout is None else timeout)
            if self.ui and self._loop is not None:
                from .ui import stop_ui

                stop_ui(self.app, self._loop)  # end the UI heartbeats that hold shutdown
            # The requests are over: uvicorn only has to flush the last bytes and close.
            self._uvicorn.config.timeout_graceful_shutdown = _FLUSH_S  # type: ignore[assignment]
            self._uvicorn.should_exit = True
            self._join(_FLUSH_S + 10)
            if self._thread.is_alive():
                self._uvicorn.force_exit = True
                self._thread.join(10)
        self._sock.close()
        self._ref.close(close_current=self._owned)  # and drop it: the weights can be freed
        self._model, self._build_options = None, {}
        _free_memory()

    def _join(self, timeout: float) -> None:
        """Wait for the serving thread to end; with TLS, abort the connections uvicorn has
        closed meanwhile: asyncio ends a TLS connection only once the client answers its
        close_notify, which an idle keep-alive client never does, so uvicorn would wait out its
        grace (and log an error) at every stop."""
        deadline = time.monotonic() + timeout
        while self._thread.is_alive() and time.monotonic() < deadline:
            loop = self._loop
            if self.options.tls and loop is not None:
                try:
                    loop.call_soon_threadsafe(self._abort_closed_connections)
                except RuntimeError:
                    pass  # the loop has closed meanwhile
            self._thread.join(0.1)

    def _abort_closed_connections(self) -> None:
        """Abort the connections that have been closing for a while with nothing left to send
        (runs on the server's loop)."""
        now = time.monotonic()
        state = getattr(self._uvicorn, "server_state", None)
        for connection in list(getattr(state, "connections", ())):
            transport = getattr(connection, "transport", None)
            if transport is None or not transport.is_closing():
                continue
            since = self._closing_since.setdefault(id(transport), now)
            if now - since >= _TLS_CLOSE_S and not transport.get_write_buffer_size():
                transport.abort()

    def _drain(self, grace: float) -> None:
        """Refuse new generation requests (503), wait up to `grace` s for the running ones,
        then cancel what is left and wait (briefly) for those answers to end."""
        self.app.state.accepting = False
        deadline = time.monotonic() + max(0.0, grace)
        while self._ref.in_flight() and time.monotonic() < deadline:
            time.sleep(0.02)
        if not self._ref.in_flight():
            return
        cancelled = self._ref.cancel_all()
        if cancelled:
            print(f"nbserve: cancelled {cancelled} request(s) still running after the "
                  f"{grace:g} s grace period", flush=True)
        deadline = time.monotonic() + _FLUSH_S
        while self._ref.in_flight() and time.monotonic() < deadline:
            time.sleep(0.02)

    def update(self, model: object = None) -> Server:
        """Serve `model` (same kinds as `launch`) from now on, at the same URL.

        Requests already running finish on the old weights, which are then freed; new requests
        use the new ones. With no argument, rebuild from the model last given (a source is
        loaded again; a module in memory is taken again with its current weights).
        """
        if self._stopped:
            raise RuntimeError("this server is stopped: call nbserve.launch(...) again")
        self._load.wait()  # the first load first (a failed one is replaced here)
        source = self._model if model is None else model
        if model is None and is_backend(source):
            raise ValueError("update() needs a model: this server was given an engine, which "
                             "nbserve cannot rebuild")
        options = dict(self._build_options) if not is_backend(source) else {}
        new, owned = build_backend(source, **options)
        self._ref.swap(new, close_old=self._owned)
        self._owned, self._model, self._model_key = owned, source, _model_key(source)
        self._start_app_once()  # after a failed load, not done yet
        self._load.recover()
        print(f"nbserve: {self.url} now serves {new.model_name}", flush=True)
        return self

    # ------------------------------------------------------------------ access

    @property
    def backend(self) -> Backend:
        """The backend serving new requests (an Engine or a Pool); waits for the model to load
        (see `wait`)."""
        self.wait()
        return self._ref.current

    engine = backend

    @property
    def api_key(self) -> str | None:
        return self.api_keys[0] if self.api_keys else None

    def openai_client(self, **kwargs: Any) -> openai.OpenAI:
        """An `openai.OpenAI` client for this server (with its API key, if any), once the
        model has loaded (see `wait`)."""
        import openai

        self.wait()
        kwargs.setdefault("api_key", self.api_key or "nbserve")
        if self.options.tls and "http_client" not in kwargs:
            import httpx

            # trust this server's own certificate (self-signed or not) besides the system's CAs
            context = ssl.create_default_context()
            context.load_verify_locations(self.options.ssl_certfile)
            kwargs["http_client"] = httpx.Client(verify=context)
        return openai.OpenAI(base_url=self.api_base, **kwargs)

    def __enter__(self) -> Server:  # noqa: PYI034
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = self._state()
        share = f", share_url={self.share_url!r}" if self.share_url else ""
        return (f"Server({self._ref.model_name!r}, url={self.url!r}, api_base={self.api_base!r}"
                f"{share}, {state})")

    def _state(self) -> str:
        if not self.running:
            return "stopped"
        if not self._load.done:
            return "loading"
        return "load failed" if self._load.error is not None else "running"

    def _repr_html_(self) -> str:
        if not self.running:
            return f"<p>nbserve server on port {self.port} ({html.escape(self._ref.model_name)}"\
                   ") is stopped.</p>"
        links = [f'<a href="{self.url}" target="_blank">{self.url}</a>',
                 f"API base <code>{self.api_base}</code>"]
        if self.share_url:
            links.append(f'public <a href="{self.share_url}" target="_blank">{self.share_url}</a>')
        state = {"loading": " (loading&hellip;)", "load failed": " (load failed: see wait())"}
        head = (f"<div><b>nbserve</b> · <code>{html.escape(self._ref.model_name)}</code>"
                f"{state.get(self._state(), '')} · " + " · ".join(links) + "</div>")
        if not self.ui:
            return head
        src = self.share_url or self.url
        return head + (f'<iframe src="{src}" width="100%" height="620" '
                       'style="border:1px solid #ddd;border-radius:8px;margin-top:6px">'
                       "</iframe>")


def _cancel_leftover_tasks(loop: asyncio.AbstractEventLoop) -> None:
    tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for task in tasks:
        task.cancel()
    if tasks:
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))


def _free_memory() -> None:
    """Collect the stopped engine (it sits in reference cycles) and return cached CUDA blocks."""
    import sys

    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- launch / serve


_LAUNCH_OWN = ("port", "host", "share", "devices", "tokenizer", "startup_timeout",
               "stop_timeout", "wait", "options")


def split_launch_options(kwargs: dict[str, Any], options: ServerOptions | None = None,
                         devices: object = None) -> tuple[ServerOptions, dict[str, Any]]:
    """(the server options, the engine/loader options) of launch's other keywords; a keyword
    that is neither is a TypeError naming it (with the closest accepted name)."""
    if options is not None and not isinstance(options, ServerOptions):
        raise TypeError(f"options must be a nbserve.ServerOptions, got {type(options).__name__}")
    server_names = option_names()
    server = {k: v for k, v in kwargs.items() if k in server_names}
    engine = {k: v for k, v in kwargs.items() if k not in server_names}
    # (only when there are some: the engine's names import torch, seconds in a fresh kernel)
    engine_names = sorted(backend_option_names(devices) - set(_LAUNCH_OWN)) if engine else []
    unknown = [k for k in engine if k not in engine_names]
    if unknown:
        accepted = [*_LAUNCH_OWN, *server_names, *engine_names]
        named = ", ".join(f"{k!r}{suggest(k, accepted)}" for k in unknown)
        raise TypeError(f"launch() got unknown keyword argument{'s' * (len(unknown) > 1)} "
                        f"{named}. Launch options: {', '.join(_LAUNCH_OWN)}. Server options: "
                        f"{', '.join(server_names)}. Engine options: {', '.join(engine_names)}.")
    base = options or ServerOptions()
    return (dataclasses.replace(base, **server) if server else base), engine


def _model_key(model: object) -> tuple[str, str | int]:
    """What makes two launches serve "the same model": the same source (a path compared once
    resolved) or the same Python object."""
    if isinstance(model, (str, os.PathLike)):
        text = os.fspath(model)
        path = os.path.expanduser(text)
        return ("source", os.path.realpath(path) if os.path.exists(path) else text.strip())
    return ("object", id(model))


def _stop_earlier(port: int | None, model: object) -> None:
    """Stop our server on `port`; with no port, the one serving `model` (a cell run again)."""
    key = _model_key(model)
    with _REGISTRY_LOCK:
        if port:
            earlier = [s for p, s in _SERVERS.items() if p == port]
        else:
            earlier = [s for s in _SERVERS.values() if s._model_key == key]
    for server in earlier:
        if port:
            print(f"nbserve: stopping the previous server on port {port}", flush=True)
        else:
            print(f"nbserve: stopping the previous server of {server._ref.model_name} on port "
                  f"{server.port} (pass port= to keep both)", flush=True)
        server.stop()


def launch(model: object = "smollm2", *, port: int | None = None, host: str = "127.0.0.1",
           share: bool = False, devices: object = None, tokenizer: object = None,
           startup_timeout: float = 120.0, stop_timeout: float = 5.0, wait: bool | None = None,
           options: ServerOptions | None = None, **kwargs: Any) -> Server:
    """Serve `model` (a source like "smollm2", a HF dir or .gguf; a LoadedModel; or an
    Engine/Pool, served as is) on http://host:port (https:// with a certificate): OpenAI API
    under /v1, chat UI at /.

    The server answers at once; the model loads on a background thread (until it is ready,
    /health and the API answer 503 "loading" and the UI shows a loading page). `wait`: return
    only once the model is ready (raising the load's error if it fails); the default is
    False in a Jupyter kernel (the cell returns at once: `srv.ready`, `srv.wait()`; `srv.engine`
    and `srv.openai_client()` wait for the model) and True elsewhere (a script, `serve`).
    `startup_timeout` bounds the server's start, not the load. `port=None` picks a free port,
    and stops the server
    of ours already serving the same model (the same source or object: a cell run again); a
    port held by one of our servers is taken over (that server is stopped first).
    `stop_timeout`: seconds running requests get to finish when the server stops (stop() or
    SIGTERM under `serve`).
    Other keywords are server options (`ServerOptions`: api_keys, ui, cors_origins, limits,
    rate_limit_per_minute, log_messages, accept_unknown_fields, ui_password, ssl_certfile,
    ssl_keyfile; or `options=` a record) or
    go to `Engine` and the loader (e.g. max_batch, max_context, dtype, queue_timeout,
    max_backlog, restart_on_failure). An unknown keyword is a TypeError naming it.
    `api_keys` protect /v1 and the UI; `share=True` without them generates one (printed once).
    `ui_password`: the UI (and its gradio API) also accepts this password at its login.
    """
    if not isinstance(stop_timeout, (int, float)) or stop_timeout < 0:
        raise ValueError(f"stop_timeout must be a number of seconds >= 0, got {stop_timeout!r}")
    opts, engine_options = split_launch_options(kwargs, options, devices)
    if share and opts.tls:
        raise ValueError("share=True cannot be used with TLS (ssl_certfile): the share tunnel "
                         "speaks plain HTTP to the local port; its public link is HTTPS already")
    access = decide_access(share=share, api_keys=list(opts.api_keys),
                           ui_password=opts.ui_password, ui=opts.ui)
    opts = dataclasses.replace(opts, api_keys=tuple(access.api_keys))
    if wait is None:
        wait = not in_jupyter_kernel()
    _stop_earlier(port, model)
    sock = _bind(host, port)
    build = dict(devices=devices, tokenizer=tokenizer, **engine_options)
    load = LoadState(_source_name(model))
    ref = SwappableBackend(LoadingBackend(load))
    try:
        share_url = None
        if share:
            share_url, why = open_share_link(sock.getsockname()[1])
            if share_url is None:
                print(f"nbserve: WARNING: could not create a share link ({why}); the server is "
                      "only reachable locally", flush=True)
        from .app import create_app

        app = create_app(ref, options=dataclasses.replace(opts, ui=False))  # the UI: later
        server = Server(app, ref, sock, host, owned=False, options=opts,
                        share_url=share_url, model=model,
                        build_options={k: v for k, v in build.items() if v is not None},
                        drain_s=float(stop_timeout), load=load, ui_password=access.ui_password)
    except BaseException:
        sock.close()
        raise
    try:
        server._start(startup_timeout)
        server._load_in_background(model, build)
        if wait:
            server.wait()
        _announce(server, share_url, access)
    except BaseException:  # Ctrl-C while starting, loading or announcing, a failed start or
        server.stop()      # load: leave nothing running
        raise
    return server


def in_jupyter_kernel() -> bool:
    """Whether this code runs in a Jupyter kernel (a notebook, JupyterLab, Colab, VS Code)."""
    ipython, zmqshell = sys.modules.get("IPython"), sys.modules.get("ipykernel.zmqshell")
    if ipython is None or zmqshell is None:
        return False
    return isinstance(ipython.get_ipython(), zmqshell.ZMQInteractiveShell)


def _source_name(model: object) -> str:
    """What to call a model before it has loaded: its source as given, or its type."""
    if isinstance(model, (str, os.PathLike)):
        return os.fspath(model)
    # not imported here (it imports torch: seconds in a fresh kernel); a LoadedModel exists
    # only once its module has been imported
    models = sys.modules.get("nbserve.models.base")
    if models is not None and isinstance(model, models.LoadedModel):
        return str(model.name)
    if is_backend(model):
        return str(model.model_name)
    return type(model).__name__


def _announce(server: Server, share_url: str | None, access: Access) -> None:
    """Register a started server and print where it is (and its key, once); while its model
    loads, say so (the load prints a line when it ends)."""
    with _REGISTRY_LOCK:
        others = sorted(_SERVERS)
        _SERVERS[server.port] = server
    with server._stop_lock:  # the load's own line comes after this one
        loading = not server._load.done
        server._announce_load = loading
        what = server._ref.model_name if server._load.ready else \
            f"loading {server._ref.model_name}"
        line = f"nbserve: {what} at {server.url} · OpenAI API base {server.api_base}"
        line += " (UI at /)" if server.ui else ""
        if loading:
            line += "; the API answers 503 until it is ready (srv.wait() waits for it)"
        print(line, flush=True)
        if server._load.done and not server._load.ready:
            print(server._load_line(), flush=True)
    if share_url:
        print(f"nbserve: public link {share_url}", flush=True)
    if access.generated_key:
        where = "/v1 and the chat UI (login: any user name, the key as password)" \
            if server.ui else "/v1"
        print(f"nbserve: the key for {where}, shown once: {access.generated_key}", flush=True)
    if others:
        print(f"nbserve: note: other servers of this process still run on port(s) "
              f"{', '.join(map(str, others))}; stop() them to free their memory, or pass "
              "port= to replace one", flush=True)


def running_servers() -> list[Server]:
    """The servers launched in this process that are still running."""
    with _REGISTRY_LOCK:
        return list(_SERVERS.values())


def stop_all() -> None:
    """Stop every server launched in this process."""
    for server in running_servers():
        server.stop()


def serve(model: object = "smollm2", **kwargs: Any) -> None:
    """`launch(...)` and block until Ctrl-C (or SIGTERM), then stop cleanly: new requests get
    503, running ones get `stop_timeout` s to finish, the rest are cancelled."""
    earlier = {id(s) for s in running_servers()}
    restore = _take_stop_signals()
    try:
        server = launch(model, **{"wait": True, **kwargs})
        print("nbserve: press Ctrl-C to stop", flush=True)
        while server.running:
            # Not server._thread.join(0.5): a KeyboardInterrupt inside join() makes CPython
            # mark the thread as stopped while it still runs, so stop() would not drain it.
            time.sleep(0.5)
    except KeyboardInterrupt:
        print("\nnbserve: stopping", flush=True)
    finally:
        # every server this call started, wherever a Ctrl-C landed (even between launch()
        # returning and the name being bound): one left running keeps the process alive
        for started in running_servers():
            if id(started) not in earlier:
                started.stop()
        restore()


def _take_stop_signals() -> Callable[[], None]:
    """Make SIGINT and SIGTERM raise KeyboardInterrupt in the main thread while serve() runs,
    and return what puts the earlier handlers back. SIGINT is taken only where Python would
    not raise on it: a background job of a script inherits it ignored, and `kill -INT` must
    still stop the server (as it stops uvicorn's and llama.cpp's); a handler someone
    installed (a notebook kernel's) is left alone. A second SIGTERM must not break the drain;
    a second Ctrl-C can."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None  # signals reach only the main thread; the caller handles them
    terminating = False

    def on_term(signum: int, frame: FrameType | None) -> None:
        nonlocal terminating
        if not terminating:
            terminating = True
            raise KeyboardInterrupt

    previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, on_term)}
    if signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, signal.SIG_DFL, None):
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)

    def restore() -> None:
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
    return restore
