"""Run an ASGI app under a real uvicorn server on a free loopback port, in a daemon thread.

    with running_server(app) as base_url:
        httpx.get(base_url + "/health")
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn


class ThreadedServer:
    """uvicorn.Server with its own event loop in a daemon thread (no signal handlers)."""

    def __init__(self, app: Any, host: str = "127.0.0.1", **config: Any):
        # IPPROTO_TCP (not 0): asyncio sets TCP_NODELAY on accepted connections only for
        # sockets that say they are TCP; without it Nagle + delayed ACKs stall SSE by ~40 ms.
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, 0))  # our own bind: "port in use" is an OSError here, not exit
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        config.setdefault("log_level", "warning")
        config.setdefault("timeout_graceful_shutdown", 2)
        self.server = uvicorn.Server(uvicorn.Config(app, lifespan="on", **config))
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True,
                                       name=f"test-server-{self.port}")

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self.server.serve(sockets=[self.sock]))
        except BaseException as exc:  # noqa: BLE001 - reported by start()
            self.error = exc
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    def start(self, timeout: float = 20.0) -> str:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"test server did not start: {self.error!r}")
            time.sleep(0.01)
        return self.url

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        if self.thread.is_alive():
            self.server.force_exit = True
            self.thread.join(timeout)
        self.sock.close()


@contextlib.contextmanager
def running_server(app: Any, **config: Any) -> Iterator[str]:
    """Serve `app` for the duration of the block; yields its base URL."""
    srv = ThreadedServer(app, **config)
    url = srv.start()
    try:
        yield url
    finally:
        srv.stop()


@contextlib.contextmanager
def small_send_buffers(backend: Any, size: int = 16384) -> Iterator[str]:
    """Serve `backend` with SO_SNDBUF pinned on the listening socket (accepted sockets inherit
    it): loopback would otherwise autotune the buffers to megabytes and absorb a whole stream
    that nobody reads, as no real network path does."""
    from nbserve.server import create_app

    srv = ThreadedServer(create_app(backend, ui=False))
    srv.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
    url = srv.start()
    try:
        yield url
    finally:
        srv.stop()


def non_reading_stream(url: str, body: dict[str, Any],
                       path: str = "/v1/chat/completions") -> socket.socket:
    """Send a streaming request on a socket with a tiny receive buffer and read nothing."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    data = json.dumps(body).encode()
    sock.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: "
                 b"application/json\r\nContent-Length: " + str(len(data)).encode() +
                 b"\r\n\r\n" + data)
    return sock


def read_all(sock: socket.socket, timeout: float = 10) -> str:
    """What a `non_reading_stream` socket received, once its client wakes up and reads, until
    [DONE] or `timeout` s of silence."""
    sock.settimeout(timeout)
    chunks = []
    while True:
        try:
            data = sock.recv(65536)
        except TimeoutError:
            break
        if not data:
            break
        chunks.append(data)
        if b"data: [DONE]" in data[-64:]:
            break
    return b"".join(chunks).decode(errors="replace")


def wait_until(predicate: Any, timeout: float = 1.0, interval: float = 0.02) -> bool:
    """Poll `predicate()` until it is truthy or `timeout` passes; return its last result."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result or time.monotonic() > deadline:
            return bool(result)
        time.sleep(interval)


# ----------------------------------------------------------------------------- engines


def make_engine(model_dir: Any, **options: Any) -> Any:
    """A real Engine over a tiny HF model directory (max_batch 8, context 256 by default)."""
    from nbserve.engine import Engine
    from nbserve.loading.hf_dir import load_hf_dir

    options.setdefault("max_batch", 8)
    options.setdefault("max_context", 256)
    return Engine(load_hf_dir(model_dir), quiet=True, **options)


@contextlib.contextmanager
def engine_running(model_dir: Any, **options: Any) -> Iterator[Any]:
    """`make_engine` for the duration of the block (closed at the end)."""
    engine = make_engine(model_dir, **options)
    try:
        yield engine
    finally:
        engine.close()


@contextlib.contextmanager
def app_running(backend: Any, **create_app_options: Any) -> Iterator[str]:
    """create_app(backend, ui=False, ...) under uvicorn; yields the base URL."""
    from nbserve.server import create_app

    create_app_options.setdefault("ui", False)
    with running_server(create_app(backend, **create_app_options)) as url:
        yield url


# ----------------------------------------------------------------------------- slow readers


def read_sse_data(sock: socket.socket, timeout: float = 10) -> list[str]:
    """Read what a `non_reading_stream` socket holds until [DONE] (or silence): its `data:`
    payloads (the chunked body's size lines dropped)."""
    text = read_all(sock, timeout)
    return [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]


def greedy_completion(loaded: Any, prompt: str = "hello world", max_tokens: int = 12
                      ) -> tuple[dict[str, Any], dict[str, Any]]:
    """`loaded` served over HTTP by an Engine: its greedy /v1/completions choice for `prompt`
    (with logprobs) and its /stats."""
    import httpx

    from nbserve.engine import Engine

    engine = Engine(loaded, quiet=True, max_batch=2, max_context=128)
    try:
        with app_running(engine) as url:
            r = httpx.post(f"{url}/v1/completions", timeout=60, json={
                "model": loaded.name, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "logprobs": 1})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0], httpx.get(f"{url}/stats", timeout=30).json()
    finally:
        engine.close()
