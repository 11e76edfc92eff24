"""The `Server` handle: the app on uvicorn in a background thread, its start, background load,
`update()`, drain and stop; and the registry of the servers this process runs.

The server runs on its own asyncio loop in a daemon thread, so it works inside a Jupyter kernel
(whose loop is already running) and never blocks the cell; the model loads on another thread
while the server already answers (`/health` says "loading", see `startup`). `launch` builds one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import errno
import html
import http.client
import json
import os
import socket
import ssl
import threading
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

import uvicorn

from ..api.auth import KeyAuth
from ..types import Backend, JSONValue, ModelEntry
from .backend_ref import SwappableBackend, build_backend, free_memory, is_backend
from .model_set import ModelSet
from .options import ServerOptions
from .share import close_share_links
from .startup import LoadingGate, LoadState

if TYPE_CHECKING:
    import openai
    from fastapi import FastAPI

_FLUSH_S = 3.0  # after the grace period: time for cancelled answers to reach their clients
_TLS_CLOSE_S = 0.5  # at stop, a closed TLS connection gets this long to end before it is aborted


# ----------------------------------------------------------------------------- sockets


def bind(host: str, port: int | None) -> socket.socket:
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
                 load: LoadState | None = None, ui_password: str | None = None,
                 models: ModelSet | None = None):
        self.app, self._ref, self._sock = app, ref, sock
        self._load = load or LoadState.loaded(ref.model_name)
        # the chat UI, built once the model serves (after the load: with no load, none)
        self._ui_state = LoadState("the chat UI") if options.ui and load is not None else \
            LoadState.loaded("the chat UI")
        self._ui_password = ui_password
        self._models = models
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
        self.model_key = model_key(model)
        self._drain_s = drain_s
        self._stop_lock = threading.Lock()
        self._closing_since: dict[int, float] = {}  # TLS connections closing at stop (by id)
        self._stopped = False
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # uvicorn annotates timeout_graceful_shutdown as int; it waits with asyncio, seconds
        self._gate = LoadingGate(app, self._load, options.ui,
                                 KeyAuth(options.api_keys) if options.api_keys else None,
                                 ui_state=self._ui_state)
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
        """Run the app's startup, the first time a backend is there to serve (the chat UI is
        built afterwards, `_build_ui_once`: the API does not wait for gradio)."""
        if self._app_started:
            return
        self._on_loop(self._gate.lifespan.start())
        self._app_started = True

    def _build_ui_once(self) -> None:
        """Build the chat UI for the backend now served (it reads the context length), mount
        it and run its startup, once; a failure leaves the API serving and the UI's paths
        saying why (a warning). Without gradio the UI is off, as `create_app` does."""
        if self._ui_state.done:
            return
        try:
            if self.ui:
                self._mount_ui()
        except BaseException as exc:  # noqa: BLE001 -- the API serves on without it
            if not self._stopped:
                print(f"nbserve: WARNING: the chat UI failed to start ({type(exc).__name__}: "
                      f"{exc}); the OpenAI API under /v1 serves", flush=True)
            with self._stop_lock:
                if not self._ui_state.done:  # (a stop meanwhile has finished it)
                    self._ui_state.finish(exc)
        else:
            with self._stop_lock:
                if not self._ui_state.done:
                    self._ui_state.finish(None)

    def _mount_ui(self) -> None:
        """Mount the chat UI on the running app and start it."""
        try:
            from .ui import mount_ui_late, reset_ui
        except ImportError as exc:
            print(f"nbserve: WARNING: chat UI not mounted ({exc}); the API still works. "
                  "Install gradio, or pass ui=False to silence this.", flush=True)
            self.ui = self._gate.ui = False
            self.options = dataclasses.replace(self.options, ui=False)
            return
        # the app's keys and limits
        self._gate.ui_lifespan.app = mount_ui_late(self.app, self._ref,
                                                   password=self._ui_password)

        async def start() -> None:
            reset_ui(self.app)  # a fresh stop event, bound to this loop
            await self._gate.ui_lifespan.start()

        self._on_loop(start())

    def _on_loop(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run `coro` on the server's loop (from another thread) and wait for it."""
        while not self._loop_ready.wait(0.1):
            if self._stopped:
                coro.close()
                raise RuntimeError("the server stopped before it started")
        assert self._loop is not None
        try:
            future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        except RuntimeError:  # its loop has closed: the server stopped
            coro.close()
            raise
        while True:
            try:
                future.result(timeout=0.1)
                return
            except concurrent.futures.TimeoutError:
                if not self._thread.is_alive():
                    future.cancel()
                    raise RuntimeError("the server stopped before its app started") from None

    def _loaded(self, backend: Backend | None, owned: bool, error: BaseException | None) -> None:
        """The load ended: serve `backend` (the app started), then build the chat UI for it;
        or report `error`. A server stopped meanwhile closes what was built."""
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
        if error is None:
            self._build_ui_once()
        with self._stop_lock:
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
        """Block until the model has loaded and the chat UI is built (at most `timeout` s: then
        TimeoutError) and return this server. Raises the load's own error if the load failed,
        RuntimeError if the server was stopped before it loaded; a chat UI that failed to
        start is a warning (the API serves)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._wait_model(timeout)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not self._ui_state.wait(left):
            raise TimeoutError(f"the chat UI of {self._load.name!r} is still starting after "
                               f"{timeout:g} s (the API serves)")
        loader = self._loader
        if loader is not None and loader is not threading.current_thread():
            loader.join()  # it ends right after building the UI
        return self

    def _wait_model(self, timeout: float | None = None) -> None:
        """Block until the model has loaded and the API serves it (see `wait`)."""
        if not self._load.wait(timeout):
            raise TimeoutError(f"the model {self._load.name!r} is still loading after "
                               f"{timeout:g} s")
        if self._load.error is not None:
            raise self._load.error

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
            if not self._ui_state.done:
                self._ui_state.finish(RuntimeError("this server was stopped before its chat "
                                                   "UI was built"))
        SERVERS.remove(self)
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
        if self._models is not None:
            self._models.close()
        self._ref.close(close_current=self._owned)  # and drop it: the weights can be freed
        self._model, self._build_options = None, {}
        free_memory()

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

    def update(self, model: object = None, *, name: str | None = None) -> Server:
        """Serve `model` (same kinds as `launch`) from now on, at the same URL.

        Requests already running finish on the old weights, which are then freed; new requests
        use the new ones. With no argument, rebuild from the model last given (a source is
        loaded again; a module in memory is taken again with its current weights). `name`:
        update that one of the server's several models instead of the default.
        """
        if self._stopped:
            raise RuntimeError("this server is stopped: call nbserve.launch(...) again")
        if name is not None and self._models is not None and \
                self._models.loaded(name) is not self._ref:
            self._models.update(name, model)
            print(f"nbserve: {self.url} now serves {name!r} from new weights", flush=True)
            return self
        self._load.wait()  # the first load first (a failed one is replaced here)
        source = self._model if model is None else model
        if model is None and is_backend(source):
            raise ValueError("update() needs a model: this server was given an engine, which "
                             "nbserve cannot rebuild")
        options = dict(self._build_options) if not is_backend(source) else {}
        new, owned = build_backend(source, **options)
        self._ref.swap(new, close_old=self._owned)
        self._owned, self._model, self.model_key = owned, source, model_key(source)
        self._start_app_once()  # after a failed load, not done yet
        self._load.recover()
        self._build_ui_once()
        print(f"nbserve: {self.url} now serves {new.model_name}", flush=True)
        return self

    # ------------------------------------------------------------------ several models

    def _model_set(self) -> ModelSet:
        if self._models is None or self._stopped:
            raise RuntimeError("this server is stopped: call nbserve.launch(...) again")
        return self._models

    @property
    def models(self) -> list[ModelEntry]:
        """Every model this server serves, with its state (loaded, loading, unloaded,
        failed), the default first."""
        if self._models is None:
            return [ModelEntry(self._ref.model_name, "loaded", default=True)]
        return self._models.entries()

    def add(self, name: str, model: object, *, load: bool = False) -> Server:
        """Serve `model` (any source `launch` takes) as `name` too, loaded on the first
        request that names it (or now, with `load=True`)."""
        self._model_set().add(name, model, load=load)
        return self

    def add_adapter(self, base: str | None, name: str, path: str) -> Server:
        """Serve the PEFT LoRA adapter at `path` on the model `base` (None: the default) as
        "base:name" (requests name it in `model`; listed in /v1/models). Refused with a
        ValueError naming the mismatch where it does not fit a loaded base; for a base not
        loaded yet, checked when it is first used."""
        self._model_set().add_adapter(base, name, path)
        return self

    def remove(self, name: str) -> Server:
        """Stop serving the model `name` (not the default): its running requests finish, then
        its memory is given back."""
        self._model_set().remove(name)
        return self

    def unload(self, name: str) -> bool:
        """Unload the model `name` (it loads again on its next request); whether it was
        loaded."""
        return self._model_set().unload(name)

    # ------------------------------------------------------------------ access

    @property
    def backend(self) -> Backend:
        """The backend serving new requests (an Engine or a Pool); waits for the model to load
        (see `wait`)."""
        self._wait_model()
        return self._ref.current

    engine = backend

    @property
    def api_key(self) -> str | None:
        return self.api_keys[0] if self.api_keys else None

    def openai_client(self, **kwargs: Any) -> openai.OpenAI:
        """An `openai.OpenAI` client for this server (with its API key, if any), once the
        model has loaded (see `wait`)."""
        import openai

        self._wait_model()
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


def model_key(model: object) -> tuple[str, str | int]:
    """What makes two launches serve "the same model": the same source (a path compared once
    resolved) or the same Python object."""
    if isinstance(model, (str, os.PathLike)):
        text = os.fspath(model)
        path = os.path.expanduser(text)
        return ("source", os.path.realpath(path) if os.path.exists(path) else text.strip())
    return ("object", id(model))


class Registry:
    """The servers this process runs, by port: one server a port, found again by its port or
    by the model it serves (a notebook cell run twice)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._servers: dict[int, Server] = {}

    def add(self, server: Server) -> list[int]:
        """Register `server`; the ports of the others still running."""
        with self._lock:
            others = sorted(self._servers)
            self._servers[server.port] = server
        return others

    def remove(self, server: Server) -> None:
        with self._lock:
            if self._servers.get(server.port) is server:
                del self._servers[server.port]

    def on_port(self, port: int) -> list[Server]:
        with self._lock:
            return [s for p, s in self._servers.items() if p == port]

    def serving(self, model: object) -> list[Server]:
        """The servers whose model is `model` (the same source, or the same object)."""
        key = model_key(model)
        with self._lock:
            return [s for s in self._servers.values() if s.model_key == key]

    def all(self) -> list[Server]:
        with self._lock:
            return list(self._servers.values())


SERVERS = Registry()
