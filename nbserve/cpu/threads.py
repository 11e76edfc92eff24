"""How many torch threads a CPU forward should use, found by timing rather than guessing.

Why not a fixed number: on a small CPU the best count changes with things the engine cannot see
in advance (benchmarks/README.md, "Threads", has the figures):

- with the cores free, more threads make a decode step faster, alone or batched;
- but when another busy thread shares the cores (the server's event loop, a notebook cell), or
  when some other OS thread of the process has already run torch ops on 2 threads (libgomp then
  counts more pool threads than cores and stops spinning between ops), 2 threads can be many
  times slower than 1.

So `ThreadTuner` times each candidate per forward size and keeps the faster, re-checking the
slower one now and then (less and less often while it keeps losing). The second cause is also
removed at its source where possible: `nbserve.cpu.openmp_pool` frees the caller's OpenMP pool.
"""

from __future__ import annotations

import contextlib
import os
import statistics
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block with `n` torch intra-op threads in this OS thread, then restore.

    nbserve's own work in the caller's thread (loading, allocating the cache) runs with one
    thread, so that the caller's thread never starts an OpenMP pool that would slow the engine
    thread's (see the module docstring)."""
    before = torch.get_num_threads()
    if n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def default_choices(cores: int | None = None) -> tuple[int, ...]:
    """Thread counts worth comparing: all cores, and half of them (at least one)."""
    cores = cores or os.cpu_count() or 1
    return tuple(sorted({max(1, cores // 2), cores}))


@dataclass
class _Bucket:
    """Timings of one forward size class: the last few seconds-per-forward of each choice,
    judged by their median so that one stalled forward does not condemn a choice."""

    choices: tuple[int, ...]
    min_gap: int
    max_gap: int
    window: int
    samples: dict[int, deque] = field(default_factory=dict)  # the last few, by choice
    gap: int = 0
    since: int = 0
    exploring: int | None = None

    def median(self, choice: int) -> float:
        return statistics.median_low(self.samples[choice])

    def best(self) -> int:
        return min(self.samples, key=self.median)

    def choose(self) -> int:
        for c in reversed(self.choices):  # time each once, most threads first
            if c not in self.samples:
                return c
        best = self.best()
        self.since += 1
        if self.since >= (self.gap or self.min_gap):
            self.since = 0
            self.exploring = min((c for c in self.choices if c != best), key=self.median)
            return self.exploring
        return best

    def record(self, threads: int, seconds: float) -> None:
        recent = self.samples.setdefault(threads, deque(maxlen=self.window))
        if self.exploring == threads:
            recent.clear()  # a re-check: judge the loser by now, not by what it did long ago
        recent.append(seconds)
        if self.exploring == threads:
            self.exploring = None
            won = self.best() == threads
            self.gap = self.min_gap if won else min(max(self.gap, self.min_gap) * 2,
                                                    self.max_gap)


class ThreadTuner:
    """Picks the torch thread count for each forward by timing the candidates per size class.

    Size classes are powers of two of the tokens in the forward (1, 2-3, 4-7, ...). Within a
    class the faster choice is used; the other is tried again after `min_gap` forwards, and the
    gap doubles (up to `max_gap`) each time it loses again, so even a choice that is many
    times slower costs little once it has been found out.
    """

    def __init__(self, choices: Sequence[int] | None = None, *, min_gap: int = 16,
                 max_gap: int = 1024, window: int = 5):
        self.choices = tuple(sorted(set(choices or default_choices())))
        if not self.choices or min(self.choices) < 1:
            raise ValueError(f"thread choices must be integers >= 1, got {choices!r}")
        self.min_gap, self.max_gap, self.window = min_gap, max_gap, window
        self._buckets: dict[int, _Bucket] = {}
        self._started: set[int] = set()  # thread counts whose pool has started

    @staticmethod
    def size_class(tokens: int) -> int:
        return max(1, min(int(tokens), 1 << 16)).bit_length()

    def _bucket(self, tokens: int) -> _Bucket:
        key = self.size_class(tokens)
        if key not in self._buckets:
            self._buckets[key] = _Bucket(self.choices, self.min_gap, self.max_gap, self.window)
        return self._buckets[key]

    def choose(self, tokens: int) -> int:
        """The thread count to use for a forward over `tokens` tokens."""
        if len(self.choices) == 1:
            return self.choices[0]
        return self._bucket(tokens).choose()

    def record(self, tokens: int, threads: int, seconds: float) -> None:
        """Report how long that forward took."""
        if threads not in self._started:  # the first forward pays for starting the pool
            self._started.add(threads)
            return
        if len(self.choices) > 1:
            self._bucket(tokens).record(threads, seconds)

    def summary(self) -> dict[str, dict]:
        """Per size class: the current choice and the median ms per forward of each choice."""
        out = {}
        for key in sorted(self._buckets):
            b = self._buckets[key]
            lo, hi = 1 << (key - 1), (1 << key) - 1
            label = str(lo) if lo == hi else f"{lo}-{hi}"
            out[label] = {"threads": b.best() if b.samples else None,
                          "ms": {str(c): round(b.median(c) * 1e3, 2) for c in sorted(b.samples)}}
        return out
