"""Engine: one thread owns the model and its KV cache; callers stream events from any loop.

Each step: admit waiting requests, run one prefill chunk and one batched decode forward,
sample every running sequence, and post its events to its caller (an asyncio queue via
`call_soon_threadsafe`, or a plain thread-safe queue for the sync helpers). Closing the
caller's iterator aborts the request: its slot is free at the next step.

Reliability: a request that waits more than `queue_timeout` s for a slot fails with a clear
error; a caller that stops reading (more than `max_backlog` events undelivered) is cancelled;
if the engine thread dies it restarts with a fresh cache and scheduler (`restart_on_failure`).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import queue
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterator

import torch

from .cpu_threads import ThreadTuner, torch_threads
from .engine_stats import EngineStats
from .loading.bundle import LoadedModel
from .sampling import SeqSampler, sample
from .scheduler import PrefillWork, Scheduler, Sequence, StepPlan
from .sync_helpers import SyncHelpers
from .text import IncrementalDetokenizer, StopStringMatcher
from .types import (
    BusyError, ContextLengthError, Delta, EngineStoppedError, ErrorEvent, Event, Finished,
    InvalidRequestError, Request, SamplingParams, Started, TokenLogprob, Usage,
)

log = logging.getLogger("nbserve.engine")
Sink = Callable[[Event], None]


@dataclass(eq=False)
class _Choice:
    """Per-choice text state: sampler, detokenizer, stop-string matcher."""

    sampler: SeqSampler
    detok: IncrementalDetokenizer
    stopper: StopStringMatcher
    first_token_time: float = 0.0
    last_token_time: float = 0.0


@dataclass(eq=False)
class _Group:
    """One request in flight: its n sequences and where its events go."""

    request_id: str
    params: SamplingParams
    prompt_ids: list[int]
    stop_ids: frozenset[int]
    sink: Sink
    seqs: list[Sequence] = field(default_factory=list)
    choices: list[_Choice] = field(default_factory=list)
    remaining: int = 0
    completion_tokens: int = 0
    submitted: float = 0.0
    first_token: float = 0.0
    admitted: bool = False
    done: bool = False

    def usage(self) -> Usage:
        s = self.seqs[0]
        return Usage(len(self.prompt_ids), self.completion_tokens, s.cached_prompt)


def _count_down(remaining: int, ev: Event) -> tuple[int, bool]:
    """One event of a request with `remaining` choices unfinished: (remaining, finished)."""
    remaining -= isinstance(ev, Finished)
    return remaining, remaining == 0 or isinstance(ev, ErrorEvent)


class Engine(SyncHelpers):
    """Continuous-batching engine for one model on one device (a `Backend`)."""

    restart_delay = 1.0  # seconds between a crash of the engine thread and its restart

    def __init__(self, model: LoadedModel | Any, *, max_batch: int = 16,
                 max_context: int | None = None, max_queue: int = 256, prefill_chunk: int = 512,
                 name: str | None = None, device: str | None = None, dtype: Any = None,
                 quiet: bool = False, queue_timeout: float | None = 600.0,
                 max_backlog: int | None = 1024, restart_on_failure: bool = True,
                 threads: int | None = None):
        """`queue_timeout`: seconds a request may wait for a slot before it fails (None: no
        limit). `max_backlog`: events per choice a caller may leave unread before its request is
        cancelled (None: no limit). `restart_on_failure`: restart the engine thread if it dies.
        `threads`: torch intra-op threads of the engine thread only (the caller's setting is
        untouched); default on CPU: chosen per forward size by timing (`cpu_threads`)."""
        if not isinstance(model, LoadedModel):
            from .loading import load

            model = load(model, device=device, dtype=dtype)
        with torch_threads(1):  # no OpenMP pool in the caller's thread: see cpu_threads
            self._init(model, max_batch, max_context, max_queue, prefill_chunk, name, quiet,
                       queue_timeout, max_backlog, restart_on_failure, threads)

    def _init(self, model: LoadedModel, max_batch: int, max_context: int | None,
              max_queue: int, prefill_chunk: int, name: str | None, quiet: bool,
              queue_timeout: float | None, max_backlog: int | None, restart_on_failure: bool,
              threads: int | None) -> None:
        self.loaded = model
        self.model = model.model
        self.tokenizer = model.tokenizer
        self.template = model.template
        self.model_name = name or model.name
        for arg, val, lo in (("max_batch", max_batch, 1), ("max_queue", max_queue, 1),
                             ("prefill_chunk", prefill_chunk, 1)):
            if not isinstance(val, int) or val < lo:
                raise ValueError(f"{arg} must be an integer >= {lo}, got {val!r}")
        model_ctx = int(self.model.max_context)
        if max_context is None:
            max_context = min(model_ctx, 4096)
        if not 2 <= max_context <= model_ctx:
            raise ValueError(f"max_context must be between 2 and the model's {model_ctx}, "
                             f"got {max_context}")
        if queue_timeout is not None and not (isinstance(queue_timeout, (int, float))
                                              and queue_timeout > 0):
            raise ValueError(f"queue_timeout must be a number of seconds > 0 (or None for no "
                             f"limit), got {queue_timeout!r}")
        if max_backlog is not None and (not isinstance(max_backlog, int) or max_backlog < 1):
            raise ValueError(f"max_backlog must be an integer >= 1 (or None for no limit), got "
                             f"{max_backlog!r}")
        self.max_batch, self.max_context, self.max_queue = max_batch, max_context, max_queue
        if threads is not None and (not isinstance(threads, int) or threads < 1):
            raise ValueError(f"threads must be an integer >= 1 (or None: tuned), got {threads!r}")
        on_cpu = torch.device(self.model.device).type == "cpu"
        self.threads = threads
        self._tuner = ThreadTuner() if on_cpu and threads is None else None
        self.queue_timeout, self.max_backlog = queue_timeout, max_backlog
        self.restart_on_failure = restart_on_failure
        self.restarts = 0
        self.prefill_chunk = prefill_chunk
        self.vocab_size = int(self.model.vocab_size)
        self.stop_token_ids = list(model.stop_token_ids)
        self.cache = self.model.make_cache(max_batch, max_context)
        self._hints = accepts_hints(self.model.forward)
        # right-padded prefill rows only for models that say they handle them (StepModel doc)
        self._padded_rows = bool(getattr(self.model, "accepts_padded_rows", False))
        self.scheduler = Scheduler(max_batch, prefill_chunk)
        self.stats_ = EngineStats()
        self._lock = threading.Condition()
        self._inbox: deque[tuple[_Group, list[Sequence]]] = deque()
        # (group, why): "cancel" (the caller left), "shutdown" (cancel_all) or "backlog"
        self._aborts: deque[tuple[_Group, str]] = deque()
        self._groups: dict[str, _Group] = {}
        self._queued = 0  # requests submitted and not yet admitted (bounded by max_queue)
        self._stopping = False
        self._closed = False
        self._dead = False  # the engine thread died (and may be restarting)
        self._restart_timer: threading.Timer | None = None
        self._thread = self._new_thread()
        if not quiet:
            print(f"nbserve: KV cache {max_batch} slots x {max_context} tokens, "
                  f"{self.cache.nbytes / 2**20:.0f} MiB on {self.model.device}", flush=True)
        self._thread.start()

    # ------------------------------------------------------------------ public API

    async def generate(self, request: Request) -> AsyncIterator[Event]:
        """Stream the events of `request`. Raises before the first event if it is refused."""
        mailbox = _Mailbox(self, request.request_id, asyncio.get_running_loop(),
                           self._backlog_limit(request))
        group = self.submit(request, mailbox.post)
        remaining, finished = group.params.n, False
        try:
            while not finished:
                ev = await mailbox.get()
                remaining, finished = _count_down(remaining, ev)
                yield ev
        finally:
            if not finished:
                self.abort(group.request_id)

    def stream(self, request: Request) -> Iterator[Event]:
        """Sync version of `generate`, for scripts and notebook cells. Submits at once (so a
        refusal raises here); closing the returned iterator cancels the request."""
        events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        limit, tripped = self._backlog_limit(request), False

        def sink(ev: Event) -> None:
            nonlocal tripped
            events.put(ev)
            if limit is not None and not tripped and events.qsize() > limit:
                tripped = True
                self.abort(request.request_id, "backlog")

        group = self.submit(request, sink)
        return self._iterate(group, events)

    def _backlog_limit(self, request: Request) -> int | None:
        """Unread events allowed to `request`'s caller: `max_backlog` per choice."""
        n = request.params.n
        if self.max_backlog is None:
            return None
        return self.max_backlog * (n if isinstance(n, int) and n > 0 else 1)

    def _iterate(self, group: _Group, events: queue.SimpleQueue[Event]) -> Iterator[Event]:
        remaining, finished = group.params.n, False
        try:
            while not finished:
                ev = events.get()
                remaining, finished = _count_down(remaining, ev)
                yield ev
        finally:
            if not finished:
                self.abort(group.request_id)

    def abort(self, request_id: str, why: str = "cancel") -> None:
        """Cancel a request; its slot is freed at the next step. Unknown ids are ignored."""
        with self._lock:
            group = self._groups.get(request_id)
            if group is not None and not group.done:
                self._aborts.append((group, why))
                self._lock.notify()

    def cancel_all(self) -> int:
        """Cancel every request (for a shutdown): running ones finish with reason "cancelled",
        keeping the text they have; waiting ones end with a "service_unavailable" error.
        Returns how many requests were cancelled."""
        with self._lock:
            groups = [g for g in self._groups.values() if not g.done]
            self._aborts.extend((g, "shutdown") for g in groups)
            self._lock.notify()
        return len(groups)

    def stats(self) -> dict[str, Any]:
        s = self.scheduler
        return self.stats_.snapshot(
            running=len(s.running), waiting=self._queued,
            slots_used=self.max_batch - s.slots.n_free, slots_total=self.max_batch,
            kv_cache_bytes=getattr(self.cache, "nbytes", 0), max_context=self.max_context,
            device=str(self.model.device), dtype=str(self.model.dtype).replace("torch.", ""),
            threads=self.threads or (self._tuner.summary() if self._tuner else None))

    def health(self) -> dict[str, Any]:
        alive = self._thread.is_alive() and not (self._dead or self._stopping)
        restarting = not alive and self._restart_timer is not None and not self._stopping
        st = self.stats()
        return {"ready": alive, "status": "ready" if alive else
                "restarting" if restarting else "stopped",
                "running": st["running"], "waiting": st["waiting"], "replicas": 1,
                "model": self.model_name, "restarts": self.restarts}

    def close(self) -> None:
        """Stop the engine thread; pending requests end with an error event. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = self._stopping = True
            self._lock.notify_all()
            timer = self._restart_timer
        if timer is not None and threading.current_thread() is not timer:
            timer.cancel()
            timer.join(timeout=30)
        with self._lock:
            thread = self._thread
        if threading.current_thread() is not thread:
            thread.join(timeout=30)
        for group in list(self._groups.values()):
            self._fail(group, "the engine was stopped", "service_unavailable")
        self._groups.clear()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Engine({self.model_name!r}, device={self.model.device}, max_batch="
                f"{self.max_batch}, max_context={self.max_context})")

    # ------------------------------------------------------------------ submission

    def prepare_prompt(self, request: Request) -> list[int]:
        """Token ids of the request's prompt (chat template applied for messages)."""
        request.check_input()
        if request.prompt_ids is not None:
            ids = list(request.prompt_ids)
            bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"prompt token ids must be integers in [0, {self.vocab_size}), got {bad[0]!r}",
                    param="prompt")
        elif request.messages is not None:
            if not request.messages:
                raise InvalidRequestError("messages must not be empty", param="messages")
            if self.template is None:
                raise InvalidRequestError(
                    f"model {self.model_name!r} has no chat template: send a raw prompt or "
                    "pass chat_template= when loading", param="messages")
            text = self.template.render(request.messages, tools=request.tools,
                                        add_generation_prompt=request.add_generation_prompt)
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = self.tokenizer.encode(request.prompt, add_special_tokens=True)
        if not ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if len(ids) >= self.max_context:
            raise ContextLengthError(len(ids), self.max_context,
                                     param="messages" if request.messages else "prompt")
        return ids

    def submit(self, request: Request, sink: Sink) -> "_Group":
        """Validate and queue `request`; events go to `sink` (called from the engine thread).
        Raises InvalidRequestError, ContextLengthError, BusyError or EngineStoppedError."""
        self._check_running()
        params = request.params
        params.validate(self.vocab_size)
        if params.n > self.max_batch:
            raise InvalidRequestError(
                f"n must be at most max_batch={self.max_batch}, got {params.n}", param="n")
        ids = self.prepare_prompt(request)
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(self.stop_token_ids)
        group = _Group(request.request_id, params, ids, frozenset(stop_ids), sink,
                       remaining=params.n, submitted=time.perf_counter())
        device = self.model.device
        for i in range(params.n):
            group.seqs.append(Sequence(group, i, ids))
            group.choices.append(_Choice(
                SeqSampler.create(params, ids, device, seed_offset=i),
                IncrementalDetokenizer(self.tokenizer),
                StopStringMatcher(params.stop)))
        with self._lock:
            self._check_running()
            if request.request_id in self._groups:
                raise InvalidRequestError(f"request id {request.request_id!r} is in use",
                                          param="request_id")
            if self._queued >= self.max_queue:
                self.stats_.rejected += 1
                raise BusyError(f"the server is busy: {self._queued} requests are waiting "
                                f"(max_queue={self.max_queue}); retry soon")
            self._queued += 1
            self._groups[request.request_id] = group
            self._inbox.append((group, list(group.seqs)))
            self._lock.notify()
        return group

    def _check_running(self) -> None:
        if self._stopping:
            raise EngineStoppedError("the engine is not running (stopped or shutting down)")
        if self._dead or not self._thread.is_alive():
            raise EngineStoppedError(
                "the engine thread crashed and is restarting; retry in a few seconds"
                if self._restart_timer is not None else
                "the engine thread crashed (see the log); create a new Engine, or pass "
                "restart_on_failure=True to restart it by itself")

    # ------------------------------------------------------------------ engine thread

    def _new_thread(self) -> threading.Thread:
        return threading.Thread(target=self._run, name=f"nbserve-engine-{id(self):x}",
                                daemon=True)

    def _run(self) -> None:
        """The engine thread: `_loop`, and what happens if something kills it."""
        try:
            self._loop()
        except BaseException as exc:  # the thread dies: recover or report
            log.critical("the engine thread died: %r", exc, exc_info=True)
            with self._lock:
                self._dead = True
                if self._stopping:
                    return
                restart = self.restart_on_failure
                if restart:
                    self._restart_timer = threading.Timer(self.restart_delay, self._restart)
                    self._restart_timer.name = f"nbserve-engine-restart-{id(self):x}"
                    self._restart_timer.daemon = True
                    self._restart_timer.start()
            if not restart:
                self._fail_all("the engine thread crashed while this request was in flight; "
                               "the engine is stopped", "service_unavailable")

    def _restart(self) -> None:
        """After a crash: fail what was in flight, then a fresh cache, scheduler and thread."""
        with self._lock:
            if self._stopping:
                return
        self._fail_all("the engine thread crashed while this request was in flight; it has "
                       "restarted: retry the request", "service_unavailable")
        try:
            self.cache = None  # free the old cache before allocating the new one
            cache = self.model.make_cache(self.max_batch, self.max_context)
        except Exception:
            log.exception("the engine could not restart: it stays stopped")
            with self._lock:
                self._restart_timer = None
            return
        with self._lock:
            self._restart_timer = None
            if self._stopping:
                return
            self.cache, self.scheduler = cache, Scheduler(self.max_batch, self.prefill_chunk)
            self.restarts += 1
            self._dead = False
            self._thread = self._new_thread()
            self._thread.start()
        log.warning("the engine restarted (restart %d)", self.restarts)

    def _fail_all(self, message: str, kind: str) -> None:
        """End every request with an error, without touching the (possibly broken) scheduler."""
        with self._lock:
            groups = list(self._groups.values())
            self._groups.clear()
            self._inbox.clear()
            self._aborts.clear()
            self._queued = 0
        for group in groups:
            if not group.done:
                group.done, group.remaining = True, 0
                self.stats_.finished["error"] = self.stats_.finished.get("error", 0) + 1
                group.sink(ErrorEvent(message, kind, group.request_id))
                group.sink = _drop

    def _loop(self) -> None:
        if self.threads:
            torch.set_num_threads(self.threads)  # per-thread setting: only the engine's ops
        while True:
            with self._lock:
                while not (self._stopping or self._inbox or self._aborts
                           or self.scheduler.running or self.scheduler.waiting):
                    self._lock.wait()
                if self._stopping:
                    return
            try:
                self.step()
            except Exception:  # a bug in bookkeeping: fail everything running, keep serving
                log.exception("engine step failed")
                for seq in list(self.scheduler.running):
                    self._fail(seq.group, "internal engine error", "server_error")

    def step(self) -> bool:
        """Run one engine step. Returns False when there was nothing to do."""
        t0 = time.perf_counter()
        self._drain()
        self._expire_waiting()
        plan = self.scheduler.schedule()
        if plan.empty:
            return False
        for seq in plan.admitted:
            g = seq.group
            self._mark_admitted(g)
            g.sink(Started(g.request_id, len(g.prompt_ids), seq.cached_prompt, g.prompt_ids))
        model_time = sample_time = 0.0
        if plan.decode:
            m, s = self._run_decode(plan)
            model_time, sample_time = model_time + m, sample_time + s
        if plan.prefills:
            m, s = self._run_prefills(plan.prefills)
            model_time, sample_time = model_time + m, sample_time + s
        self.stats_.record_step(time.perf_counter() - t0, model_time, sample_time,
                                len(plan.decode))
        return True

    def _drain(self) -> None:
        with self._lock:
            inbox, aborts = list(self._inbox), list(self._aborts)
            self._inbox.clear()
            self._aborts.clear()
        for group, seqs in inbox:
            self.scheduler.add(seqs)
        for group, why in aborts:
            if why == "backlog":
                self._fail(group, f"the client left more than max_backlog={self.max_backlog} "
                           "events per choice of this stream unread, so the request was "
                           "cancelled to free its slot; read the stream as it arrives",
                           "client_too_slow")
            elif why == "shutdown" and not group.admitted:
                self._fail(group, "the server is shutting down and this request had not "
                           "started; retry it later or on another server", "service_unavailable")
            else:
                self._end_group(group, "cancelled")

    def _expire_waiting(self) -> None:
        """Fail the requests that waited longer than `queue_timeout` for a slot (FIFO order)."""
        if self.queue_timeout is None:
            return
        now = time.perf_counter()
        while self.scheduler.waiting:
            group: _Group = self.scheduler.waiting[0][0].group
            waited = now - group.submitted
            if waited < self.queue_timeout:
                return
            self._fail(group, f"the request waited {waited:.1f} s for a free slot, longer than "
                       f"queue_timeout={self.queue_timeout:g} s: the server is overloaded; retry "
                       "later (or raise queue_timeout / max_batch)", "queue_timeout")

    def _run_decode(self, plan: StepPlan) -> tuple[float, float]:
        seqs = plan.decode
        dev = self.model.device
        slots_l = [s.slot for s in seqs]
        pos_l = [s.computed for s in seqs]
        ids = torch.tensor([[s.output_ids[-1]] for s in seqs], device=dev)
        positions = torch.tensor(pos_l, device=dev).unsqueeze(1)
        slots = torch.tensor(slots_l, device=dev)
        contiguous = slots_l[0] if slots_l == list(range(slots_l[0], slots_l[0] + len(seqs))) \
            else None
        t0 = time.perf_counter()
        try:
            hints = dict(max_pos=max(pos_l), contiguous_from=contiguous) if self._hints else {}
            with self._threads_for(len(seqs)):
                logits = self.model.forward(ids, positions, slots, self.cache,
                                            logit_index=torch.zeros(len(seqs), dtype=torch.long,
                                                                    device=dev), **hints)
        except Exception as exc:
            self._fail_step(seqs, exc)
            return time.perf_counter() - t0, 0.0
        t1 = time.perf_counter()
        for s in seqs:
            s.computed += 1
        self.stats_.decoded += len(seqs)
        self._sample_and_emit(seqs, logits)
        return t1 - t0, time.perf_counter() - t1

    def _run_prefills(self, works: list[PrefillWork]) -> tuple[float, float]:
        """Prefill this step's chunks: in one padded forward when padding wastes little
        (a burst of similar prompts reads the weights once), else one forward each."""
        real = sum(len(w.ids) for w in works)
        width = max(len(w.ids) for w in works)
        padded = any(len(w.ids) != width for w in works)
        wasteful = width * len(works) > 1.25 * real
        if len(works) > 1 and ((padded and not self._padded_rows) or wasteful):
            times = [self._run_prefills([w]) for w in works]
            return sum(t[0] for t in times), sum(t[1] for t in times)
        dev = self.model.device
        limit = self.max_context - 1  # pad positions stay inside the cache, past real tokens
        pos_rows = [[min(w.start + j, limit) for j in range(width)] for w in works]
        ids = torch.tensor([w.ids + [0] * (width - len(w.ids)) for w in works], device=dev)
        positions = torch.tensor(pos_rows, device=dev)  # (B, T)
        slots = torch.tensor([w.seq.slot for w in works], device=dev)
        last = torch.tensor([len(w.ids) - 1 for w in works], device=dev)
        t0 = time.perf_counter()
        try:
            hints = dict(max_pos=max(r[-1] for r in pos_rows),
                         contiguous_from=works[0].seq.slot if len(works) == 1 else None) \
                if self._hints else {}
            with self._threads_for(real):
                logits = self.model.forward(ids, positions, slots, self.cache,
                                            logit_index=last, **hints)
        except Exception as exc:
            self._fail_step([w.seq for w in works], exc)
            return time.perf_counter() - t0, 0.0
        t1 = time.perf_counter()
        for i, work in enumerate(works):
            self._after_prefill(work, logits[i:i + 1])
        return t1 - t0, time.perf_counter() - t1

    @contextlib.contextmanager
    def _threads_for(self, tokens: int) -> Iterator[None]:
        """Run a forward over `tokens` tokens with the thread count the tuner picks, and tell
        it how long that took (see `cpu_threads`). No-op off CPU or with fixed `threads`."""
        if self._tuner is None:
            yield
            return
        n = self._tuner.choose(tokens)
        torch.set_num_threads(n)
        t0 = time.perf_counter()
        yield
        self._tuner.record(tokens, n, time.perf_counter() - t0)

    def _after_prefill(self, work: PrefillWork, logits: torch.Tensor) -> None:
        """Advance the sequence; after its last chunk, fork n > 1 and sample first tokens."""
        seq = work.seq
        seq.computed += len(work.ids)
        self.stats_.prefilled += len(work.ids)
        if not work.last:
            return
        group: _Group = seq.group
        self.stats_.reused += seq.cached_prompt
        for sib in group.seqs[1:]:  # n > 1: share the prefill
            if not sib.finished:
                self.cache.copy_prefix(seq.slot, sib.slot, seq.computed)
                sib.computed, sib.parent = seq.computed, None
        live = [s for s in group.seqs if not s.finished]
        self._sample_and_emit(live, logits.expand(len(live), -1))

    def _sample_and_emit(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        groups = [s.group for s in seqs]
        out = sample(logits, [g.choices[s.index].sampler for g, s in zip(groups, seqs)])
        now = time.perf_counter()
        for seq, group, tok, lp in zip(seqs, groups, out.token_ids, out.logprobs):
            self._emit_token(seq, group, tok, lp, now)

    def _emit_token(self, seq: Sequence, group: _Group, tok: int, lp: TokenLogprob | None,
                    now: float) -> None:
        choice = group.choices[seq.index]
        params = group.params
        seq.output_ids.append(tok)
        choice.sampler.observe(tok)
        group.completion_tokens += 1
        if not group.first_token:
            group.first_token = now
            self.stats_.ttft.append(now - group.submitted)
        if choice.last_token_time:
            self.stats_.itl.append(now - choice.last_token_time)
        else:
            choice.first_token_time = now
        choice.last_token_time = now
        reason, matched = None, None
        text = ""
        if tok in group.stop_ids:
            reason, matched = "stop", tok
        else:
            text, matched = choice.stopper.feed(choice.detok.add([tok]))
            if matched is not None:
                reason = "stop"
        if reason is None and params.max_tokens is not None and \
                len(seq.output_ids) >= params.max_tokens:
            reason = "length"
        if reason is None and seq.total_len >= self.max_context:
            reason = "length"
        if reason is not None and matched is None:  # flush what was held back
            tail, late = choice.stopper.feed(choice.detok.finish())
            text += tail if late is not None else tail + choice.stopper.flush()
        if lp is not None:
            lp.token = self.tokenizer.decode([tok])
            lp.bytes = list(self.tokenizer.token_bytes(tok))
            lp.top = [(i, self.tokenizer.decode([i]), v) for i, _, v in lp.top]
        if text or lp is not None or reason is None:
            group.sink(Delta(seq.index, text, [tok], [lp] if lp is not None else None))
        if reason is not None:
            self._finish_seq(seq, group, reason, matched)

    def _finish_seq(self, seq: Sequence, group: _Group, reason: str, matched: Any = None,
                    keep_cache: bool = True) -> None:
        if seq.finished:
            return
        self.scheduler.finish(seq, keep_cache=keep_cache)
        group.remaining -= 1
        if group.remaining == 0:
            group.done = True
            with self._lock:
                self._groups.pop(group.request_id, None)
            self.stats_.finished[reason] = self.stats_.finished.get(reason, 0) + 1
        choice = group.choices[seq.index]
        n_out = len(seq.output_ids)
        ttft = choice.first_token_time - group.submitted if choice.first_token_time else None
        itl = (choice.last_token_time - choice.first_token_time) / (n_out - 1) \
            if n_out > 1 and choice.first_token_time else None
        group.sink(Finished(seq.index, reason, group.usage(), matched, ttft_s=ttft, itl_s=itl))
        if group.done:
            group.sink = _drop  # the caller's closure may reference us: no cycle once done

    def _mark_admitted(self, group: _Group) -> None:
        """The request left the queue (admitted, or ended while waiting)."""
        if not group.admitted:
            group.admitted = True
            with self._lock:
                self._queued -= 1

    def _end_group(self, group: _Group, reason: str) -> None:
        self._mark_admitted(group)
        for seq in group.seqs:
            self._finish_seq(seq, group, reason)

    def _fail(self, group: _Group, message: str, kind: str) -> None:
        if group.done:
            return
        self._mark_admitted(group)
        for seq in group.seqs:
            self.scheduler.finish(seq, keep_cache=False)
        group.done = True
        group.remaining = 0
        with self._lock:
            self._groups.pop(group.request_id, None)
        self.stats_.finished["error"] = self.stats_.finished.get("error", 0) + 1
        group.sink(ErrorEvent(message, kind, group.request_id))
        group.sink = _drop

    def _fail_step(self, seqs: list[Sequence], exc: Exception) -> None:
        log.error("model forward failed for %d sequences: %s\n%s", len(seqs), exc,
                  traceback.format_exc())
        self.stats_.errors += 1
        for seq in seqs:
            self._fail(seq.group, f"the model failed on this request: {exc}", "server_error")


class _Mailbox:
    """Events from the engine thread to one async caller. The engine appends without waking
    the caller's loop unless the caller waits for an event, so a caller stuck elsewhere (on a
    client that stopped reading) costs the loop nothing; past `limit` unread events it asks the
    engine, once, to cancel the request."""

    __slots__ = ("engine", "events", "limit", "loop", "request_id", "tripped", "waiter")

    def __init__(self, engine: Engine, request_id: str, loop: asyncio.AbstractEventLoop,
                 limit: int | None):
        self.engine, self.request_id, self.loop, self.limit = engine, request_id, loop, limit
        self.events: deque[Event] = deque()
        self.waiter: asyncio.Future[None] | None = None
        self.tripped = False

    def post(self, ev: Event) -> None:
        """The request's sink (engine thread): append first, then wake a waiting caller."""
        self.events.append(ev)
        if self.limit is not None and not self.tripped and len(self.events) > self.limit:
            self.tripped = True
            self.engine.abort(self.request_id, "backlog")
        waiter = self.waiter
        if waiter is not None:
            try:
                self.loop.call_soon_threadsafe(_wake, waiter)
            except RuntimeError:  # the caller's loop is gone: nobody is listening
                self.engine.abort(self.request_id)

    async def get(self) -> Event:
        """The next event (caller's loop). The waiter is published before the re-check, so an
        event appended in between is either seen here or wakes the waiter."""
        while not self.events:
            self.waiter = self.loop.create_future()
            try:
                if not self.events:
                    await self.waiter
            finally:
                self.waiter = None
        return self.events.popleft()


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def accepts_hints(forward: Callable[..., Any]) -> bool:
    """Whether a StepModel's forward takes the optional `max_pos` / `contiguous_from` hints."""
    try:
        inspect.signature(forward).bind(0, 0, 0, 0, logit_index=None, max_pos=0,
                                        contiguous_from=None)
        return True
    except (TypeError, ValueError):
        return False


def _drop(event: Event) -> None:
    """The sink of a finished request: nobody listens any more."""
