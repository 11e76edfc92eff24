"""ASGI middlewares for nbserve on Ray Serve (no Ray import here, so Ray's proxy loads it
cheaply): name the answering replica, and put Ray's own plain-text errors in the OpenAI shape.
"""

from __future__ import annotations

import json
from typing import ClassVar

from starlette.datastructures import MutableHeaders
from starlette.middleware import Middleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..types import JSONObject

REPLICA_HEADER = "x-nbserve-replica"
PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_CALLBACK = "nbserve.serving.ray_asgi:proxy_middlewares"
_REPLICA_PATHS = ("/health", "/stats")


class ReplicaMiddleware:
    """Names the answering replica: an `x-nbserve-replica` header on every response, and a
    `replica` field in the JSON of /health and /stats."""

    def __init__(self, app: ASGIApp, replica: JSONObject):
        self.app, self.replica = app, replica
        self.header = str(replica["id"])

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
                MutableHeaders(scope=message).append(REPLICA_HEADER, self.header)
                if rewrite:
                    start = message  # held until the (small) JSON body is complete
                    return
            elif message["type"] == "http.response.body" and start is not None:
                chunks.append(message.get("body", b""))
                if message.get("more_body", False):
                    return
                body = self._with_replica(b"".join(chunks))
                MutableHeaders(scope=start)["content-length"] = str(len(body))
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


class OpenAIErrorsMiddleware:
    """On Ray's HTTP proxy: turns Ray Serve's own plain-text answers (429 when every queue is
    full, 503 when no replica can take the request, 408 on timeout) into OpenAI-shaped JSON.
    The app's own errors are JSON already and pass through untouched."""

    KINDS: ClassVar[dict[int, tuple[str, str, str]]] = {
        429: ("rate_limit_error", "server_busy", "Every replica is busy and the queue is full."),
        503: ("service_unavailable", "no_replica_available",
              "No replica can take the request now; retry in a few seconds."),
        408: ("timeout", "request_timeout", "The request timed out in Ray Serve."),
    }

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
                start = message  # held until its (short) body is read
                return
            if message["type"] == "http.response.body" and start is not None:
                chunks.append(message.get("body", b""))
                if message.get("more_body", False):
                    return
                held, start = start, None
                await self._send_json(send, held, b"".join(chunks).decode("utf-8", "replace"))
                return
            await send(message)

        await self.app(scope, receive, translate)

    def _is_ray_error(self, message: Message) -> bool:
        ctype = MutableHeaders(scope=message).get("content-type", "")
        return message["status"] in self.KINDS and ctype.startswith("text/plain")

    async def _send_json(self, send: Send, start: Message, detail: str) -> None:
        kind, code, text = self.KINDS[start["status"]]
        headers = MutableHeaders(scope=start)
        if start["status"] == 429:
            retry = headers.get("retry-after")
            text += f" Retry after {retry} s." if retry else " Retry in a moment."
        error = {"message": f"{text} ({detail.strip()})", "type": kind, "param": None,
                 "code": code}
        body = json.dumps({"error": error}).encode()
        headers["content-type"] = "application/json"
        headers["content-length"] = str(len(body))
        await send(start)
        await send({"type": "http.response.body", "body": body, "more_body": False})


def proxy_middlewares() -> list[Middleware]:
    """Ray's proxy callback (`RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`)."""
    return [Middleware(OpenAIErrorsMiddleware)]
