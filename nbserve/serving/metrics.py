"""Server metrics: Prometheus series in a per-app registry and plain counters for `/stats`,
both fed by each request's `Trace` (api/trace.py)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import ClassVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ..api.trace import Trace
from ..types import JSONObject

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
_DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class _BackendCollector:
    """Gauges and counters read from `backend.stats()` at scrape time. A Pool's series come one
    per replica, labelled `replica` (and `device`), from its `stats()["replicas"]`; `sum()` over
    them gives the pool's totals. One Engine's series have no label."""

    _GAUGES: ClassVar[dict[str, tuple[str, str]]] = {
        "running": ("nbserve_running_sequences", "Sequences being generated now"),
        "waiting": ("nbserve_queue_depth", "Requests waiting for a slot"),
        "slots_used": ("nbserve_kv_cache_slots_used", "KV cache slots in use"),
        "slots_total": ("nbserve_kv_cache_slots_total", "KV cache slots in all"),
        "kv_cache_bytes": ("nbserve_kv_cache_bytes", "Bytes allocated to the KV cache"),
        "kv_blocks_total": ("nbserve_kv_blocks_total", "KV cache blocks in all"),
        "kv_blocks_used": ("nbserve_kv_blocks_used", "KV cache blocks held by running sequences"),
        "kv_blocks_cached": ("nbserve_kv_blocks_cached",
                             "KV cache blocks nobody runs that keep a reusable prefix"),
        "kv_blocks_touched": ("nbserve_kv_blocks_touched",
                              "KV cache blocks that hold memory pages (on CPU: resident)"),
        "kv_committed_bytes": ("nbserve_kv_committed_bytes",
                               "Bytes of the KV cache that hold memory now (on CPU: resident)"),
        "decode_tokens_per_s": ("nbserve_decode_tokens_per_second",
                                "Engine decode throughput over the last seconds"),
    }
    _COUNTERS: ClassVar[dict[str, tuple[str, str]]] = {
        "tokens_prefilled": ("nbserve_engine_prefill_tokens", "Prompt tokens computed"),
        "tokens_decoded": ("nbserve_engine_decode_tokens", "Tokens decoded"),
        "tokens_reused": ("nbserve_engine_reused_tokens", "Prompt tokens reused from cache"),
        "prefix_cache_queries": ("nbserve_prefix_cache_queries",
                                 "Prompt tokens looked up in the prefix cache"),
        "prefix_cache_hits": ("nbserve_prefix_cache_hits",
                              "Prompt tokens found in the prefix cache"),
        "preemptions": ("nbserve_engine_preemptions",
                        "Sequences preempted to free KV blocks (recomputed later)"),
        "requests_rejected": ("nbserve_engine_rejected_requests", "Requests refused (busy)"),
        "model_errors": ("nbserve_engine_model_errors", "Failed model steps"),
    }

    def __init__(self, stats: Callable[[], JSONObject]):
        self._stats = stats

    def describe(self) -> list[Metric]:
        return []  # series depend on what the backend reports

    @staticmethod
    def _series(st: JSONObject) -> tuple[list[str], list[tuple[list[str], JSONObject]]]:
        """(label names, [(label values, stats)]): one unlabelled row for an Engine, one row
        per replica for a Pool."""
        replicas = st.get("replicas")
        tables = [r for r in replicas if isinstance(r, dict)] if isinstance(replicas, list) else []
        if isinstance(replicas, list) and replicas and len(tables) == len(replicas):
            return ["replica", "device"], [([str(r.get("replica", i)), str(r.get("device", ""))],
                                            r) for i, r in enumerate(tables)]
        return [], [([], st)]

    def collect(self) -> Iterator[Metric]:
        try:
            st = self._stats()
        except Exception:  # noqa: BLE001 - a scrape must not fail while the backend stops
            return
        names, rows = self._series(st)

        def number(row: JSONObject, key: str) -> float | None:
            v = row.get(key)
            return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

        def family(kind: type[GaugeMetricFamily | CounterMetricFamily], name: str, doc: str,
                   value: Callable[[JSONObject], float | None]) -> Metric | None:
            fam = kind(name, doc, labels=names)
            for labels, row in rows:
                v = value(row)
                if v is not None:
                    fam.add_metric(labels, v)
            return fam if fam.samples else None

        def ratio(row: JSONObject) -> float | None:
            used, total = number(row, "kv_blocks_used"), number(row, "kv_blocks_total")
            return used / total if used is not None and total else None

        def of(key: str) -> Callable[[JSONObject], float | None]:
            return lambda row: number(row, key)

        fams = [family(GaugeMetricFamily, name, doc, of(key))
                for key, (name, doc) in self._GAUGES.items()]
        fams.append(family(GaugeMetricFamily, "nbserve_kv_cache_usage_ratio",
                           "Fraction of KV cache blocks held by running sequences", ratio))
        fams += [family(CounterMetricFamily, name, doc, of(key))
                 for key, (name, doc) in self._COUNTERS.items()]
        if names:
            fams.append(family(GaugeMetricFamily, "nbserve_replica_healthy",
                               "1 while the replica is in the pool's rotation, else 0",
                               lambda r: float(bool(r.get("healthy")))))
        yield from (f for f in fams if f is not None)


class Metrics:
    """All server metrics of one app; each app has its own registry, so apps never clash."""

    def __init__(self, stats: Callable[[], JSONObject], window: int = 2048):
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("nbserve_requests", "HTTP requests by route and status",
                                ["route", "status"], registry=r)
        self.duration = Histogram("nbserve_request_duration_seconds",
                                  "HTTP request time by route", ["route"],
                                  buckets=_DURATION_BUCKETS, registry=r)
        self.in_flight = Gauge("nbserve_http_requests_in_flight", "HTTP requests in progress",
                               registry=r)
        # by model: a server may serve several (serving/model_set.py)
        self.prompt_tokens = Counter("nbserve_prompt_tokens", "Prompt tokens served by model",
                                     ["model"], registry=r)
        self.completion_tokens = Counter("nbserve_completion_tokens",
                                         "Completion tokens sent by model", ["model"],
                                         registry=r)
        self.cached_tokens = Counter("nbserve_cached_prompt_tokens",
                                     "Prompt tokens served from the prefix cache by model",
                                     ["model"], registry=r)
        self.ttft = Histogram("nbserve_time_to_first_token_seconds",
                              "Time from request arrival to the first token, by model",
                              ["model"], buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("nbserve_inter_token_latency_seconds",
                             "Time between consecutive tokens of one choice",
                             buckets=_ITL_BUCKETS, registry=r)
        self.finished = Counter("nbserve_finished_choices", "Choices finished by reason",
                                ["reason"], registry=r)
        r.register(_BackendCollector(stats))
        # plain numbers for /stats
        self.started = time.time()
        self.by_status: dict[str, int] = {}
        self.n_requests = self.n_in_flight = 0
        self.n_prompt = self.n_completion = self.n_cached = 0
        self._ttft: deque[float] = deque(maxlen=window)
        self._itl: deque[float] = deque(maxlen=window * 8)
        self._recent: deque[tuple[float, int]] = deque(maxlen=window)  # (end time, tokens)

    def begin(self) -> None:
        self.n_in_flight += 1
        self.in_flight.inc()

    def end(self, route: str, status: int, duration: float, trace: Trace | None) -> None:
        """Count one finished HTTP request (and its generation, if any)."""
        self.n_in_flight -= 1
        self.in_flight.dec()
        self.n_requests += 1
        key = str(status)
        self.by_status[key] = self.by_status.get(key, 0) + 1
        self.requests.labels(route, key).inc()
        self.duration.labels(route).observe(duration)
        if trace is None:
            return
        self.n_prompt += trace.prompt_tokens
        self.n_completion += trace.completion_tokens
        self.n_cached += trace.cached_tokens
        self.prompt_tokens.labels(trace.model).inc(trace.prompt_tokens)
        self.completion_tokens.labels(trace.model).inc(trace.completion_tokens)
        self.cached_tokens.labels(trace.model).inc(trace.cached_tokens)
        if trace.ttft is not None:
            self.ttft.labels(trace.model).observe(trace.ttft)
            self._ttft.append(trace.ttft)
        for dt in trace.itl:
            self.itl.observe(dt)
        self._itl.extend(trace.itl)
        for reason in trace.finish_reasons:
            self.finished.labels(reason).inc()
        self._recent.append((time.perf_counter(), trace.completion_tokens))

    def tokens_per_s(self, horizon: float = 10.0) -> float:
        """Completion tokens per second over requests that ended in the last `horizon` s."""
        now = time.perf_counter()
        return sum(n for t, n in list(self._recent) if now - t <= horizon) / horizon

    def snapshot(self) -> JSONObject:
        # here, not at the top: the engine package imports torch, which launch() leaves to its
        # background load (seconds in a fresh kernel)
        from ..engine.stats import percentile

        ttft, itl = list(self._ttft), list(self._itl)
        return {
            "requests": self.n_requests,
            "requests_by_status": dict(self.by_status),
            "in_flight": self.n_in_flight,
            "prompt_tokens": self.n_prompt,
            "completion_tokens": self.n_completion,
            "cached_tokens": self.n_cached,
            "completion_tokens_per_s": round(self.tokens_per_s(), 2),
            "ttft_s": {"p50": percentile(ttft, 50), "p95": percentile(ttft, 95)},
            "itl_s": {"p50": percentile(itl, 50), "p95": percentile(itl, 95)},
            "uptime_s": round(time.time() - self.started, 1),
        }

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
