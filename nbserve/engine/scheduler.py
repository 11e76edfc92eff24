"""Scheduler: which sequences run this step, from which position, in which cache blocks.

Pure Python, no torch. Requests wait in FIFO order; one is admitted when a seat (`max_batch`
running sequences) and the cache blocks for its prompt are free, taking whatever prefix of
its prompt the cache already holds (`KVSpace.admit`: shared blocks of other sequences, or
blocks cached by finished ones), so that it prefills only what is new. A request too big for
the free blocks now may be passed by smaller ones behind it, but only `max_skips` times; then
nothing passes it until it fits (no head-of-line blocking, no starvation). A request whose
prompt starts with blocks that a running sequence is prefilling waits for them instead of
computing them a second time.

Each step decodes every sequence that has finished its prefill, plus prefill chunks of the
oldest prefilling ones, up to `prefill_chunk` tokens in all. When a running sequence needs a
block and none is free, the youngest running sequence is preempted: its blocks go back (its
full blocks stay cached), and it waits at the head of the queue to be recomputed from its
tokens, mostly from the cache.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from .blocks import ROOT_KEY, KVSpace, common_prefix_len

__all__ = ["PrefillWork", "Scheduler", "Sequence", "StepPlan", "common_prefix_len"]


@dataclass(slots=True, eq=False)
class Sequence:
    """One choice of one request, as the scheduler sees it."""

    group: Any  # the engine's RequestGroup (requests.py imports this module), one a request
    index: int  # choice number within the request
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose keys/values are in the cache
    cached_prompt: int = 0  # prompt tokens found in the cache at (first) admission
    finished: bool = False
    parent: Sequence | None = None  # for n > 1: the choice whose prefill this one copies
    table: list[int] = field(default_factory=list)  # cache blocks, in position order
    keyed: int = 0  # leading blocks of `table` whose keys are known (see BlockSpace.commit)
    last_key: bytes = ROOT_KEY  # the key of block keyed - 1
    root: bytes = ROOT_KEY  # where its key chain starts: its LoRA adapter's key, if it has one
    # (src block, dst block, positions): cached positions admission found in part of a block,
    # to be copied into this sequence's own block before the next forward
    copy: tuple[int, int, int] | None = None
    resumed: bool = False  # preempted once: its request was already admitted
    skipped: int = 0  # times a request behind it was admitted first
    # every position of its prompt is computed, none taken from the cache: its prompt's
    # log-probabilities were asked for, or an embedding pooled over every position
    whole_prompt: bool = False

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids if self.output_ids else self.prompt_ids

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def target(self) -> int:
        """Positions to have in the cache before the next decode: the prompt, or (after a
        preemption) every token but the last, which the next decode step feeds."""
        return self.total_len - 1 if self.output_ids else len(self.prompt_ids)

    @property
    def prefilling(self) -> bool:
        return self.computed < self.target

    @property
    def slot(self) -> int:
        """The first cache block (the cache row, for one-row-per-sequence caches)."""
        return self.table[0] if self.table else -1


@dataclass(slots=True)
class PrefillWork:
    seq: Sequence
    start: int  # first position of the chunk
    ids: list[int]

    @property
    def last(self) -> bool:
        """The chunk completes the sequence's prefill."""
        return self.start + len(self.ids) == self.seq.target

    @property
    def samples(self) -> bool:
        """The chunk's last logits give the sequence's first token (not after a preemption:
        a recomputed sequence has its tokens)."""
        return self.last and not self.seq.output_ids


@dataclass(slots=True)
class StepPlan:
    prefills: list[PrefillWork]  # within a budget of `prefill_chunk` tokens per step
    decode: list[Sequence]
    admitted: list[Sequence] = field(default_factory=list)  # first choice of each new request

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decode and not self.admitted


class Scheduler:
    """Waiting queue, running set and the cache's blocks. The engine calls add/schedule/finish."""

    def __init__(self, max_batch: int, prefill_chunk: int, space: KVSpace, max_skips: int = 16):
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.space = space
        self.max_skips = max_skips
        self.waiting: deque[list[Sequence]] = deque()  # groups of n sequences
        self.running: list[Sequence] = []  # in admission order: the youngest last
        self.preemptions = 0

    def add(self, group: list[Sequence]) -> None:
        if len(group) > self.max_batch:
            raise ValueError(f"n={len(group)} is larger than max_batch={self.max_batch}")
        self.waiting.append(group)

    @property
    def num_waiting(self) -> int:
        return sum(len(g) for g in self.waiting)

    # ---------------------------------------------------------------- admission

    def _cost(self, group: list[Sequence], partial: bool) -> int:
        first = group[0]
        return self.space.admission_cost(first.tokens, self._limit(first), first.target + 1,
                                         len(group), partial, first.root)

    @staticmethod
    def _limit(seq: Sequence) -> int:
        """How much of a sequence's tokens may come from the cache: a new prompt's last token
        is computed (its logits give the first output token, or its state the embedding);
        none of a `whole_prompt` (every position's logits or states are needed)."""
        if seq.output_ids:
            return seq.target
        if seq.whole_prompt:
            return 0
        return seq.target - 1

    def _admit(self) -> list[Sequence]:
        admitted: list[Sequence] = []
        kept: deque[list[Sequence]] = deque()
        blocked = False  # a request that may not be passed any more waits for room
        deferred: set[int] = set()  # waiting for a running prefill of their prefix
        # free blocks that the running sequences, and those admitted in this pass, are still
        # to take (blocks are taken as a step computes them, not at admission)
        promised = self._promised()
        while self.waiting:
            group = self.waiting.popleft()
            if not blocked and self._prefilled_soon(group[0]):
                kept.append(group)  # a step or two from now the cache holds its prefix
                deferred.add(id(group))
                continue
            seats = len(self.running) + len(group) <= self.max_batch
            spare = self.space.n_free - promised - (self.space.reserve if self.running else 0)
            partial, cost = True, 0
            if seats and not blocked:
                cost = self._cost(group, partial)
                if cost > spare:  # no room to hold a partly matching block until its copy
                    partial, cost = False, self._cost(group, False)
            if blocked or not seats or cost > spare:
                kept.append(group)
                blocked = blocked or group[0].skipped >= self.max_skips
                continue
            for g in kept:
                if id(g) in deferred:
                    continue  # it chose to wait: being passed does not count against it
                g[0].skipped += 1
                blocked = blocked or g[0].skipped >= self.max_skips  # that was its last pass
            free = self.space.n_free
            self._start(group, partial)
            promised += cost - (free - self.space.n_free)  # less the cached blocks it took
            if not group[0].resumed:
                admitted.append(group[0])
        self.waiting = kept
        return admitted

    def _prefilled_soon(self, seq: Sequence) -> bool:
        """Whether a running sequence is prefilling at least one whole block of `seq`'s prompt
        that the cache does not hold yet: then `seq` waits for it, and sixteen users of one new
        system prompt arriving together prefill it once, not sixteen times."""
        bs, limit = self.space.block_size, self._limit(seq)
        if limit < bs:
            return False
        have: int | None = None
        head = seq.tokens[:limit]
        for other in self.running:
            if other.parent is not None or not other.prefilling or other.root != seq.root:
                continue
            shared = min(common_prefix_len(head, other.tokens), other.target) // bs * bs
            if shared > other.computed:  # its coming chunks write blocks `seq` can share
                if have is None:
                    have = self.space.cached_prefix(seq.tokens, limit, seq.root)[0]
                if shared > have:
                    return True
        return False

    def _promised(self) -> int:
        """Free blocks the running sequences will still take for what their admission
        counted: the rest of a prefill (through its first decode), one per choice waiting to
        copy its first choice's prefill."""
        bs, total = self.space.block_size, 0
        for s in self.running:
            if s.parent is not None:
                total += 1
            elif s.prefilling:
                total += max(0, -(-(s.target + 1) // bs) - len(s.table))
        return total

    def _start(self, group: list[Sequence], partial: bool) -> None:
        first = group[0]
        first.computed = self.space.admit(first, first.tokens, self._limit(first), partial,
                                          first.root)
        if not first.resumed:
            first.cached_prompt = first.computed
        for seq in group[1:]:  # siblings copy the first choice's prefill later
            seq.parent = first
        self.running.extend(group)

    def take_copies(self) -> list[tuple[int, int, int]]:
        """The block copies admissions left (see `KVSpace.admit`), for the engine to make at
        once, before the step's forward: (src block, dst block, positions) each."""
        copies = []
        for seq in self.running:
            if seq.copy is not None:
                copy = self.space.take_copy(seq)
                assert copy is not None
                copies.append(copy)
        return copies

    # ---------------------------------------------------------------- one step

    def schedule(self) -> StepPlan:
        """Admit what fits, then plan one step: every decoding sequence, plus prefill chunks of
        the oldest prefilling sequences up to `prefill_chunk` tokens in all (so a burst of new
        requests is prefilled in a few steps, and one long prompt never stalls decoding for
        more than one chunk's time). Blocks are taken for what the step computes; a sequence
        that cannot get one makes room by preempting the youngest."""
        admitted = self._admit()
        prefills: list[PrefillWork] = []
        decode: list[Sequence] = []
        budget, i = self.prefill_chunk, 0
        while i < len(self.running):
            seq = self.running[i]
            i += 1
            if seq.parent is not None:
                continue
            if seq.prefilling:
                if budget <= 0:
                    continue
                end = self._room_for(seq, min(seq.computed + budget, seq.target))
                if end is None:
                    i -= 1  # it preempted itself: the next one moved into its place
                    continue
                prefills.append(PrefillWork(seq, seq.computed, seq.tokens[seq.computed:end]))
                budget -= end - seq.computed
            elif seq.output_ids:
                if self._room_for(seq, seq.computed + 1) is None:
                    i -= 1
                    continue
                decode.append(seq)
        decode.sort(key=lambda s: s.slot)
        return StepPlan(prefills, decode, admitted)

    def _room_for(self, seq: Sequence, end: int) -> int | None:
        """Blocks for `seq`'s positions < end, preempting younger sequences as needed; a
        prefill with no one younger left shrinks to the blocks there are. Returns the end it
        got, or None if `seq` itself had to be preempted."""
        while not self.space.grow(seq, end):
            victim = next((s for s in reversed(self.running) if s.parent is None), None)
            if victim is not seq and victim is not None:
                self.preempt(victim)
                continue
            room = (len(seq.table) + self.space.n_free) * self.space.block_size
            if seq.prefilling and room > seq.computed:
                end = min(end, room)
                continue
            self.preempt(seq)
            return None
        return end

    def preempt(self, seq: Sequence) -> None:
        """Take `seq` (and the choices waiting to copy its prefill) out of the running set:
        its blocks go back, their contents cached, and it waits at the head of the queue."""
        self.preemptions += 1
        family = [seq] + [s for s in self.running if s.parent is seq]
        for s in family:
            self.running.remove(s)
        self.space.release(seq, seq.tokens[:seq.computed], keep=True)
        seq.computed, seq.resumed = 0, True
        for s in family[1:]:
            s.parent = None
            s.resumed = True
        self.waiting.appendleft(family)

    # ---------------------------------------------------------------- after a step

    def computed(self, seq: Sequence) -> None:
        """`seq.computed` advanced: its newly full blocks become shareable."""
        self.space.commit(seq, seq.tokens, seq.computed)

    def fork(self, parent: Sequence) -> list[tuple[Sequence, tuple[int, int, int] | None]]:
        """After `parent`'s prefill: each choice waiting for it gets its blocks (the copy to
        make, if any); a choice no block is free for waits to be recomputed instead."""
        out = []
        for sib in [s for s in self.running if s.parent is parent]:
            try:
                copy = self.space.fork(parent, sib, parent.computed)
            except MemoryError:
                self.running.remove(sib)
                sib.parent, sib.resumed = None, True
                self.waiting.appendleft([sib])
                continue
            sib.computed, sib.parent = parent.computed, None
            out.append((sib, copy))
        return out

    def finish(self, seq: Sequence, keep_cache: bool = True) -> None:
        """Remove a finished or cancelled sequence and give back its blocks.

        Their contents stay cached for prefix reuse, unless a failed step left them undefined
        (`keep_cache=False`)."""
        if seq.finished:
            return
        seq.finished = True
        if seq in self.running:
            self.running.remove(seq)
            for s in self.running:
                if s.parent is seq:  # it never forked: it prefills on its own
                    s.parent, s.computed = None, 0
                    s.computed = self.space.admit(s, s.tokens, self._limit(s), root=s.root)
            self.space.release(seq, seq.tokens[:seq.computed], keep=keep_cache)
        else:
            for group in self.waiting:
                if seq in group:
                    group.remove(seq)
            self.waiting = deque(g for g in self.waiting if g)
