"""EngineStats: counters and recent latencies of one engine, readable from any thread."""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from ..types import JSONObject


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) of `values` by nearest rank, or None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


class EngineStats:
    """Token counters, step-time split (model / sampling / bookkeeping), TTFT and ITL windows."""

    def __init__(self, window: int = 2048):
        self.started = time.time()
        self.prefilled = self.decoded = self.reused = 0
        self.prefix_queries = self.prefix_hits = 0  # prompt tokens looked up / found cached
        self.rejected = self.errors = self.steps = 0
        self.finished: dict[str, int] = {}
        self.ttft: deque[float] = deque(maxlen=window)
        self.itl: deque[float] = deque(maxlen=window * 8)
        self.step_time = self.model_time = self.sample_time = 0.0
        self._recent: deque[tuple[float, int]] = deque(maxlen=256)  # (time, tokens) per step

    def record_step(self, total: float, model: float, sampling: float, decoded: int) -> None:
        self.steps += 1
        self.step_time += total
        self.model_time += model
        self.sample_time += sampling
        self._recent.append((time.perf_counter(), decoded))

    def decode_tokens_per_s(self, horizon: float = 10.0) -> float:
        now = time.perf_counter()
        recent = [(t, n) for t, n in list(self._recent) if now - t <= horizon]
        if len(recent) < 2:
            return 0.0
        span = recent[-1][0] - recent[0][0]
        return sum(n for _, n in recent[1:]) / span if span > 0 else 0.0

    def snapshot(self, **live: Any) -> JSONObject:
        ttft, itl = list(self.ttft), list(self.itl)
        book = max(self.step_time - self.model_time - self.sample_time, 0.0)
        return {
            **live,
            "tokens_prefilled": self.prefilled,
            "tokens_decoded": self.decoded,
            "tokens_reused": self.reused,
            "prefix_cache_queries": self.prefix_queries,
            "prefix_cache_hits": self.prefix_hits,
            "requests_finished": dict(self.finished),
            "requests_rejected": self.rejected,
            "model_errors": self.errors,
            "steps": self.steps,
            "decode_tokens_per_s": round(self.decode_tokens_per_s(), 2),
            "step_time_s": {"model": round(self.model_time, 4),
                            "sampling": round(self.sample_time, 4),
                            "bookkeeping": round(book, 4)},
            "bookkeeping_fraction": round(book / self.step_time, 4) if self.step_time else 0.0,
            "ttft_s": {"p50": percentile(ttft, 50), "p95": percentile(ttft, 95)},
            "itl_s": {"p50": percentile(itl, 50), "p95": percentile(itl, 95)},
            "uptime_s": round(time.time() - self.started, 1),
        }
