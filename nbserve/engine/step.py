"""EngineStep: what runs on the engine thread. One step admits waiting requests, runs the
decode batch and the prefill chunks through the model, samples, and emits events.

It owns what only the engine thread touches (scheduler, KV cache, the model's forward, thread
tuning) and knows the front (`Engine`) only through `StepHooks`: two callbacks that keep the
front's registry of requests in flight up to date.
"""

from __future__ import annotations

import contextlib
import logging
import time
import traceback
from collections.abc import Iterator
from typing import Any, Protocol

import torch

from ..cpu.threads import ThreadTuner
from ..execution.kv_cache import PagedKVCache
from ..models.adapters.step_model import served
from ..models.base import LoadedModel, PagedModel, SlotCache, SlotModel, StaticSteps
from ..types import (
    Delta,
    Embedded,
    ErrorEvent,
    Finished,
    FinishReason,
    PromptLogprobs,
    Started,
    TokenLogprob,
)
from .blocks import BlockSpace, KVSpace, SlotSpace
from .config import EngineConfig
from .constraints import MaskJob
from .embedding import scores as embedding_scores
from .kv_budget import KVBudget, plan_blocks, retained_blocks
from .requests import RequestGroup, drop_event, gathered_wakeups
from .sampling import sample
from .scheduler import PrefillWork, Scheduler, Sequence, StepPlan
from .stats import EngineStats

log = logging.getLogger("nbserve.engine")


class StepHooks(Protocol):
    """What the step tells the thread-safe front (called on the engine thread)."""

    def admitted(self, group: RequestGroup) -> None:
        """`group` left the waiting queue (admitted, or ended while it waited)."""

    def done(self, group: RequestGroup) -> None:
        """`group` has ended: every choice finished, or it failed."""


class EngineStep:
    """The engine thread's work: add, abort, step, fail. Not thread-safe by design: only the
    engine thread calls it (the front hands it the requests and aborts it collected)."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig, stats: EngineStats,
                 hooks: StepHooks):
        # the path is the model's declared type: a paged cache for a PagedModel, else one row
        # per sequence (a user's StepModel is wrapped once to declare which)
        self.model: SlotModel = served(loaded.model)
        self.tokenizer = loaded.tokenizer
        self.config, self.stats, self.hooks = config, stats, hooks
        on_cpu = self.model.device.type == "cpu"
        self.tuner = ThreadTuner() if on_cpu and config.threads is None else None
        # right-padded prefill rows only for models that say they handle them (StepModel doc)
        self.padded_rows = self.model.accepts_padded_rows
        self.paged = isinstance(self.model, PagedModel)
        self.max_batch = config.resolved_max_batch(self.paged)
        model_context = config.context_for(int(self.model.max_context), self.paged)
        self.budget: KVBudget | None = None
        if isinstance(self.model, PagedModel):
            kv_dtype = config.resolved_kv_dtype(self.model.default_kv_dtype)
            self.budget = plan_blocks(self.model.kv_bytes_per_token(kv_dtype),
                                      config.kv_block_size, self.model.device,
                                      config.kv_memory, self.max_batch * model_context)
            self.kv_dtype = kv_dtype
        # the largest context one request can get: the model's, or what the blocks hold
        self.max_context = model_context if self.budget is None else \
            min(model_context, self.budget.tokens)
        self.cache: Any = self._make_cache()
        self.scheduler = self._make_scheduler()
        self.static = self._make_static_decode()

    def _make_cache(self) -> SlotCache:
        if self.budget is None:
            return self.model.make_cache(self.max_batch, self.max_context)
        assert isinstance(self.model, PagedModel)  # a budget is planned for paged models only
        return self.model.make_paged_cache(self.budget.n_blocks, self.budget.block_size,
                                           self.kv_dtype)

    def _make_static_decode(self) -> StaticSteps | None:
        """The model's static decode steps (CUDA graphs on CUDA) where `static_decode` asks
        (None: on for CUDA), for models that offer them over a paged cache; else None."""
        on_cuda = self.model.device.type == "cuda"
        want = on_cuda if self.config.static_decode is None else self.config.static_decode
        static = None
        if want and isinstance(self.model, PagedModel) and self.budget is not None:
            static = self.model.make_static_decode(self.cache, self.max_batch,
                                                   self.max_context, capture=on_cuda)
        if static is None and self.config.static_decode:
            log.warning("static_decode: this model has no static decode steps (nbserve's "
                        "own model families over a paged cache do); decoding as usual")
        return static

    def _make_scheduler(self) -> Scheduler:
        space: KVSpace = SlotSpace(self.max_batch, self.max_context) if self.budget is None \
            else BlockSpace(self.budget.n_blocks, self.budget.block_size,
                            retain=retained_blocks(self.budget, self.max_context))
        return Scheduler(self.max_batch, self.config.prefill_chunk, space)

    @property
    def space(self) -> KVSpace:
        return self.scheduler.space

    # ------------------------------------------------------------------ the interface

    @property
    def busy(self) -> bool:
        """Whether any sequence is running or waiting for a slot."""
        return bool(self.scheduler.running or self.scheduler.waiting)

    def add(self, seqs: list[Sequence]) -> None:
        """Queue the sequences of one new request."""
        self.scheduler.add(seqs)

    def abort(self, group: RequestGroup, why: str) -> None:
        """End `group` early: "cancel" (the caller left), "shutdown" (the server stops) or
        "backlog" (the caller left too many events unread for too long)."""
        if why == "backlog":
            cfg = self.config
            self.fail(group, f"the client left more than max_backlog={cfg.max_backlog} events "
                      "per choice of this stream unread for more than "
                      f"slow_client_timeout={cfg.slow_client_timeout:g} s, so the request was "
                      "cancelled to free its slot; read the stream as it arrives",
                      "client_too_slow")
        elif why == "shutdown" and not group.admitted:
            self.fail(group, "the server is shutting down and this request had not started; "
                      "retry it later or on another server", "service_unavailable")
        else:
            self._end_group(group, "cancelled")

    def step(self) -> bool:
        """Run one engine step. Returns False when there was nothing to do."""
        t0 = time.perf_counter()
        self._expire_waiting()
        plan = self.scheduler.schedule()
        for copy in self.scheduler.take_copies():  # cached positions found in part of a block
            self.cache.copy_prefix(*copy)
        if plan.empty:
            self._give_back_pages()
            return False
        for seq in plan.admitted:
            g = seq.group
            self._mark_admitted(g)
            self.stats.prefix_queries += len(seq.prompt_ids)
            self.stats.prefix_hits += seq.cached_prompt
            g.sink(Started(g.request_id, len(g.prompt_ids), seq.cached_prompt, g.prompt_ids,
                           g.tool_format, g.reasoning, g.thought_open))
        model_time = sample_time = 0.0
        if plan.decode:
            m, s = self._run_decode(plan)
            model_time, sample_time = model_time + m, sample_time + s
        if plan.prefills:
            m, s = self._run_prefills(plan.prefills)
            model_time, sample_time = model_time + m, sample_time + s
        self.stats.record_step(time.perf_counter() - t0, model_time, sample_time,
                               len(plan.decode))
        if not self.busy:
            self._give_back_pages()
        return True

    def _give_back_pages(self) -> None:
        """(idle) Return the memory pages of the blocks that hold nothing (a cancelled or
        failed sequence's, a preempted one's partial block) to the system: a cache committed
        lazily (on CPU) then holds resident what its running and cached blocks need."""
        cache = self.cache
        if isinstance(cache, PagedKVCache) and cache.lazy:
            runs = self.space.give_back(cache.page_reach)
            if runs:
                cache.free_pages(runs)

    @property
    def cache_bytes(self) -> int:
        """Bytes the KV cache holds (0 once released)."""
        return 0 if self.cache is None else self.model.cache_nbytes(self.cache)

    @property
    def kv_committed_bytes(self) -> int:
        """Bytes of the KV cache that hold memory: on CPU (committed as blocks are first
        written, given back when they hold nothing), the blocks touched; else all of it."""
        cache = self.cache
        nbytes = self.cache_bytes
        if isinstance(cache, PagedKVCache) and cache.lazy:
            return nbytes * self.space.n_touched // max(self.space.n_blocks, 1)
        return nbytes

    def fail_running(self, message: str, kind: str) -> None:
        """Fail every running request (after a bug in the step's own bookkeeping)."""
        for seq in list(self.scheduler.running):
            self.fail(seq.group, message, kind)

    def fail(self, group: RequestGroup, message: str, kind: str) -> None:
        """End `group` with an ErrorEvent; its slots are freed without keeping their tokens."""
        if group.done:
            return
        self._mark_admitted(group)
        for seq in group.seqs:
            self.scheduler.finish(seq, keep_cache=False)
        group.done = True
        self.hooks.done(group)
        self.end_failed(group, message, kind)

    def end_failed(self, group: RequestGroup, message: str, kind: str) -> None:
        """The end every failed request gets: counted, told with an ErrorEvent, later events
        dropped. Touches no scheduler state (`Engine._fail_all` ends requests this way when
        the scheduler may be broken)."""
        group.done, group.remaining = True, 0
        self.stats.finished["error"] = self.stats.finished.get("error", 0) + 1
        group.sink(ErrorEvent(message, kind, group.request_id))
        group.sink = drop_event

    def release(self) -> None:
        """Drop the KV cache and the static decode steps (their buffers and CUDA graphs), for a
        closed engine: its memory comes back even while something still refers to the engine
        (a notebook's output history, a variable kept across `update()`)."""
        self.cache = self.static = None

    def forget_requests(self) -> None:
        """A fresh scheduler and block pool (after a stuck step returned: its sequences were
        failed; what the cache holds is forgotten with them)."""
        self.scheduler = self._make_scheduler()
        cache = self.cache
        if isinstance(cache, PagedKVCache):  # the new pool counts no block touched
            cache.free_pages([(0, cache.n_blocks)])

    def renew(self) -> None:
        """After a crash of the engine thread: a fresh KV cache (the old one is freed first)
        and scheduler. The stats and the thread tuner's timings stay."""
        self.cache = self.static = None
        self.cache = self._make_cache()
        self.static = self._make_static_decode()  # its buffers and graphs read the new cache
        self.forget_requests()

    # ------------------------------------------------------------------ one step

    def _expire_waiting(self) -> None:
        """Fail the requests that waited longer than `queue_timeout` for a slot (FIFO order)."""
        timeout = self.config.queue_timeout
        if timeout is None:
            return
        now = time.perf_counter()
        # a preempted sequence waits too, but its request was admitted long ago: not counted
        for waiting in [g for g in self.scheduler.waiting if not g[0].resumed]:
            group: RequestGroup = waiting[0].group
            waited = now - group.submitted
            if waited < timeout:
                return
            self.fail(group, f"the request waited {waited:.1f} s for a free slot, longer than "
                      f"queue_timeout={timeout:g} s: the server is overloaded; retry later (or "
                      "raise queue_timeout / max_batch)", "queue_timeout")

    def _run_decode(self, plan: StepPlan) -> tuple[float, float]:
        seqs = plan.decode
        dev = self.model.device
        pos_l = [s.computed for s in seqs]
        ids = torch.tensor([[s.output_ids[-1]] for s in seqs], device=dev)
        positions = torch.tensor(pos_l, device=dev).unsqueeze(1)
        max_pos = max(pos_l)
        where, contiguous = self._where(seqs)
        adapters = [s.group.adapter for s in seqs]
        # static decode steps know no adapters: skipped for steps with adapter rows
        static = self.static if self.static is not None and max(adapters) < 0 and \
            self.static.serves(len(seqs), max_pos, where.shape[-1]) else None
        masks = self._mask_job(seqs)  # computed while the model runs
        t0 = time.perf_counter()
        try:
            with self._threads_for(len(seqs)), self.model.lora_rows(adapters):
                if static is not None:
                    logits = static(ids, positions, where, max_pos)
                else:
                    logits = self.model.forward(ids, positions, where, self.cache,
                                                logit_index=torch.zeros(
                                                    len(seqs), dtype=torch.long, device=dev),
                                                max_pos=max_pos, contiguous_from=contiguous)
        except Exception as exc:
            self._fail_step(seqs, exc)
            return time.perf_counter() - t0, 0.0
        t1 = time.perf_counter()
        for s in seqs:
            s.computed += 1
            self.scheduler.computed(s)
        self.stats.decoded += len(seqs)
        self._sample_and_emit(seqs, logits, masks)
        return t1 - t0, time.perf_counter() - t1

    def _run_prefills(self, works: list[PrefillWork]) -> tuple[float, float]:
        """Prefill this step's chunks: the chunks of scored prompts one forward each (every
        position's logits), those of pooled embeddings in a forward that gives hidden states,
        the others in one that gives the last position's logits."""
        scores = [_scores_prompt(w) for w in works]  # decided before any runs (it samples)
        pools = [w.seq.group.pooler is not None for w in works]
        if not any(scores) and not any(pools):
            return self._run_batch(works, hidden=False)
        times = [self._run_scoring_prefill(w) for w, sc in zip(works, scores) if sc]
        pooled = [w for w, p in zip(works, pools) if p]
        rest = [w for w, sc, p in zip(works, scores, pools) if not sc and not p]
        if pooled:
            times.append(self._run_batch(pooled, hidden=True))
        if rest:
            times.append(self._run_batch(rest, hidden=False))
        return sum(t[0] for t in times), sum(t[1] for t in times)

    def _run_batch(self, works: list[PrefillWork], hidden: bool) -> tuple[float, float]:
        """Chunks in one padded forward when padding wastes little (a burst of similar prompts
        reads the weights once), else one forward each: the last position's logits of each,
        or with `hidden` every position's final-norm states, pooled (embedding requests)."""
        real = sum(len(w.ids) for w in works)
        width = max(len(w.ids) for w in works)
        padded = any(len(w.ids) != width for w in works)
        wasteful = width * len(works) > 1.25 * real
        if len(works) > 1 and ((padded and not self.padded_rows) or wasteful):
            times = [self._run_batch([w], hidden) for w in works]
            return sum(t[0] for t in times), sum(t[1] for t in times)
        dev = self.model.device
        limit = self.max_context - 1  # pad positions stay inside the cache, past real tokens
        pos_rows = [[min(w.start + j, limit) for j in range(width)] for w in works]
        ids = torch.tensor([w.ids + [0] * (width - len(w.ids)) for w in works], device=dev)
        positions = torch.tensor(pos_rows, device=dev)  # (B, T)
        last = torch.tensor([len(w.ids) - 1 for w in works], device=dev)
        max_pos = max(r[-1] for r in pos_rows)
        where, contiguous = self._where([w.seq for w in works])
        t0 = time.perf_counter()
        try:
            with self._threads_for(real), \
                    self.model.lora_rows([w.seq.group.adapter for w in works]):
                if hidden:
                    out = self.model.forward_hidden(ids, positions, where, self.cache,
                                                    max_pos=max_pos, contiguous_from=contiguous)
                else:
                    out = self.model.forward(ids, positions, where, self.cache,
                                             logit_index=last, max_pos=max_pos,
                                             contiguous_from=contiguous)
        except Exception as exc:
            self._fail_step([w.seq for w in works], exc)
            return time.perf_counter() - t0, 0.0
        t1 = time.perf_counter()
        for i, work in enumerate(works):
            if hidden:
                pooler = work.seq.group.pooler
                assert pooler is not None  # only pooled requests' chunks ask for states
                pooler.add(work.start, out[i, :len(work.ids)])
                self._after_prefill(work, None)
            else:
                self._after_prefill(work, out[i:i + 1])
        return t1 - t0, time.perf_counter() - t1

    def _run_scoring_prefill(self, work: PrefillWork) -> tuple[float, float]:
        """A prefill chunk of a request that asked for its prompt's log-probabilities: the
        logits of every position, from which each next prompt token's log-probability (and
        the top alternatives) is kept on the group; the last position's go on as usual."""
        dev = self.model.device
        seq, group = work.seq, work.seq.group
        ids = torch.tensor([work.ids], device=dev)
        positions = torch.arange(work.start, work.start + len(work.ids), device=dev)[None]
        max_pos = work.start + len(work.ids) - 1
        where, contiguous = self._where([seq])
        t0 = time.perf_counter()
        try:
            with self._threads_for(len(work.ids)), self.model.lora_rows([group.adapter]):
                logits = self.model.forward(ids, positions, where, self.cache, max_pos=max_pos,
                                            contiguous_from=contiguous)[0]
        except Exception as exc:
            self._fail_step([seq], exc)
            return time.perf_counter() - t0, 0.0
        t1 = time.perf_counter()
        if work.start == 0:
            group.prompt_logprobs = [None]  # the first token: nothing predicts it
        scored = group.prompt_logprobs
        assert scored is not None  # set at the first chunk, kept until the prompt is scored
        prompt = seq.prompt_ids
        upto = min(len(work.ids), len(prompt) - 1 - work.start)  # rows that predict the prompt
        if upto > 0:
            lp = torch.log_softmax(logits[:upto].float(), dim=-1)  # (upto, V)
            targets = torch.tensor(prompt[work.start + 1:work.start + 1 + upto], device=dev)
            chosen = lp.gather(1, targets[:, None]).squeeze(1).tolist()
            k = group.params.prompt_logprobs or 0
            top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
            for tok, value, vals, idx in zip(targets.tolist(), chosen, top_v.tolist(),
                                             top_i.tolist()):
                scored.append(self._token_logprob(tok, value, idx, vals))
        self._after_prefill(work, logits[-1:])
        return t1 - t0, time.perf_counter() - t1

    def _token_logprob(self, tok: int, value: float, top_ids: list[int],
                       top_values: list[float]) -> TokenLogprob:
        return TokenLogprob(tok, self.tokenizer.decode([tok]), value,
                            list(self.tokenizer.token_bytes(tok)),
                            [(i, self.tokenizer.decode([i]), v) for i, v in
                             zip(top_ids, top_values)])

    def _where(self, seqs: list[Sequence]) -> tuple[torch.Tensor, int | None]:
        """Where the rows' keys and values live, as the model takes it: block tables (B, S),
        padded with the cache's pad block, for a paged cache; else cache rows (B,) and the
        first of them when they are a contiguous run (the `contiguous_from` hint)."""
        dev = self.model.device
        if self.paged:
            width = max(len(s.table) for s in seqs)
            pad = self.cache.pad_block
            rows = [s.table + [pad] * (width - len(s.table)) for s in seqs]
            return torch.tensor(rows, device=dev), None
        slots_l = [s.slot for s in seqs]
        contiguous = slots_l[0] if slots_l == list(range(slots_l[0], slots_l[0] + len(seqs))) \
            else None
        return torch.tensor(slots_l, device=dev), contiguous

    @contextlib.contextmanager
    def _threads_for(self, tokens: int) -> Iterator[None]:
        """Run a forward over `tokens` tokens with the thread count the tuner picks, and tell
        it how long that took (see `cpu.threads`). No-op off CPU or with fixed `threads`."""
        if self.tuner is None:
            yield
            return
        n = self.tuner.choose(tokens)
        torch.set_num_threads(n)
        t0 = time.perf_counter()
        yield
        self.tuner.record(tokens, n, time.perf_counter() - t0)

    def _after_prefill(self, work: PrefillWork, logits: torch.Tensor | None) -> None:
        """Advance the sequence; after its last chunk, fork n > 1 and sample first tokens, or
        answer an embedding request. `logits`: the chunk's last position's (1, V); None for a
        pooled embedding's chunk (its states went to its pooler)."""
        seq = work.seq
        seq.computed += len(work.ids)
        self.scheduler.computed(seq)
        self.stats.prefilled += len(work.ids)
        if not work.last:
            return
        if not seq.resumed:
            self.stats.reused += seq.cached_prompt
        if seq.group.embed is not None:
            self._answer_embedding(seq, logits)
            return
        assert logits is not None  # only pooled embeddings' chunks come without
        forked = []
        for sib, copy in self.scheduler.fork(seq):  # n > 1: share the prefill
            if copy is not None:
                self.cache.copy_prefix(*copy)
            forked.append(sib)
        live = [seq] + forked
        group = seq.group
        if group.prompt_logprobs is not None:  # once, when the scored prompt is complete
            group.sink(PromptLogprobs(group.prompt_logprobs))
            group.prompt_logprobs = None
        if work.samples and group.params.max_tokens == 0:  # the prompt scored: nothing more
            for s in live:
                self._finish_seq(s, group, "length")
        elif work.samples:
            self._sample_and_emit(live, logits.expand(len(live), -1))

    def _answer_embedding(self, seq: Sequence, logits: torch.Tensor | None) -> None:
        """After an embedding request's prefill: its pooled vector (or its tokens' scores from
        the last position's logits) in one Embedded event, then Finished; its blocks go back
        to the cache (no KV is held for a decode)."""
        group: RequestGroup = seq.group
        spec = group.embed
        assert spec is not None  # only embedding requests are answered here
        if group.pooler is not None:
            values = group.pooler.vector(spec.dimensions)
        else:
            assert logits is not None and spec.score_token_ids is not None
            values = embedding_scores(logits[0], spec.score_token_ids)
        group.sink(Embedded(seq.index, values))
        self._finish_seq(seq, group, "stop")

    def _mask_job(self, seqs: list[Sequence]) -> MaskJob | None:
        """The grammar masks of the constrained rows among `seqs`, if any."""
        rows = [(i, s) for i, s in enumerate(seqs)
                if s.group.choices[s.index].sampler.matcher is not None]
        if not rows:
            return None
        matchers = [s.group.choices[s.index].sampler.matcher for _, s in rows]
        return MaskJob(rows[0][1].group.grammars, [i for i, _ in rows], matchers)

    def _sample_and_emit(self, seqs: list[Sequence], logits: torch.Tensor,
                         masks: MaskJob | None = None) -> None:
        groups = [s.group for s in seqs]
        if masks is None:
            masks = self._mask_job(seqs)
        out = sample(logits, [g.choices[s.index].sampler for g, s in zip(groups, seqs)],
                     None if masks is None else (masks.rows, masks.result()))
        now = time.perf_counter()
        with gathered_wakeups():
            for seq, group, tok, lp in zip(seqs, groups, out.token_ids, out.logprobs):
                self._emit_token(seq, group, tok, lp, now)

    def _emit_token(self, seq: Sequence, group: RequestGroup, tok: int, lp: TokenLogprob | None,
                    now: float) -> None:
        choice = group.choices[seq.index]
        params = group.params
        seq.output_ids.append(tok)
        matcher = choice.sampler.matcher
        # a stop token ends a constrained answer only where the answer is complete; elsewhere
        # (a stop_token_ids entry the grammar allows as text) it is text
        ends = (tok in group.stop_ids or tok in choice.sampler.eos_ids) and \
            (matcher is None or matcher.is_accepting())
        choice.sampler.observe(tok)
        if matcher is not None and matcher.is_error():  # only a bug lets a masked row stray
            self.fail(group, f"the output left its grammar: {matcher.get_error()}",
                      "server_error")
            return
        group.completion_tokens += 1
        if not group.first_token:
            group.first_token = now
            self.stats.ttft.append(now - group.submitted)
        if choice.last_token_time:
            self.stats.itl.append(now - choice.last_token_time)
        else:
            choice.first_token_time = now
        choice.last_token_time = now
        reason: FinishReason | None = None
        matched: int | str | None = None  # the stop token or string
        stop_string: str | None = None
        text = ""
        if ends:  # a stop token: not part of the text
            reason, matched = "stop", tok
        else:
            text, stop_string = choice.stopper.feed(choice.detok.add([tok]))
            if stop_string is not None:
                reason, matched = "stop", stop_string
        if reason is None and matcher is not None and matcher.is_stopped():
            reason = "stop"  # the grammar is complete: nothing may follow
        if reason is None and params.max_tokens is not None and \
                len(seq.output_ids) >= params.max_tokens:
            reason = "length"
        if reason is None and seq.total_len >= self.max_context:
            reason = "length"
        if reason is not None and stop_string is None:  # a stop token or a length
            tail, late = self._held_back(group, seq)
            text += tail
            if late is not None:
                reason, matched = "stop", late
        if lp is not None:
            lp.token = self.tokenizer.decode([tok])
            lp.bytes = list(self.tokenizer.token_bytes(tok))
            lp.top = [(i, self.tokenizer.decode([i]), v) for i, _, v in lp.top]
        # Every generated token reaches the caller, even with no text (held back, or the
        # dropped bytes of a cut character); only a token that ended the answer by being a
        # stop token or completing a stop string goes unreported when it carries nothing.
        if text or lp is not None or reason != "stop":
            group.sink(Delta(seq.index, text, [tok], [lp] if lp is not None else None))
        if reason is not None:
            self._finish_seq(seq, group, reason, matched)

    def _held_back(self, group: RequestGroup, seq: Sequence) -> tuple[str, str | None]:
        """The end of an answer that no stop string ended: what the detokenizer (a character
        still open) and the stop matcher (a possible stop string's start) held back, and the
        stop string that text completes, if it does (then the text stops before it)."""
        choice = group.choices[seq.index]
        tail, late = choice.stopper.feed(choice.detok.finish())
        return (tail, late) if late is not None else (tail + choice.stopper.flush(), None)

    def _finish_seq(self, seq: Sequence, group: RequestGroup, reason: FinishReason,
                    matched: int | str | None = None, keep_cache: bool = True) -> None:
        if seq.finished:
            return
        self.scheduler.finish(seq, keep_cache=keep_cache)
        group.remaining -= 1
        if group.remaining == 0:
            group.done = True
            self.hooks.done(group)
            self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1
        choice = group.choices[seq.index]
        n_out = len(seq.output_ids)
        ttft = choice.first_token_time - group.submitted if choice.first_token_time else None
        itl = (choice.last_token_time - choice.first_token_time) / (n_out - 1) \
            if n_out > 1 and choice.first_token_time else None
        group.sink(Finished(seq.index, reason, group.usage(), matched, ttft_s=ttft, itl_s=itl))
        if group.done:
            group.sink = drop_event  # the caller's closure may reference us: no cycle once done

    def _mark_admitted(self, group: RequestGroup) -> None:
        """The request left the queue (admitted, or ended while waiting)."""
        if not group.admitted:
            group.admitted = True
            self.hooks.admitted(group)

    def _end_group(self, group: RequestGroup, reason: FinishReason) -> None:
        """End every sequence of `group` (cancelled), each with the text it held back."""
        self._mark_admitted(group)
        for seq in group.seqs:
            if not seq.finished:
                tail, _ = self._held_back(group, seq)
                if tail:
                    group.sink(Delta(seq.index, tail, [], None))
            self._finish_seq(seq, group, reason)

    def _fail_step(self, seqs: list[Sequence], exc: Exception) -> None:
        log.error("model forward failed for %d sequences: %s\n%s", len(seqs), exc,
                  traceback.format_exc())
        self.stats.errors += 1
        for seq in seqs:
            self.fail(seq.group, f"the model failed on this request: {exc}", "server_error")


def _scores_prompt(work: PrefillWork) -> bool:
    """Whether a prefill chunk needs every position's logits (its prompt is scored)."""
    return work.seq.group.params.prompt_logprobs is not None and not work.seq.output_ids
