"""API keys (`Authorization: Bearer <key>`, or `x-api-key: <key>` as Anthropic's clients send
it; constant-time compare, several keys) and a per-key rate limit (token bucket; per client
address when no keys are set)."""

from __future__ import annotations

import hashlib
import hmac
import math
import time
from collections.abc import Iterable

from fastapi import Request

from .errors import APIError


class KeyAuth:
    """Checks the bearer token against every configured key without early exit."""

    def __init__(self, keys: Iterable[str]):
        keys = list(keys)
        for k in keys:
            if not isinstance(k, str) or not k.strip():
                raise ValueError("api_keys must be non-empty strings, e.g. "
                                 "api_keys=['sk-my-secret']")
        # Compare fixed-length digests so the key lengths do not leak through timing either.
        self._digests = [hashlib.sha256(k.encode()).digest() for k in keys]

    def __bool__(self) -> bool:
        return bool(self._digests)

    def check(self, request: Request) -> str:
        """Return a short id of the key used; raise a 401 APIError otherwise. The key is the
        `x-api-key` header's when there is one, else the bearer token of `Authorization`."""
        api_key = request.headers.get("x-api-key")
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if api_key is None and not header:
            raise APIError(401, "Missing API key: send it as 'Authorization: Bearer <key>' or "
                           "'x-api-key: <key>'.", "invalid_request_error", None,
                           "missing_api_key", {"WWW-Authenticate": "Bearer"})
        if api_key is not None:
            key_id = self.match(api_key.strip())
        else:
            key_id = self.match(token.strip()) if scheme.lower() == "bearer" else None
        if key_id is None:
            raise APIError(401, "Incorrect API key provided. Send one of the server's keys as "
                           "'Authorization: Bearer <key>' or 'x-api-key: <key>'.",
                           "invalid_request_error", None, "invalid_api_key",
                           {"WWW-Authenticate": "Bearer"})
        return key_id

    def match(self, token: str) -> str | None:
        """The short id of the key `token` is ("key0", ...), or None; the same ids as `check`
        gives, so that the UI's logins and /v1 requests with one key share a rate-limit bucket."""
        digest = hashlib.sha256(token.encode()).digest()
        match = -1
        for i, d in enumerate(self._digests):
            if hmac.compare_digest(d, digest):
                match = i
        return f"key{match}" if match >= 0 else None


class RateLimiter:
    """A token bucket per client: `per_minute` requests, refilled continuously."""

    def __init__(self, per_minute: float, max_clients: int = 10_000):
        if not per_minute or per_minute <= 0:
            raise ValueError(f"rate_limit_per_minute must be > 0, got {per_minute!r}")
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.max_clients = max_clients
        self._buckets: dict[str, tuple[float, float]] = {}  # client -> (tokens, last time)

    def check(self, client: str) -> None:
        """Take one token for `client`; raise a 429 APIError with Retry-After when empty."""
        now = time.monotonic()
        tokens, last = self._buckets.get(client, (self.capacity, now))
        tokens = min(self.capacity, tokens + (now - last) * self.rate)
        if tokens < 1.0:
            self._buckets[client] = (tokens, now)
            wait = (1.0 - tokens) / self.rate
            raise APIError(429, f"Rate limit reached: at most {self.capacity:g} requests per "
                           f"minute. Retry in {math.ceil(wait)} s.", "rate_limit_error", None,
                           "rate_limit_exceeded", {"Retry-After": str(max(1, math.ceil(wait)))})
        self._buckets[client] = (tokens - 1.0, now)
        if len(self._buckets) > self.max_clients:
            self._forget_full(now)

    def _forget_full(self, now: float) -> None:
        for client, (tokens, last) in list(self._buckets.items()):
            if tokens + (now - last) * self.rate >= self.capacity:
                del self._buckets[client]
