"""Engine: one thread owns the model and its KV cache; callers stream events from any loop.

`Engine` is the thread-safe front: submission and validation, the inbox the engine thread
drains, abort, stats, and the thread's lifecycle (restart after a crash, the stall watch).
The work of each step runs in `EngineStep` (step.py), which only the engine thread touches.
Events reach an async caller through a `Mailbox`, a sync caller through a `SyncMailbox`
(requests.py).

Reliability: a request that waits more than `queue_timeout` s for a slot fails with a clear
error; a caller that stops reading (more than `max_backlog` events undelivered, the oldest for
more than `slow_client_timeout` s) is cancelled;
if the engine thread dies it restarts with a fresh cache and scheduler (`restart_on_failure`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from ..cpu.openmp_pool import release_after_each_cell, release_openmp_pool
from ..cpu.threads import torch_threads
from ..execution.weights import weight_summary
from ..models.adapters.step_model import served
from ..models.base import LoadedModel, SlotModel, StepModel
from ..models.dtypes import weights_of
from ..text import IncrementalDetokenizer, StopStringMatcher
from ..text.reasoning import ThoughtRule, starts_inside, thinks, thought_rule
from ..text.tool_calls import HERMES, ToolFormat
from ..types import (
    BusyError,
    ContextLengthError,
    EngineStoppedError,
    Event,
    InvalidRequestError,
    JSONObject,
    Request,
)
from .adapters import EngineAdapters
from .config import EngineConfig
from .constraints import Grammars, grammars_for, has_grammars
from .embedding import Pooler, check_embed
from .requests import (
    ChoiceState,
    Mailbox,
    RequestGroup,
    Sink,
    SyncMailbox,
    backlog_limit,
    count_down,
)
from .sampling import SeqSampler
from .scheduler import Scheduler, Sequence
from .stall_watch import StallWatch
from .stats import EngineStats
from .step import EngineStep
from .sync_helpers import SyncHelpers

if TYPE_CHECKING:
    from llguidance import LLMatcher

log = logging.getLogger("nbserve.engine")


class Engine(SyncHelpers):
    """Continuous-batching engine for one model on one device (a `Backend`).

    `model`: a LoadedModel, or anything `nbserve.load` takes (then `device`, `dtype`,
    `weights` and `exact` go to the loader). The options are `EngineConfig`'s: pass a
    `config`, keywords, or both (the keywords win)."""

    restart_delay = 1.0  # seconds between a crash of the engine thread and its restart

    def __init__(self, model: object, config: EngineConfig | None = None, *,
                 device: str | None = None, dtype: str | torch.dtype | None = None,
                 weights: str = "auto", exact: bool = False, **options: Any):
        self.config = config = EngineConfig.from_options(config, **options)
        if not isinstance(model, LoadedModel):
            from ..loading import load

            model = load(model, device=device, dtype=dtype, weights=weights, exact=exact)
        release_openmp_pool()  # the caller's pool would slow the engine thread: see there
        release_after_each_cell()
        with torch_threads(1):  # no OpenMP pool in the caller's thread: see cpu.threads
            self._init(model, config)

    def _init(self, model: LoadedModel, config: EngineConfig) -> None:
        self.loaded = model
        model_ = model.model
        self.tokenizer = model.tokenizer
        self.template = model.template
        self.model_name = config.name or model.name
        self.max_queue = config.max_queue
        self.queue_timeout, self.max_backlog = config.queue_timeout, config.max_backlog
        self.slow_client_timeout = config.slow_client_timeout
        self.restart_on_failure, self.step_timeout = config.restart_on_failure, config.step_timeout
        self.threads, self.prefill_chunk = config.threads, config.prefill_chunk
        self.restarts = 0
        self.vocab_size = int(model_.vocab_size)
        self.stop_token_ids = list(model.stop_token_ids)
        self._counters = EngineStats()
        self._weights = weight_summary(model_)  # (bytes, format) as served: for stats()
        self._step = EngineStep(model, config, self._counters, self)
        self._adapters = EngineAdapters(self._step.model, self.model_name)
        self.max_batch, self.max_context = self._step.max_batch, self._step.max_context
        self._lock = threading.Condition()
        self._inbox: deque[tuple[RequestGroup, list[Sequence]]] = deque()
        # (group, why): "cancel" (the caller left), "shutdown" (cancel_all) or "backlog"
        self._aborts: deque[tuple[RequestGroup, str]] = deque()
        self._groups: dict[str, RequestGroup] = {}
        self._queued = 0  # requests submitted and not yet admitted (bounded by max_queue)
        self._stopping = False
        self._closed = False
        self._dead = False  # the engine thread died (and may be restarting)
        self._restart_timer: threading.Timer | None = None
        self._stalled = False  # a step ran past step_timeout and has not returned yet
        self._stall_watch = None if config.step_timeout is None else StallWatch(
            config.step_timeout, self._on_stall, f"nbserve-stall-watch-{id(self):x}")
        self._thread = self._new_thread()
        if not config.quiet:
            print(f"nbserve: {self.describe_cache()}", flush=True)
        self._thread.start()

    @property
    def model(self) -> SlotModel:
        """The model the engine runs (owned by the step; a `PagedModel` is one too; a user's
        StepModel is wrapped, see `models.adapters.step_model`). Replaceable, e.g. to inject a
        fault in a test: the new one is wrapped likewise, and runs on the cache and path of
        the one it replaces."""
        return self._step.model

    @model.setter
    def model(self, value: StepModel | SlotModel) -> None:
        self._step.model = served(value)

    @property
    def cache(self) -> Any:
        """The KV cache (owned by the step; the model's own type)."""
        return self._step.cache

    @property
    def scheduler(self) -> Scheduler:
        """The scheduler (owned by the step; read it from the engine thread only)."""
        return self._step.scheduler

    # ------------------------------------------------------------------ StepHooks

    def admitted(self, group: RequestGroup) -> None:
        with self._lock:
            self._queued -= 1

    def done(self, group: RequestGroup) -> None:
        with self._lock:
            self._groups.pop(group.request_id, None)

    # ------------------------------------------------------------------ public API

    async def generate(self, request: Request) -> AsyncIterator[Event]:
        """Stream the events of `request`. Raises before the first event if it is refused."""
        mailbox: Mailbox[Event] = Mailbox(self.abort, request.request_id,
                                          asyncio.get_running_loop(), self._backlog_limit(request),
                                          self.slow_client_timeout)
        if (request.tools or request.params.constraint is not None) and \
                not has_grammars(self.tokenizer, self.vocab_size):
            await asyncio.to_thread(self.grammars)  # built once, off the caller's loop
        group = self.submit(request, mailbox.post)
        remaining, finished = group.params.n, False
        try:
            while not finished:
                ev = await mailbox.get()
                remaining, finished = count_down(remaining, ev)
                yield ev
        finally:
            if not finished:
                self.abort(group.request_id)

    def stream(self, request: Request) -> Iterator[Event]:
        """Sync version of `generate`, for scripts and notebook cells. Submits at once (so a
        refusal raises here); closing the returned iterator cancels the request."""
        mailbox: SyncMailbox[Event] = SyncMailbox(self.abort, request.request_id,
                                                   self._backlog_limit(request),
                                                   self.slow_client_timeout)
        group = self.submit(request, mailbox.post)
        return self._iterate(group, mailbox)

    def _backlog_limit(self, request: Request) -> int | None:
        """Unread events allowed to `request`'s caller: `max_backlog` per choice."""
        return backlog_limit(self.max_backlog, request.params.n)

    def _iterate(self, group: RequestGroup, events: SyncMailbox[Event]) -> Iterator[Event]:
        remaining, finished = group.params.n, False
        try:
            while not finished:
                ev = events.get()
                remaining, finished = count_down(remaining, ev)
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

    @property
    def static_decode(self) -> dict[str, Any] | None:
        """How decode steps run at fixed shapes (`EngineConfig.static_decode`): the buckets,
        the CUDA graphs captured (0: eager), a capture error, steps run and replayed; None
        where they do not."""
        static = self._step.static
        return None if static is None else static.describe()

    def describe_cache(self) -> str:
        """The KV cache in one line: budget, blocks, the largest context one request gets."""
        budget = self._step.budget
        size = self._step.cache_bytes / 2**20
        if budget is None:
            return (f"KV cache {self.max_batch} rows x {self.max_context} tokens, {size:.0f} MiB "
                    f"on {self.model.device}")
        return (f"KV cache {budget.n_blocks} blocks x {budget.block_size} tokens = "
                f"{budget.tokens} tokens, {size:.0f} MiB ({budget.source}; "
                f"{str(self._step.kv_dtype).replace('torch.', '')}) on {self.model.device}, "
                f"committed as used; up to {self.max_batch} sequences, "
                f"{self.max_context} tokens each at most")

    def cached_prefix(self, ids: list[int]) -> int:
        """Tokens of `ids` whose keys/values this engine's cache holds now (any thread: a
        racy read, good enough for routing)."""
        try:
            return self._step.space.cached_prefix(ids, len(ids))[0]
        except (RuntimeError, KeyError, IndexError):  # the engine thread changed it meanwhile
            return 0

    def stats(self) -> JSONObject:
        s = self._step.scheduler
        space = s.space
        tuner = self._step.tuner
        return self._counters.snapshot(
            running=len(s.running), waiting=self._queued,
            slots_used=len(s.running), slots_total=self.max_batch,
            kv_cache_bytes=self._step.cache_bytes, max_context=self.max_context,
            kv_block_size=space.block_size, kv_blocks_total=space.n_blocks,
            kv_blocks_used=space.n_used, kv_blocks_cached=space.n_cached,
            kv_blocks_touched=space.n_touched, kv_committed_bytes=self._step.kv_committed_bytes,
            kv_budget_bytes=self._step.budget.budget_bytes if self._step.budget else
            self._step.cache_bytes, preemptions=s.preemptions,
            device=str(self.model.device), dtype=str(self.model.dtype).replace("torch.", ""),
            weight_bytes=self._weights[0], weight_format=self._weights[1],
            weights=weights_of(self._weights[1])[0], exact=weights_of(self._weights[1])[1],
            threads=self.threads or (tuner.summary() if tuner else None))

    def counters(self) -> EngineStats:
        """The engine's live counters and latency windows (the Pool reads its model errors and
        merges its TTFT/ITL windows); `stats()` is their snapshot with the cache's state."""
        return self._counters

    @property
    def thread_alive(self) -> bool:
        """The engine thread runs (False once it died, until a restart starts another)."""
        return self._thread.is_alive()

    @property
    def stalled(self) -> bool:
        """A step has run past `step_timeout` and not returned yet (see `StallWatch`)."""
        return self._stalled

    def health(self) -> JSONObject:
        alive = self._thread.is_alive() and not (self._dead or self._stopping)
        restarting = not alive and self._restart_timer is not None and not self._stopping
        st = self.stats()
        return {"ready": alive and not self._stalled,
                "status": "stalled" if alive and self._stalled else "ready" if alive else
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
        if self._stall_watch is not None:
            self._stall_watch.stop()
        for group in list(self._groups.values()):
            self._step.fail(group, "the engine was stopped", "service_unavailable")
        self._groups.clear()
        if not thread.is_alive():  # a step past the join's timeout may still read the cache
            self._step.release()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Engine({self.model_name!r}, device={self.model.device}, max_batch="
                f"{self.max_batch}, max_context={self.max_context})")

    # ------------------------------------------------------------------ submission

    def add_adapter(self, name: str, path: str) -> None:
        """Serve the PEFT LoRA adapter at `path` as `name` (requests name it in
        `Request.adapter`; over HTTP, `model` "base:name"). ValueError naming the mismatch
        where it does not fit this model."""
        self._adapters.add(name, path)
        log.info("LoRA adapter %r added to %s (%s)", name, self.model_name, path)

    def adapter_names(self) -> list[str]:
        """The LoRA adapters this engine serves, in the order they were added."""
        return self._adapters.names()

    def prepare_prompt(self, request: Request) -> list[int]:
        """Token ids of the request's prompt (chat template applied for messages)."""
        ids = self._prompt_ids(request)
        if len(ids) >= self.max_context:
            budget = self._step.budget
            kv_tokens = budget.tokens if budget is not None and \
                budget.tokens < self.loaded.model.max_context else None
            raise ContextLengthError(len(ids), self.max_context,
                                     param="messages" if request.messages else "prompt",
                                     kv_tokens=kv_tokens)
        return ids

    def count_prompt_tokens(self, request: Request) -> int:
        """How many tokens the request's prompt takes (rendered and encoded as for serving),
        even past max_context: the UI uses it to fit a long chat into the context."""
        return len(self._prompt_ids(request))

    def prompt_token_ids(self, request: Request) -> list[int]:
        """The request's prompt as the engine would serve it (template applied, encoded), even
        past max_context: what /tokenize answers."""
        return self._prompt_ids(request)

    def _prompt_ids(self, request: Request) -> list[int]:
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
                                        add_generation_prompt=request.add_generation_prompt,
                                        **_template_kwargs(request.template_kwargs))
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        else:
            assert request.prompt is not None  # check_input: exactly one of the three
            ids = self.tokenizer.encode(request.prompt, add_special_tokens=True)
        if not ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        return ids

    def _closed_text(self, ids: list[int], request: Request) -> list[int]:
        """An embedded text's ids ending with what the tokenizer closes a text with (its
        `closing_ids`: Qwen3-Embedding's <|endoftext|>), where they are not there yet."""
        tail = list(self.tokenizer.closing_ids)
        if not tail or ids[-len(tail):] == tail:
            return ids
        closed = ids + tail
        if len(closed) >= self.max_context:
            raise ContextLengthError(len(closed), self.max_context, param="prompt")
        return closed

    def _check_head(self, request: Request) -> None:
        """A headless model (an embedding checkpoint without an LM head) serves pooled
        embeddings only: generation needs the head it lacks."""
        if request.embed is None and not self._step.model.has_lm_head:
            raise InvalidRequestError(
                f"{self.loaded.name} is an embedding model (its checkpoint has no LM head): "
                "it answers /v1/embeddings, not generation requests; serve a generative model "
                "for those", param="model")

    def submit(self, request: Request, sink: Sink) -> RequestGroup:
        """Validate and queue `request`; events go to `sink` (called from the engine thread).
        Raises InvalidRequestError, ContextLengthError, BusyError or EngineStoppedError."""
        self._check_running()
        self._check_head(request)
        params = request.params
        params.validate(self.vocab_size)
        if request.embed is not None:
            check_embed(request, request.embed, self._step.model, self.vocab_size,
                        self.loaded.pooling)
        if params.n > self.max_batch:
            raise InvalidRequestError(
                f"n must be at most max_batch={self.max_batch}, got {params.n}", param="n")
        ids = self.prepare_prompt(request)
        if request.embed is not None and request.embed.score_token_ids is None and \
                request.prompt is not None:
            ids = self._closed_text(ids, request)
        budget = self._step.budget
        if budget is not None:  # every choice needs its own last block beside the prompt's
            need = self._step.space.admission_cost([], 0, len(ids) + 1, params.n)  # no cache
            if need > budget.n_blocks:
                raise InvalidRequestError(
                    f"{params.n} choices of this {len(ids)}-token prompt need {need} KV blocks "
                    f"of {budget.block_size} tokens at once, but the cache has {budget.n_blocks}"
                    ": lower n, shorten the prompt, or serve with a larger kv_memory", param="n")
        adapter, root = self._adapters.find(request.adapter)
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(self.stop_token_ids)
        group = RequestGroup(request.request_id, params, ids, frozenset(stop_ids), sink,
                             remaining=params.n, submitted=time.perf_counter(),
                             embed=request.embed, adapter=adapter)
        if request.embed is not None and request.embed.score_token_ids is None:
            group.pooler = Pooler(self.loaded.pooling, len(ids))
        thought: ThoughtRule = "none"
        if request.messages is not None and self.template is not None and \
                thinks(self.template.source):
            group.reasoning = True
            tail = self.tokenizer.decode(ids[-16:])
            group.thought_open = starts_inside(tail)
            thought = thought_rule(tail, request.template_kwargs.get("enable_thinking")
                                   is not False)
        matcher = self._matcher(request, group, thought)
        device = self.model.device
        # a constrained answer ends only where its grammar accepts it: a stop string (or token,
        # step.py) elsewhere is not matched; ignore_eos holds the end tokens while it may go on
        grammars = group.grammars  # set by _matcher with the matcher
        ends_answer = None if matcher is None or grammars is None else partial(grammars.accepts,
                                                                                 matcher)
        for i in range(params.n):
            whole = params.prompt_logprobs is not None or \
                (group.pooler is not None and group.pooler.whole_prompt)
            group.seqs.append(Sequence(group, i, ids, whole_prompt=whole, root=root))
            sampler = SeqSampler.create(params, ids, device, seed_offset=i, stop_ids=stop_ids)
            sampler.matcher = None if matcher is None else matcher.deep_copy()
            if matcher is not None and params.ignore_eos:
                sampler.eos_ids = tuple(self.stop_token_ids)
            group.choices.append(ChoiceState(sampler, IncrementalDetokenizer(self.tokenizer),
                                             StopStringMatcher(params.stop, ends_answer)))
        with self._lock:
            self._check_running()
            if request.request_id in self._groups:
                raise InvalidRequestError(f"request id {request.request_id!r} is in use",
                                          param="request_id")
            if self._queued >= self.max_queue:
                self._counters.rejected += 1
                raise BusyError(f"the server is busy: {self._queued} requests are waiting "
                                f"(max_queue={self.max_queue}); retry soon")
            self._queued += 1
            self._groups[request.request_id] = group
            self._inbox.append((group, list(group.seqs)))
            self._lock.notify()
        return group

    @property
    def tool_format(self) -> ToolFormat:
        """How this model writes tool calls (its template's format; Hermes without one)."""
        return self.template.tool_format if self.template is not None else HERMES

    def grammars(self) -> Grammars:
        """The tokenizer's grammar data (built on first use, then shared)."""
        return grammars_for(self.tokenizer, self.vocab_size, self.stop_token_ids)

    def _matcher(self, request: Request, group: RequestGroup, thought: ThoughtRule
                 ) -> LLMatcher | None:
        """The compiled grammar of a request with tools or a constraint (None without),
        which each choice copies, applied after the thought that `thought` allows; the tool
        format goes on the group for the Started event."""
        if request.tools:
            group.tool_format = self.tool_format.name
        if not request.tools and request.params.constraint is None:
            return None
        grammars = self.grammars()
        grammar = grammars.for_request(request, self.tool_format, thought)
        if grammar is None:
            return None
        group.grammars = grammars
        c = request.params.constraint
        return grammars.matcher(grammar, "tools" if request.tools else
                                c.param if c is not None else "response_format")

    def _check_running(self) -> None:
        if self._stopping:
            raise EngineStoppedError("the engine is not running (stopped or shutting down)")
        if self._stalled:
            raise EngineStoppedError(
                f"the model is stuck: one step has run for more than step_timeout="
                f"{self.step_timeout:g} s; requests are refused until it returns")
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
            self._step.renew()  # a fresh cache (the old one freed first) and scheduler
        except Exception:
            log.exception("the engine could not restart: it stays stopped")
            with self._lock:
                self._restart_timer = None
            return
        with self._lock:
            self._restart_timer = None
            if self._stopping:
                return
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
                self._step.end_failed(group, message, kind)

    def _loop(self) -> None:
        if self.threads:
            torch.set_num_threads(self.threads)  # per-thread setting: only the engine's ops
        while True:
            with self._lock:
                while not (self._stopping or self._inbox or self._aborts or self._step.busy):
                    self._lock.wait()
                if self._stopping:
                    return
            watch = self._stall_watch
            if watch is not None:
                watch.step_started()
            try:
                self.step()
            except Exception:  # a bug in bookkeeping: fail everything running, keep serving
                log.exception("engine step failed")
                self._step.fail_running("internal engine error", "server_error")
            finally:
                if watch is not None and watch.step_ended():
                    self._recover_from_stall()

    def step(self) -> bool:
        """(engine thread) Hand the step what arrived since the last one (new requests,
        aborts), then run it. Returns False when there was nothing to do."""
        with self._lock:
            inbox, aborts = list(self._inbox), list(self._aborts)
            self._inbox.clear()
            self._aborts.clear()
        for _group, seqs in inbox:
            self._step.add(seqs)
        for group, why in aborts:
            self._step.abort(group, why)
        return self._step.step()

    def _on_stall(self, seconds: float) -> None:
        """(watch thread) A step has run past step_timeout: fail what is in flight, refuse new
        work. The step itself cannot be stopped; `_recover_from_stall` runs if it returns."""
        log.error("one engine step has run for %.0f s (step_timeout=%g s): the model looks "
                  "stuck; failing the requests in flight", seconds, self.step_timeout)
        with self._lock:
            self._stalled = True
        self._fail_all(f"the model has been stuck in one step for {seconds:.0f} s (longer than "
                       f"step_timeout={self.step_timeout:g} s); the request was abandoned",
                       "service_unavailable")

    def _recover_from_stall(self) -> None:
        """(engine thread) The stuck step returned: forget its sequences, serve again."""
        with self._lock:
            self._step.forget_requests()
            self._stalled = False
        log.warning("the stuck engine step returned; the engine serves again")


_RESERVED_TEMPLATE_NAMES = frozenset({"messages", "tools", "add_generation_prompt", "documents"})


def _template_kwargs(kwargs: JSONObject) -> JSONObject:
    """The request's extra chat-template variables, checked: names the template's own
    arguments do not use."""
    for name in kwargs:
        if not isinstance(name, str) or not name.isidentifier() or \
                name in _RESERVED_TEMPLATE_NAMES:
            raise InvalidRequestError(
                f"chat_template_kwargs: {name!r} cannot be a template variable (names are "
                f"identifiers other than {', '.join(sorted(_RESERVED_TEMPLATE_NAMES))})",
                param="chat_template_kwargs")
    return kwargs
