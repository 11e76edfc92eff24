"""What a Pool knows about each replica, the routing order it derives, and its summaries.

`route_order` is the routing policy (least loaded, with prefix affinity); `pool_stats` and
`pool_health` add the replicas' numbers up for /stats, /metrics and /health.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ..engine.engine import Engine
from ..engine.stats import percentile
from ..types import JSONObject, JSONValue

AFFINITY_TOKENS = 32  # a shared prefix this long (or half the prompt) pulls a request back
AFFINITY_FRACTION = 0.5
AFFINITY_MIN_TOKENS = 8  # below this, reuse saves too little to matter
SUMMED = ("running", "waiting", "slots_used", "slots_total", "kv_cache_bytes",
          "kv_blocks_total", "kv_blocks_used", "kv_blocks_cached",
          "kv_blocks_touched", "kv_committed_bytes", "kv_budget_bytes",
          "tokens_prefilled", "tokens_decoded", "tokens_reused", "prefix_cache_queries",
          "prefix_cache_hits", "preemptions", "requests_rejected", "model_errors", "steps",
          "decode_tokens_per_s")


@dataclass(eq=False)
class Replica:
    """One engine of a pool and the pool's bookkeeping about it (guarded by the pool's lock)."""

    index: int
    device: str
    engine: Engine
    load: int = 0  # sequences routed here and not ended (the pool's own count)
    served: int = 0
    healthy: bool = True
    reason: str | None = None  # why it is unhealthy
    errors_in_row: int = 0  # failed forward passes since the last good token
    last_error_mark: int | None = None  # the engine's model-error count at the last one seen
    down_since: float = 0.0  # time.monotonic() when it left the rotation
    cooldown: float | None = None  # seconds it stays out before another chance
    attempts: set[Any] = field(default_factory=set)  # requests in flight here

    @property
    def alive(self) -> bool:
        return self.engine.thread_alive

    def prefix_match(self, ids: list[int]) -> int:
        """Tokens of `ids` whose keys/values this replica's cache holds now (its engine's
        `cached_prefix`: the blocks of running and of finished sequences alike)."""
        return int(self.engine.cached_prefix(ids))


def route_order(live: list[Replica], ids: list[int], turn: int, n: int) -> list[Replica]:
    """The order to try `live` replicas in: by load (ties rotate with `turn`), except that the
    replica holding the longest prefix of `ids` goes first when it beats the least loaded one
    by >= 32 tokens or half the prompt, and its load is <= the least + its max_batch / 2."""
    order = sorted(live, key=lambda r: (r.load, (r.index - turn) % n))
    least = order[0]
    match = {r.index: r.prefix_match(ids) for r in live}
    best = max(live, key=lambda r: (match[r.index], -r.load))
    gain = match[best.index] - match[least.index]
    need = max(AFFINITY_MIN_TOKENS, min(AFFINITY_TOKENS, AFFINITY_FRACTION * len(ids)))
    if gain >= need and best.load <= least.load + best.engine.max_batch / 2:
        order.remove(best)
        order.insert(0, best)
    return order


def pool_health(replicas: list[Replica], model_name: str, closed: bool) -> JSONObject:
    """Ready while >= 1 replica is healthy; `replica_health` has one entry per replica."""
    detail: list[JSONValue] = []
    healthy, running, waiting = 0, 0.0, 0.0
    for rep in replicas:
        h = rep.engine.health()
        ok = rep.healthy and bool(h.get("ready")) and not closed
        reason = rep.reason if not rep.healthy else None if ok else h.get("status")
        detail.append({"replica": rep.index, "device": rep.device, "healthy": ok,
                       "reason": reason, "running": h.get("running", 0),
                       "waiting": h.get("waiting", 0)})
        healthy += ok
        running += _number(h.get("running", 0))
        waiting += _number(h.get("waiting", 0))
    status = ("stopped" if closed else "ready" if healthy == len(detail)
              else "degraded" if healthy else "unavailable")
    return {"ready": healthy > 0, "status": status, "model": model_name,
            "replicas": len(detail), "healthy_replicas": healthy,
            "running": int(running), "waiting": int(waiting), "replica_health": detail}


def pool_stats(replicas: list[Replica], max_context: int, started: float) -> JSONObject:
    """Totals under Engine.stats() keys, plus `replicas`: one summary per replica."""
    per: list[JSONValue] = []
    raw: list[JSONObject] = []
    for rep in replicas:
        st = rep.engine.stats()
        raw.append(st)
        per.append({"replica": rep.index, "device": rep.device, "healthy": rep.healthy,
                    "reason": rep.reason, "in_flight": rep.load,
                    "requests_served": rep.served, "max_batch": rep.engine.max_batch,
                    **{k: st.get(k) for k in SUMMED}, "max_context": st.get("max_context")})
    sums = {k: sum(_number(s.get(k)) for s in raw) for k in SUMMED}
    sums["decode_tokens_per_s"] = round(sums["decode_tokens_per_s"], 2)
    total: JSONObject = {**sums}
    finished: dict[str, int] = {}
    for s in raw:
        for reason, count in _table(s.get("requests_finished")).items():
            finished[reason] = finished.get(reason, 0) + (count if isinstance(count, int) else 0)
    times = {k: round(sum(_number(_table(s.get("step_time_s")).get(k, 0.0)) for s in raw), 4)
             for k in ("model", "sampling", "bookkeeping")}
    spent = sum(times.values())
    total.update(
        max_context=max_context, device=",".join(r.device for r in replicas),
        dtype=raw[0].get("dtype"), requests_finished={**finished}, step_time_s={**times},
        bookkeeping_fraction=round(times["bookkeeping"] / spent, 4) if spent else 0.0,
        ttft_s=_merged([r.engine.counters().ttft for r in replicas]),
        itl_s=_merged([r.engine.counters().itl for r in replicas]),
        uptime_s=round(time.time() - started, 1),
        healthy_replicas=sum(r.healthy for r in replicas), replicas=per)
    return total


def _number(value: JSONValue) -> float:
    """A replica's stats number (0 where it reports none)."""
    return value if isinstance(value, (int, float)) else 0


def _table(value: JSONValue) -> JSONObject:
    """A replica's stats table (empty where it reports none)."""
    return value if isinstance(value, dict) else {}


def _merged(windows: list[deque[float]]) -> JSONObject:
    """p50/p95 over every replica's latency window."""
    values = [v for window in windows for v in list(window)]
    return {"p50": percentile(values, 50), "p95": percentile(values, 95)}
