"""The model loading in the background while the server already answers (as llama-server does).

`launch()` in a notebook binds its port and serves at once; the model loads on a thread, the
API serves it as soon as it is loaded, then the chat UI is built for it (importing gradio takes
seconds that the API does not wait for). Until the model is ready, `LoadingBackend` stands in
for it (`/health` says "loading", then "error" if the load failed, both with 503) and
`LoadingGate` answers the API routes with an OpenAI-style 503; until the chat is built, its
paths answer a page that reloads itself (or a 503 error for other requests). The app's own
lifespan runs once the model is served, the chat's once it is built (`AppLifespan` each).
"""

from __future__ import annotations

import asyncio
import html
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import HTMLResponse, JSONResponse
from starlette.routing import Match, Mount
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..api.auth import KeyAuth
from ..api.errors import APIError
from ..types import BackendDefaults, EngineStoppedError, Event, JSONObject, Request
from .app import ERROR_SHAPES

OPEN_PATHS = frozenset({"/health", "/stats", "/metrics"})  # answered while loading
RETRY_AFTER_S = 2  # what a 503 "loading" asks clients to wait before retrying


class LoadState:
    """Where the load of a server's model stands: loading, ready, or failed (with its error)."""

    def __init__(self, name: str):
        self.name = name  # what is loading: the source as given, until the model names itself
        self.error: BaseException | None = None
        self.seconds: float | None = None  # how long the load took, once done
        self._started = time.monotonic()
        self._done = threading.Event()

    @classmethod
    def loaded(cls, name: str) -> LoadState:
        """The state of a server given a backend that already serves (nothing to load)."""
        state = cls(name)
        state.finish(None)
        return state

    def finish(self, error: BaseException | None) -> None:
        """Mark the load done: ready when `error` is None, failed otherwise."""
        self.error = error
        self.seconds = time.monotonic() - self._started
        self._done.set()

    def recover(self) -> None:
        """A model was served after a failed load (`Server.update`): ready from now on."""
        self.error = None
        self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def ready(self) -> bool:
        return self._done.is_set() and self.error is None

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the load is done (or `timeout` s pass); whether it is done."""
        return self._done.wait(timeout)

    def describe_error(self) -> str:
        err = self.error
        return f"{type(err).__name__}: {err}" if err is not None else ""


class LoadingBackend(BackendDefaults):
    """Stands in for the model while it loads (and after a failed load): a Backend whose
    health says "loading" or "error" and which refuses requests."""

    def __init__(self, state: LoadState):
        self.state = state

    @property
    def model_name(self) -> str:
        return self.state.name

    def _why(self) -> str:
        if self.state.error is not None:
            return f"the model {self.state.name!r} failed to load ({self.state.describe_error()})"
        return f"the model {self.state.name!r} is still loading; retry in a moment"

    async def generate(self, request: Request) -> AsyncIterator[Event]:
        raise EngineStoppedError(self._why())
        yield  # an async generator, like an Engine's

    def stats(self) -> JSONObject:
        failed = self.state.error is not None
        return {"running": 0, "waiting": 0, "loading": not failed,
                **({"load_error": self.state.describe_error()} if failed else {})}

    def health(self) -> JSONObject:
        if self.state.error is not None:
            return {"ready": False, "status": "error", "model": self.state.name,
                    "detail": f"loading failed: {self.state.describe_error()}"}
        return {"ready": False, "status": "loading", "model": self.state.name}

    def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"LoadingBackend({self.state.name!r})"


class LoadingGate:
    """ASGI wrapper of the app: until the model is ready, its API routes (every route of the
    app but /health, /stats, /metrics and the API docs) answer 503 with an OpenAI-style error
    body and /health answers 503 "loading" (or "error"). Until the chat UI (mounted at / once
    built, `ui_state`) is there, its paths (every path no route of the app serves) answer: the
    page (GET /) a "loading" or "starting" page that reloads itself, other requests a 503
    error. Then it steps aside. With `keys`, an API request without a valid one goes to the
    app, whose key check answers 401 as it does once ready: the load's state and error are for
    key holders only."""

    def __init__(self, app: FastAPI, state: LoadState, ui: bool, keys: KeyAuth | None = None,
                 ui_state: LoadState | None = None):
        self.app, self.state, self.ui, self.keys = app, state, ui, keys
        self.ui_state = ui_state or LoadState.loaded("the chat UI")
        self.lifespan = AppLifespan(app)
        self.ui_lifespan = AppLifespan(_no_app)  # its app is the chat's, once built
        docs = (app.openapi_url, app.docs_url, app.redoc_url, app.swagger_ui_oauth2_redirect_url)
        self._open = OPEN_PATHS | {url for url in docs if url}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._server_lifespan(receive, send)
            return
        if scope["type"] != "http" or (self.state.ready and self._ui_served()):
            await self.app(scope, receive, send)
            return
        if self.state.ready:  # the model serves; the chat UI does not yet
            if self._is_ui_path(scope):
                await self._ui_not_there(scope, send)
            else:
                await self.app(scope, receive, send)
            return
        if scope["path"] == "/health":  # not ready while the API refuses
            body = LoadingBackend(self.state).health()
            await JSONResponse(body, status_code=503)(scope, _no_receive, send)
        elif self._is_api(scope):
            if self._keyed_out(scope):  # the app checks the key before any handler: 401
                await self.app(scope, receive, send)
            else:
                await self._refuse(scope, send)
        elif self.ui and self._is_ui_path(scope):
            await self._ui_not_there(scope, send)
        else:
            await self.app(scope, receive, send)

    def _ui_served(self) -> bool:
        """Whether the chat UI's paths go to the app: it is built, or there is none."""
        return not self.ui or self.ui_state.ready

    async def _server_lifespan(self, receive: Receive, send: Send) -> None:
        """The server's lifespan: it starts at once (the app's own starts with `lifespan.start`,
        once the UI is built) and ends the app's at shutdown."""
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                try:
                    await self.ui_lifespan.stop()
                    await self.lifespan.stop()
                except Exception as exc:  # noqa: BLE001 -- reported to the server
                    await send({"type": "lifespan.shutdown.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.shutdown.complete"})
                return

    def _keyed_out(self, scope: Scope) -> bool:
        """Whether keys are required and the request has none of them."""
        if not self.keys:
            return False
        try:
            self.keys.check(HTTPRequest(scope))
        except APIError:
            return True
        return False

    def _is_api(self, scope: Scope) -> bool:
        if scope["path"] in self._open:
            return False
        return self._routed(scope)

    def _is_ui_path(self, scope: Scope) -> bool:
        """A path the chat UI (mounted at /) would serve: none of the app's own routes does."""
        return scope["path"] not in self._open and not self._routed(scope)

    def _routed(self, scope: Scope) -> bool:
        return any(not isinstance(route, Mount) and route.matches(scope)[0] != Match.NONE
                   for route in self.app.routes)

    async def _refuse(self, scope: Scope, send: Send) -> None:
        if self.state.error is not None:
            err = APIError(503, f"The model {self.state.name!r} failed to load: "
                           f"{self.state.describe_error()}. Serve another with srv.update(model) "
                           "or launch again.", "service_unavailable", None, "model_load_failed")
        else:
            err = APIError(503, f"The model {self.state.name!r} is still loading; retry in a "
                           "moment (GET /health answers 200 once it is ready).",
                           "service_unavailable", None, "model_loading",
                           {"Retry-After": str(RETRY_AFTER_S)})
        await ERROR_SHAPES.response(err, scope["path"])(scope, _no_receive, send)

    async def _ui_not_there(self, scope: Scope, send: Send) -> None:
        """A chat UI path before the chat is built: its page says why (and reloads itself
        while that may change); any other request gets a 503 error saying the same."""
        if scope["path"] == "/" and scope.get("method") in ("GET", "HEAD"):
            await self._loading_page(scope, send)
            return
        if not self.state.ready:
            text = (f"The model {self.state.name!r} failed to load, so the chat UI is not "
                    "served" if self.state.error is not None else
                    f"The model {self.state.name!r} is still loading; the chat UI opens once "
                    "it is ready")
        elif self.ui_state.error is not None:
            text = ("The chat UI failed to start (see the server's log); the OpenAI API "
                    "under /v1 serves")
        else:
            text = "The chat UI is starting; retry in a moment (the OpenAI API under /v1 serves)"
        retry = {} if self.state.error or self.ui_state.error else \
            {"Retry-After": str(RETRY_AFTER_S)}
        err = APIError(503, text + ".", "service_unavailable", None, "ui_not_ready", retry)
        await err.response()(scope, _no_receive, send)

    async def _loading_page(self, scope: Scope, send: Send) -> None:
        name = html.escape(self.state.name)
        refresh = f'<meta http-equiv="refresh" content="{RETRY_AFTER_S}">'
        if self.state.error is not None:
            text = (f"Loading {name} failed: {html.escape(self.state.describe_error())}. "
                    "Serve another model with <code>srv.update(model)</code>.")
            refresh = ""
        elif not self.state.ready:
            text = f"Loading {name}&hellip; the chat opens here once the model is ready."
        elif self.ui_state.error is not None:
            text = (f"The chat UI failed to start: {html.escape(self.ui_state.describe_error())}."
                    " The OpenAI API under <code>/v1</code> serves.")
            refresh = ""
        else:
            text = (f"{name} is ready; the chat UI is starting&hellip; it opens here in a "
                    "moment (the OpenAI API under <code>/v1</code> already serves).")
        page = (f"<!doctype html><html><head><title>nbserve · loading</title>{refresh}</head>"
                f'<body style="font-family:sans-serif;margin:2em"><h2>nbserve</h2>'
                f'<p id="nbserve-loading">{text}</p></body></html>')
        await HTMLResponse(page, status_code=503)(scope, _no_receive, send)


class AppLifespan:
    """Runs an ASGI app's lifespan on demand: `start()` once its parts are ready (a UI mounted
    after the server started), `stop()` when the server shuts down. Both run on the server's
    loop; `stop()` waits for a `start()` in progress, and a `start()` after `stop()` fails."""

    def __init__(self, app: ASGIApp):
        self.app = app
        self._inbox: asyncio.Queue[Message] | None = None
        self._outbox: asyncio.Queue[Message] | None = None
        self._task: asyncio.Future[None] | None = None
        self._lock: asyncio.Lock | None = None
        self._stopped = False

    def _locked(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    async def start(self) -> None:
        async with self._locked():
            if self._stopped:
                raise RuntimeError("the server is shutting down")
            inbox: asyncio.Queue[Message] = asyncio.Queue()
            outbox: asyncio.Queue[Message] = asyncio.Queue()
            self._inbox, self._outbox = inbox, outbox
            scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"},
                     "state": {}}
            self._task = asyncio.ensure_future(self.app(scope, inbox.get, outbox.put))
            await inbox.put({"type": "lifespan.startup"})
            reply = await _first(outbox, self._task)
            if reply.get("type") != "lifespan.startup.complete":
                raise RuntimeError(f"the app failed to start: {reply.get('message', reply)}")

    async def stop(self) -> None:
        async with self._locked():
            self._stopped = True
            task, inbox, outbox = self._task, self._inbox, self._outbox
            if task is None or task.done() or inbox is None or outbox is None:
                return
            await inbox.put({"type": "lifespan.shutdown"})
            reply = await _first(outbox, task)
            await task
            if reply.get("type") != "lifespan.shutdown.complete":
                raise RuntimeError(f"the app failed to shut down: {reply.get('message', reply)}")


async def _first(outbox: asyncio.Queue[Message], task: asyncio.Future[None]) -> Message:
    """The app's next lifespan message, or what its task ended with (an error) first."""
    get = asyncio.ensure_future(outbox.get())
    either: set[asyncio.Future[Any]] = {get, task}
    await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    if get.done():
        return get.result()
    get.cancel()
    error = task.exception()
    return {"type": "failed", "message": f"{type(error).__name__}: {error}" if error else
            "its lifespan ended without an answer"}


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}


async def _no_app(scope: Scope, receive: Receive, send: Send) -> None:
    """An app with nothing to start: `LoadingGate.ui_lifespan`'s until the chat is built."""
    raise RuntimeError("the chat UI is not built")
