"""Trace: what one generation request did, filled in by its route as events arrive; it feeds
the server's metrics and the one log line per request."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(slots=True)
class Trace:
    """What one generation request did, filled in by the route as events arrive."""

    request_id: str
    start: float = field(default_factory=time.perf_counter)
    model: str = ""  # the model that served it (a metrics label)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    first_token: float | None = None
    last_token: float | None = None
    finish_reasons: list[str] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    disconnected: bool = False
    error: str | None = None
    input_text: str | None = None  # only when log_messages
    output: dict[int, list[str]] | None = None  # only when log_messages
    _last: dict[int, float] = field(default_factory=dict)

    def token(self, index: int, n_tokens: int = 1) -> None:
        """Record new tokens of choice `index` (for TTFT and ITL)."""
        now = time.perf_counter()
        if self.first_token is None:
            self.first_token = now
        prev = self._last.get(index)
        if prev is not None:
            self.itl.append(now - prev)
        self._last[index] = now
        self.last_token = now

    def text(self, index: int, text: str) -> None:
        if self.output is not None and text:
            self.output.setdefault(index, []).append(text)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.start

    @property
    def tokens_per_s(self) -> float | None:
        if self.first_token is None or self.last_token is None or self.completion_tokens < 2:
            return None
        span = self.last_token - self.first_token
        return (self.completion_tokens - 1) / span if span > 0 else None

    def log_line(self, route: str, status: int, duration: float) -> str:
        ttft, tps = self.ttft, self.tokens_per_s
        finish = ",".join(sorted(set(self.finish_reasons))) or (
            "disconnected" if self.disconnected else (self.error or "none"))
        line = (f"{self.request_id} {route} {status} prompt={self.prompt_tokens} "
                f"completion={self.completion_tokens} cached={self.cached_tokens} "
                f"ttft={'-' if ttft is None else f'{ttft:.3f}s'} "
                f"tok/s={'-' if tps is None else f'{tps:.1f}'} finish={finish} "
                f"time={duration:.3f}s")
        if self.input_text is not None:
            line += f" input={self.input_text!r}"
        if self.output is not None:
            out = {i: "".join(parts) for i, parts in sorted(self.output.items())}
            line += f" output={out!r}"
        return line
