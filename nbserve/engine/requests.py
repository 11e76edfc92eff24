"""Requests in flight: per-choice text state, per-request bookkeeping, and the mailbox that
carries events from the engine thread to an async caller.

Kept apart from the engine (`engine.py`, `step.py`) because it knows nothing of the model:
only who is waiting for which events.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, TypeVar

from ..text import IncrementalDetokenizer, StopStringMatcher
from ..types import EmbedSpec, ErrorEvent, Event, Finished, SamplingParams, TokenLogprob, Usage
from .embedding import Pooler
from .sampling import SeqSampler
from .scheduler import Sequence

if TYPE_CHECKING:
    from .constraints import Grammars

Sink = Callable[[Event], None]
Clock = Callable[[], float]  # seconds, monotonic
Abort = Callable[[str, str], None]  # (request id, why): Engine.abort or Pool.abort
T = TypeVar("T")


@dataclass(eq=False)
class ChoiceState:
    """Per-choice text state: sampler, detokenizer, stop-string matcher."""

    sampler: SeqSampler
    detok: IncrementalDetokenizer
    stopper: StopStringMatcher
    first_token_time: float = 0.0
    last_token_time: float = 0.0


@dataclass(eq=False)
class RequestGroup:
    """One request in flight: its n sequences and where its events go."""

    request_id: str
    params: SamplingParams
    prompt_ids: list[int]
    stop_ids: frozenset[int]
    sink: Sink
    seqs: list[Sequence] = field(default_factory=list)
    choices: list[ChoiceState] = field(default_factory=list)
    remaining: int = 0
    completion_tokens: int = 0
    submitted: float = 0.0
    first_token: float = 0.0
    admitted: bool = False
    done: bool = False
    grammars: Grammars | None = None  # of a constrained request
    tool_format: str | None = None  # the model's tool-call format, for a request with tools
    prompt_logprobs: list[TokenLogprob | None] | None = None  # collected while the prompt is scored
    reasoning: bool = False  # a chat of a thinking model: its answer may open with a thought
    thought_open: bool = False  # the prompt opened the thought
    embed: EmbedSpec | None = None  # a prefill-only request: answered by one Embedded event
    pooler: Pooler | None = None  # its pooled state, unless it scores tokens
    adapter: int = -1  # the index of its LoRA adapter in the model, -1 for none

    def usage(self) -> Usage:
        s = self.seqs[0]
        return Usage(len(self.prompt_ids), self.completion_tokens, s.cached_prompt)


def count_down(remaining: int, ev: Event) -> tuple[int, bool]:
    """One event of a request with `remaining` choices unfinished: (remaining, finished)."""
    remaining -= isinstance(ev, Finished)
    return remaining, remaining == 0 or isinstance(ev, ErrorEvent)


class Mailbox(Generic[T]):
    """Events from the engine thread to one async caller. The engine appends without waking
    the caller's loop unless the caller waits for an event, so a caller stuck elsewhere (on a
    client that stopped reading) costs the loop nothing. A caller that is too slow (`Backlog`)
    is reported to the engine (or the pool routing the request; `abort`), once, which cancels
    the request."""

    __slots__ = ("abort", "backlog", "events", "loop", "request_id", "waiter")

    def __init__(self, abort: Abort, request_id: str, loop: asyncio.AbstractEventLoop,
                 limit: int | None, grace: float = 0.0, clock: Clock = time.monotonic):
        self.abort, self.request_id, self.loop = abort, request_id, loop
        self.backlog = Backlog(limit, grace, clock)
        self.events: deque[T] = deque()
        self.waiter: asyncio.Future[None] | None = None

    def post(self, ev: T) -> None:
        """The request's sink (engine thread): append first, then wake a waiting caller."""
        too_slow = self.backlog.posted()
        self.events.append(ev)
        if too_slow:
            self.abort(self.request_id, "backlog")
        waiter = self.waiter
        if waiter is None:
            return
        gathered = _gathering.wakeups
        if gathered is not None:  # inside gathered_wakeups(): one call per loop at its end
            gathered.setdefault(self.loop, {})[waiter] = self
            return
        try:
            self.loop.call_soon_threadsafe(wake_waiter, waiter)
        except RuntimeError:  # the caller's loop is gone: nobody is listening
            self.abort(self.request_id, "cancel")

    async def get(self) -> T:
        """The next event (caller's loop). The waiter is published before the re-check, so an
        event appended in between is either seen here or wakes the waiter."""
        while not self.events:
            self.waiter = self.loop.create_future()
            try:
                if not self.events:
                    await self.waiter
            finally:
                self.waiter = None
        ev = self.events.popleft()
        self.backlog.taken()
        return ev


class SyncMailbox(Generic[T]):
    """Events to one caller that blocks in `get` (a thread-safe queue); a caller that is too
    slow (`Backlog`) is reported to the engine (`abort`), once, like `Mailbox`."""

    def __init__(self, abort: Abort, request_id: str, limit: int | None, grace: float = 0.0,
                 clock: Clock = time.monotonic):
        self.abort, self.request_id = abort, request_id
        self.backlog = Backlog(limit, grace, clock)
        self.events: queue.SimpleQueue[T] = queue.SimpleQueue()

    def post(self, ev: T) -> None:
        too_slow = self.backlog.posted()
        self.events.put(ev)
        if too_slow:
            self.abort(self.request_id, "backlog")

    def get(self) -> T:
        ev = self.events.get()
        self.backlog.taken()
        return ev


class Backlog:
    """Whether the caller of one request is too slow: more than `limit` events unread AND the
    oldest of them posted more than `grace` seconds ago. A count alone would cancel a caller
    whose event loop (or thread) is only late for a moment on a busy machine, while events
    pile up at the engine's pace; a caller that stopped reading stays over the limit, and
    its oldest event only gets older. Events held meanwhile are bounded by the request's
    tokens. Says so once (`posted`); grace 0: the count alone decides; no limit: never.

    `posted` runs on the engine thread, `taken` on the caller's, each appending to or popping
    from its own end of a deque of post times (thread-safe in CPython); the unread count is
    the deque's length."""

    __slots__ = ("clock", "grace", "limit", "times", "tripped")

    def __init__(self, limit: int | None, grace: float, clock: Clock = time.monotonic):
        self.limit = 0 if limit is None else limit
        self.grace, self.clock = grace, clock
        self.times: deque[float] = deque()  # when each unread event was posted
        self.tripped = limit is None  # no limit: never too slow, nothing kept

    def posted(self) -> bool:
        """An event is posted (engine thread; counted before the caller can take it). True
        once: the caller is too slow."""
        if self.tripped:
            return False
        times, now = self.times, self.clock()
        times.append(now)
        if len(times) <= self.limit:
            return False
        if self.grace > 0:
            try:
                oldest = times[0]
            except IndexError:  # the caller took them all meanwhile
                return False
            if now - oldest <= self.grace:
                return False
        self.tripped = True
        times.clear()
        return True

    def taken(self) -> None:
        """The caller took an event (its thread; after taking it)."""
        try:
            self.times.popleft()
        except IndexError:  # none kept: no limit, or tripped (then cleared)
            pass


def backlog_limit(max_backlog: int | None, n: object) -> int | None:
    """Unread events a caller of a request with `n` choices may leave: `max_backlog` each."""
    if max_backlog is None:
        return None
    return max_backlog * (n if isinstance(n, int) and n > 0 else 1)


def wake_waiter(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def wake_waiters(waiters: list[asyncio.Future[None]]) -> None:
    for waiter in waiters:
        wake_waiter(waiter)


class _Gathering(threading.local):
    """The wake-ups `gathered_wakeups` holds back on this thread (None outside it)."""

    wakeups: dict[asyncio.AbstractEventLoop, dict[asyncio.Future[None], Mailbox]] | None = None


_gathering = _Gathering()


@contextmanager
def gathered_wakeups() -> Iterator[None]:
    """While the engine thread posts a step's tokens: the `Mailbox` wake-ups it would send
    one by one go out at the end, one `call_soon_threadsafe` per event loop. Each of those
    writes to the loop's wake-up pipe and lets the loop thread take the GIL; sixteen streams
    on one loop made sixteen a step."""
    if _gathering.wakeups is not None:  # nested: the outer one sends
        yield
        return
    wakeups: dict[asyncio.AbstractEventLoop, dict[asyncio.Future[None], Mailbox]]
    _gathering.wakeups = wakeups = {}
    try:
        yield
    finally:
        _gathering.wakeups = None
        for loop, waiting in wakeups.items():
            try:
                loop.call_soon_threadsafe(wake_waiters, list(waiting))
            except RuntimeError:  # that loop is gone: nobody is listening
                for mailbox in waiting.values():
                    mailbox.abort(mailbox.request_id, "cancel")


def drop_event(event: Event) -> None:
    """The sink of a finished request: nobody listens any more."""
