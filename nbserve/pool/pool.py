"""Pool: one Engine per device behind the engine's own API (a `Backend`), with routing and health.

A request goes to the healthy replica with the fewest sequences in flight, unless one
replica's KV cache holds a long prefix of its prompt (read from its blocks: a chat's next turn,
a shared system prompt, prefills only what is new there) and that replica is not overloaded.
A replica whose engine thread dies, or whose model raises several steps in a row, leaves the
rotation; its requests that have produced no output yet are re-submitted to the others.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..engine.config import EngineConfig
from ..engine.engine import Engine
from ..engine.requests import Mailbox, SyncMailbox, backlog_limit
from ..engine.sync_helpers import SyncHelpers
from ..types import (
    BusyError,
    Delta,
    Embedded,
    EngineStoppedError,
    ErrorEvent,
    Event,
    Finished,
    InvalidRequestError,
    JSONObject,
    NbserveError,
    Request,
    Started,
)
from .setup import load_replicas, plan_kv_caches, resolve_devices
from .state import Replica, pool_health, pool_stats, route_order

if TYPE_CHECKING:
    import torch

    from ..text.chat_template import ChatTemplate

log = logging.getLogger("nbserve.pool")
STUCK_REASON = "its model is stuck in one step (longer than step_timeout)"


@dataclass(eq=False)
class _Ticket:
    """One request to the pool: its current attempt and what the caller has seen."""

    request: Request
    routed: Request  # the same request with its prompt as token ids
    ids: list[int]
    post: Callable[[_Item], None]  # to the caller's queue, from any thread
    n: int
    attempt: _Attempt | None = None
    error_retries: int = 0
    started_sent: bool = False
    streamed: bool = False  # a Delta or Finished reached the caller: no re-routing now
    finished: int = 0


@dataclass(eq=False)
class _Attempt:
    """A ticket submitted to one replica."""

    ticket: _Ticket
    replica: Replica
    finished: int = 0
    ended: bool = False


@dataclass(slots=True)
class _Down:
    """Posted to the requests of a replica that left the rotation."""

    dead: bool
    reason: str


_Item = tuple[_Attempt, Event | _Down]  # what a ticket's caller receives


class Pool(SyncHelpers):
    """Replicas of one model, one Engine per device; a `Backend` like Engine itself.

    `model`: a source (path, "smollm2", hub id), loaded once per device in parallel, or a
    LoadedModel / model object (with `tokenizer`, `chat_template` as for `load`), copied to
    devices it is not on (torch modules only; otherwise pass its source). Replicas on the same
    device share the weights (one copy in memory): each Engine owns its own KV cache and
    thread. On CUDA, unless
    `max_batch` / `max_context` are given, each replica's KV cache is sized from
    `kv_memory_fraction` of the GPU's free memory (split between replicas on one GPU).
    `dtype`, `weights`, `exact`: the compute dtype and weight format, as for `load`.
    A replica leaves the rotation when its engine thread dies or its model raises
    `max_model_errors` times in a row; `readmit_after` seconds later, once its engine runs
    again (engines restart themselves after a crash), it gets another chance on probation (one
    more failure takes it out again, for twice as long, up to 16x); None: never.
    Other keywords go to each Engine (max_queue, prefill_chunk, name, quiet, ...).
    """

    watch_interval = 0.1  # seconds between checks that every engine thread is alive

    def __init__(self, model: object, *, devices: object = "auto",
                 kv_memory_fraction: float | None = None,
                 dtype: str | torch.dtype | None = None, device: str | None = None,
                 weights: str = "auto", exact: bool = False, tokenizer: object = None,
                 chat_template: str | ChatTemplate | None = None,
                 max_model_errors: int = 3,
                 readmit_after: float | None = 30.0, **engine_options: Any):
        if kv_memory_fraction is not None and not 0 < kv_memory_fraction <= 1:
            raise ValueError(f"kv_memory_fraction must be in (0, 1], got {kv_memory_fraction}")
        if not isinstance(max_model_errors, int) or max_model_errors < 1:
            raise ValueError(f"max_model_errors must be an integer >= 1, got {max_model_errors!r}")
        if readmit_after is not None and not (isinstance(readmit_after, (int, float))
                                              and readmit_after > 0):
            raise ValueError(f"readmit_after must be a number of seconds > 0 (or None: never), "
                             f"got {readmit_after!r}")
        self.devices = resolve_devices(devices, device)
        self.max_model_errors = max_model_errors
        self.readmit_after = readmit_after
        load_options = {k: v for k, v in (("tokenizer", tokenizer),
                                          ("chat_template", chat_template)) if v is not None}
        max_batch = engine_options.pop("max_batch", None)
        max_context = engine_options.pop("max_context", None)
        kv_memory = engine_options.pop("kv_memory", None)
        config = EngineConfig.from_options(**engine_options,  # a bad option fails before loading
                                           kv_memory=kv_memory, max_batch=max_batch)
        loaded = load_replicas(model, self.devices, dtype=dtype, weights=weights, exact=exact,
                               **load_options)
        plans = plan_kv_caches(loaded, self.devices, kv_memory_fraction, max_batch, max_context,
                               config.resolved_max_batch(False), kv_memory)
        quiet = config.quiet
        self.replicas: list[Replica] = []
        try:
            for i, (d, plan) in enumerate(zip(self.devices, plans)):
                engine = Engine(loaded[d], config, **plan.engine_options())
                self.replicas.append(Replica(i, d, engine))
                if not quiet:
                    print(plan.describe(i, d), flush=True)
        except BaseException:
            for rep in self.replicas:
                rep.engine.close()
            raise
        first = self.replicas[0].engine
        self.model_name: str = first.model_name
        self.tokenizer, self.template, self.loaded = first.tokenizer, first.template, first.loaded
        self.vocab_size: int = first.vocab_size
        self.max_context: int = min(r.engine.max_context for r in self.replicas)
        self.max_backlog: int | None = first.max_backlog  # the same on every replica
        self.slow_client_timeout: float = first.slow_client_timeout
        self._lock = threading.Lock()
        self._tickets: dict[str, _Ticket] = {}
        self._closed = False
        self._turn = 0  # rotates the tie-break between equally loaded replicas
        self._started = time.time()
        self._stop = threading.Event()
        self._monitor = threading.Thread(target=self._watch, name="nbserve-pool-monitor",
                                         daemon=True)
        self._monitor.start()

    # ------------------------------------------------------------------ public API

    @property
    def engines(self) -> list[Engine]:
        return [r.engine for r in self.replicas]

    @property
    def max_batch(self) -> int:
        return sum(r.engine.max_batch for r in self.replicas)

    def count_prompt_tokens(self, request: Request) -> int:
        """How many tokens the request's prompt takes (see `Engine.count_prompt_tokens`)."""
        return self.replicas[0].engine.count_prompt_tokens(request)  # one tokenizer for all

    def prompt_token_ids(self, request: Request) -> list[int]:
        """The request's prompt token ids (see `Engine.prompt_token_ids`)."""
        return self.replicas[0].engine.prompt_token_ids(request)

    async def generate(self, request: Request) -> AsyncIterator[Event]:
        """Stream the events of `request` from one replica. Raises before the first event if
        it is refused; closing the iterator cancels it. A caller that leaves more than
        `max_backlog` events per choice unread, the oldest for more than `slow_client_timeout`
        s, is cancelled, as with one Engine."""
        mailbox: Mailbox[_Item] = Mailbox(self.abort, request.request_id,
                                          asyncio.get_running_loop(), self._backlog_limit(request),
                                          self.slow_client_timeout)
        ticket = self._open(request, mailbox.post)
        done = False
        try:
            while not done:
                out, done = self._handle(ticket, await mailbox.get())
                for ev in out:
                    yield ev
        finally:
            self._leave(ticket, done)

    def stream(self, request: Request) -> Iterator[Event]:
        """Sync `generate` for scripts and notebook cells; a refusal raises here."""
        mailbox: SyncMailbox[_Item] = SyncMailbox(self.abort, request.request_id,
                                                   self._backlog_limit(request),
                                                   self.slow_client_timeout)
        ticket = self._open(request, mailbox.post)
        return self._iterate(ticket, mailbox)

    def _backlog_limit(self, request: Request) -> int | None:
        """Unread events allowed to `request`'s caller: `max_backlog` per choice."""
        return backlog_limit(self.max_backlog, request.params.n)

    def _iterate(self, ticket: _Ticket, events: SyncMailbox[_Item]) -> Iterator[Event]:
        done = False
        try:
            while not done:
                out, done = self._handle(ticket, events.get())
                yield from out
        finally:
            self._leave(ticket, done)

    def cancel_all(self) -> int:
        """Cancel every request on every replica (see `Engine.cancel_all`); how many."""
        return sum(r.engine.cancel_all() for r in self.replicas)

    def abort(self, request_id: str, why: str = "cancel") -> None:
        """Cancel a request wherever it runs (`why` as for Engine.abort: "backlog" ends it with
        a client_too_slow error). Unknown ids are ignored."""
        ticket = self._tickets.get(request_id)
        attempt = ticket.attempt if ticket is not None else None
        if attempt is not None:
            attempt.replica.engine.abort(request_id, why)

    def close(self) -> None:
        """Stop every replica and the monitor thread; pending requests end with an error."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        if threading.current_thread() is not self._monitor:
            self._monitor.join(timeout=10)
        for rep in self.replicas:
            rep.engine.close()

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Pool({self.model_name!r}, devices={self.devices})"

    # ------------------------------------------------------------------ health and stats

    def health(self) -> JSONObject:
        """Ready while at least one replica is healthy; per-replica detail in `replica_health`."""
        return pool_health(self.replicas, self.model_name, self._closed)

    def stats(self) -> JSONObject:
        """Pool totals (Engine.stats keys) plus `replicas`: one summary per replica."""
        return pool_stats(self.replicas, self.max_context, self._started)

    # ------------------------------------------------------------------ routing

    def _route(self, ids: list[int], exclude: set[int]) -> list[Replica]:
        """Healthy replicas not in `exclude`, in the order to try them."""
        for rep in self.replicas:
            if rep.healthy and not rep.alive:
                self._mark_unhealthy(rep, "its engine thread died", dead=True)
        with self._lock:
            live = [r for r in self.replicas if r.healthy and r.index not in exclude]
            self._turn += 1
            return route_order(live, ids, self._turn, len(self.replicas)) if live else []

    def _open(self, request: Request, post: Callable[[_Item], None]) -> _Ticket:
        if self._closed:
            raise EngineStoppedError("the pool is closed: create a new Pool to serve requests")
        request.params.validate(self.vocab_size)
        ids = self.replicas[0].engine.prepare_prompt(request)  # same tokenizer everywhere
        routed = dataclasses.replace(request, messages=None, prompt=None, prompt_ids=ids)
        ticket = _Ticket(request, routed, ids, post, request.params.n)
        with self._lock:
            if request.request_id in self._tickets:
                raise InvalidRequestError(f"request id {request.request_id!r} is in use",
                                          param="request_id")
            self._tickets[request.request_id] = ticket
        try:
            self._dispatch(ticket, exclude=set())
        except BaseException:
            with self._lock:
                self._tickets.pop(request.request_id, None)
            raise
        return ticket

    def _dispatch(self, ticket: _Ticket, exclude: set[int]) -> _Attempt:
        """Submit to the first replica in routing order that accepts (the attempt, now
        `ticket.attempt`); raise if none does."""
        busy: BusyError | None = None
        for rep in self._route(ticket.ids, exclude):
            attempt = _Attempt(ticket, rep)
            with self._lock:
                rep.load += ticket.n
                rep.attempts.add(attempt)
            ticket.attempt = attempt
            try:
                rep.engine.submit(ticket.routed, self._sink(attempt))
            except BusyError as exc:
                self._end_attempt(attempt, ok=False)
                busy = exc
                continue
            except EngineStoppedError as exc:  # stopped, crashed and restarting, or stuck
                self._end_attempt(attempt, ok=False)
                stuck = rep.engine.stalled  # back when its step returns
                self._mark_unhealthy(rep, f"its engine refused work: {exc}", dead=not stuck)
                continue
            except BaseException:
                self._end_attempt(attempt, ok=False)
                ticket.attempt = None
                raise
            ticket.request.metadata["replica"] = rep.index
            return attempt
        ticket.attempt = None
        if busy is not None:
            raise busy
        raise EngineStoppedError(self._unavailable_message())

    def _unavailable_message(self) -> str:
        if self._closed:
            return "the pool is closed: create a new Pool to serve requests"
        why = "; ".join(f"replica {r.index} ({r.device}): {r.reason}" for r in self.replicas
                        if not r.healthy)
        return f"no healthy replica can take this request ({why or 'all were tried'})"

    # ------------------------------------------------------------------ events

    def _sink(self, attempt: _Attempt) -> Callable[[Event], None]:
        """The engine's callback for one attempt (runs on that engine's thread)."""
        ticket, rep = attempt.ticket, attempt.replica

        def sink(ev: Event) -> None:
            if isinstance(ev, (Delta, Embedded)):  # an answer: the replica works
                if rep.errors_in_row:
                    rep.errors_in_row, rep.cooldown = 0, None  # it works again
            elif isinstance(ev, Finished):
                attempt.finished += 1
                if attempt.finished == ticket.n:
                    self._end_attempt(attempt, ok=True)
            elif isinstance(ev, ErrorEvent):
                self._end_attempt(attempt, ok=False)
                if ev.kind == "server_error":
                    self._model_error(rep)
                elif rep.engine.stalled:  # out now, not at the next watch
                    self._mark_unhealthy(rep, STUCK_REASON, dead=False)
            ticket.post((attempt, ev))

        return sink

    def _handle(self, ticket: _Ticket, item: _Item) -> tuple[list[Event], bool]:
        """Caller side: (events to pass on, whether the request is over) for one queue item."""
        attempt, ev = item
        if attempt is not ticket.attempt:
            return [], False  # from an attempt that was abandoned
        rid = ticket.request.request_id
        if isinstance(ev, _Down):
            if not ticket.streamed:
                return self._reroute(ticket, set(), None)
            if not ev.dead:
                return [], False  # its running requests may still finish
            self._end_attempt(attempt, ok=False)
            return [ErrorEvent(f"replica {attempt.replica.index} ({attempt.replica.device}) "
                               f"stopped while generating this request ({ev.reason}); retry it",
                               "server_error", rid)], True
        if isinstance(ev, Started):
            if ticket.started_sent:
                return [], False
            ticket.started_sent = True
            return [ev], False
        if isinstance(ev, ErrorEvent):
            model_error = ev.kind == "server_error"
            retry = ev.kind == "service_unavailable" or (model_error and not ticket.error_retries)
            if not ticket.streamed and not self._closed and retry:
                ticket.error_retries += model_error
                return self._reroute(ticket, {attempt.replica.index}, ev)
            return [ev], True
        ticket.streamed = True
        if isinstance(ev, Finished):
            ticket.finished += 1
            return [ev], ticket.finished == ticket.n
        return [ev], False

    def _reroute(self, ticket: _Ticket, exclude: set[int],
                 failed: ErrorEvent | None) -> tuple[list[Event], bool]:
        """Move a request that has shown no output yet to another replica."""
        old = ticket.attempt
        assert old is not None
        self._end_attempt(old, ok=False)
        old.replica.engine.abort(ticket.request.request_id)
        try:
            new = self._dispatch(ticket, exclude)
        except NbserveError as exc:
            return [failed or ErrorEvent(str(exc), exc.kind, ticket.request.request_id)], True
        log.info("request %s moved from replica %d to %d", ticket.request.request_id,
                 old.replica.index, new.replica.index)
        return [], False

    def _leave(self, ticket: _Ticket, done: bool) -> None:
        with self._lock:
            self._tickets.pop(ticket.request.request_id, None)
        attempt = ticket.attempt
        if done or attempt is None or attempt.ended:
            return
        attempt.replica.engine.abort(ticket.request.request_id)  # ends it via its events
        if not attempt.replica.alive:
            self._end_attempt(attempt, ok=False)

    def _end_attempt(self, attempt: _Attempt, ok: bool) -> None:
        """Release the attempt's load (once)."""
        with self._lock:
            if attempt.ended:
                return
            attempt.ended = True
            rep = attempt.replica
            rep.load -= attempt.ticket.n
            rep.attempts.discard(attempt)
            if ok:
                rep.served += 1

    # ------------------------------------------------------------------ faults

    def _model_error(self, rep: Replica) -> None:
        """Count failed forward passes in a row (one failed step fails all its requests)."""
        mark = rep.engine.counters().errors
        with self._lock:
            if mark == rep.last_error_mark:
                return
            rep.last_error_mark = mark
            rep.errors_in_row += 1
            trip = rep.errors_in_row >= self.max_model_errors
        if trip:
            self._mark_unhealthy(rep, f"the model raised {rep.errors_in_row} times in a row",
                                 dead=False)

    def _mark_unhealthy(self, rep: Replica, reason: str, dead: bool) -> None:
        """Take `rep` out of rotation; its requests with no output yet move elsewhere."""
        with self._lock:
            if not rep.healthy or self._closed:
                return
            rep.healthy, rep.reason = False, reason
            rep.down_since = time.monotonic()
            if self.readmit_after is not None:  # each relapse doubles the wait, up to 16x
                rep.cooldown = self.readmit_after if rep.cooldown is None else \
                    min(rep.cooldown * 2, self.readmit_after * 16)
            attempts = list(rep.attempts)
        log.warning("replica %d (%s) is unhealthy: %s; %d request(s) affected", rep.index,
                    rep.device, reason, len(attempts))
        for attempt in attempts:
            attempt.ticket.post((attempt, _Down(dead, reason)))
        if dead and not rep.engine.restart_on_failure:
            rep.engine.close()  # frees its bookkeeping; its thread is already gone

    def _readmit_due(self) -> None:
        """Give replicas whose cool-down is over, and whose engine runs again, another chance."""
        if self.readmit_after is None:
            return
        now = time.monotonic()
        for rep in self.replicas:
            if rep.healthy or rep.cooldown is None or now - rep.down_since < rep.cooldown:
                continue
            if not rep.engine.health().get("ready"):
                continue  # still restarting, or stopped for good
            with self._lock:
                if rep.healthy or self._closed:
                    continue
                rep.healthy, rep.reason = True, None
                rep.errors_in_row = self.max_model_errors - 1  # probation: one more error trips
                rep.last_error_mark = rep.engine.counters().errors
            log.warning("replica %d (%s) is back in rotation on probation", rep.index,
                        rep.device)

    def _watch(self) -> None:
        while not self._stop.wait(self.watch_interval):
            for rep in self.replicas:
                if rep.healthy and not rep.alive:
                    self._mark_unhealthy(rep, "its engine thread died", dead=True)
                elif rep.healthy and rep.engine.stalled:
                    self._mark_unhealthy(rep, STUCK_REASON, dead=False)
            self._readmit_due()
