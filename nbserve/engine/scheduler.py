"""Scheduler: which sequences run this step, in which cache slot, from which position.

Pure Python, no torch. Sequences wait in FIFO order; a sequence admitted gets a KV-cache slot,
preferring a free slot whose cached tokens share the longest prefix with its prompt (prefix
reuse: the second turn of a chat prefills only what is new). Each step decodes every sequence
that has finished its prefill, plus one prefill chunk of the oldest sequence still prefilling.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True, eq=False)
class Sequence:
    """One choice of one request, as the scheduler sees it."""

    group: Any  # the engine's per-request record (shared by the n choices)
    index: int  # choice number within the request
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    slot: int = -1
    computed: int = 0  # tokens whose keys/values are in the cache
    cached_prompt: int = 0  # prompt tokens found in the cache at admission
    finished: bool = False
    parent: Sequence | None = None  # for n > 1: the choice whose prefill this one copies

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids if self.output_ids else self.prompt_ids

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def prefilling(self) -> bool:
        return self.computed < len(self.prompt_ids)


@dataclass(slots=True)
class PrefillWork:
    seq: Sequence
    start: int  # first position of the chunk
    ids: list[int]

    @property
    def last(self) -> bool:
        return self.start + len(self.ids) == len(self.seq.prompt_ids)


@dataclass(slots=True)
class StepPlan:
    prefills: list[PrefillWork]  # within a budget of `prefill_chunk` tokens per step
    decode: list[Sequence]
    admitted: list[Sequence] = field(default_factory=list)  # first choice of each new request

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decode and not self.admitted


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """Length of the shared prefix of two token lists (compares 64-token blocks first)."""
    n, i = min(len(a), len(b)), 0
    while i + 64 <= n and a[i:i + 64] == b[i:i + 64]:
        i += 64
    while i < n and a[i] == b[i]:
        i += 1
    return i


class SlotTable:
    """Cache slots: which are in use, and which tokens each free slot still holds."""

    def __init__(self, n: int):
        self.free: set[int] = set(range(n))
        self.cached: list[list[int]] = [[] for _ in range(n)]
        self.last_used: list[int] = [0] * n
        self._clock = 0

    @property
    def n_free(self) -> int:
        return len(self.free)

    def take(self, prompt: list[int] | None) -> tuple[int, int]:
        """Take a free slot for `prompt`; return (slot, tokens already cached there)."""
        best, best_len = -1, -1
        for s in sorted(self.free):
            n = common_prefix_len(self.cached[s], prompt) if prompt else 0
            if n > best_len or (n == best_len and self.last_used[s] < self.last_used[best]):
                best, best_len = s, n
        self.free.remove(best)
        reuse = min(best_len, len(prompt) - 1) if prompt else 0
        self.cached[best] = []
        return best, max(reuse, 0)

    def release(self, slot: int, valid_tokens: list[int]) -> None:
        """Give the slot back, remembering the tokens whose keys/values it holds."""
        self._clock += 1
        self.cached[slot] = valid_tokens
        self.last_used[slot] = self._clock
        self.free.add(slot)


class Scheduler:
    """Waiting queue, running set and slots. The engine calls admit/schedule/finish."""

    def __init__(self, max_batch: int, prefill_chunk: int):
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.waiting: deque[list[Sequence]] = deque()  # groups of n sequences
        self.running: list[Sequence] = []
        self.slots = SlotTable(max_batch)

    def add(self, group: list[Sequence]) -> None:
        if len(group) > self.max_batch:
            raise ValueError(f"n={len(group)} is larger than max_batch={self.max_batch}")
        self.waiting.append(group)

    @property
    def num_waiting(self) -> int:
        return sum(len(g) for g in self.waiting)

    def _admit(self) -> list[Sequence]:
        admitted = []
        while self.waiting and self.slots.n_free >= len(self.waiting[0]):
            group = self.waiting.popleft()
            first = group[0]
            first.slot, first.computed = self.slots.take(first.prompt_ids)
            first.cached_prompt = first.computed
            for seq in group[1:]:  # siblings copy the first choice's prefill later
                seq.slot, _ = self.slots.take(None)
                seq.parent = first
            self.running.extend(group)
            admitted.append(first)
        return admitted

    def schedule(self) -> StepPlan:
        """Admit what fits, then plan one step: every decoding sequence, plus prefill chunks of
        the oldest prefilling sequences up to `prefill_chunk` tokens in all (so a burst of new
        requests is prefilled in a few steps, and one long prompt never stalls decoding for
        more than one chunk's time)."""
        admitted = self._admit()
        prefills, budget = [], self.prefill_chunk
        for seq in self.running:
            if budget <= 0:
                break
            if seq.parent is None and seq.prefilling:
                end = min(seq.computed + budget, len(seq.prompt_ids))
                prefills.append(PrefillWork(seq, seq.computed, seq.prompt_ids[seq.computed:end]))
                budget -= end - seq.computed
        decode = [s for s in self.running if not s.prefilling and s.output_ids]
        decode.sort(key=lambda s: s.slot)
        return StepPlan(prefills, decode, admitted)

    def finish(self, seq: Sequence, keep_cache: bool = True) -> None:
        """Remove a finished or cancelled sequence and free its slot.

        The slot remembers the sequence's cached tokens for prefix reuse, unless a failed
        step left them undefined (`keep_cache=False`)."""
        if seq.finished:
            return
        seq.finished = True
        if seq in self.running:
            self.running.remove(seq)
            self.slots.release(seq.slot, seq.tokens[:seq.computed] if keep_cache else [])
        else:
            for group in self.waiting:
                if seq in group:
                    group.remove(seq)
            self.waiting = deque(g for g in self.waiting if g)
