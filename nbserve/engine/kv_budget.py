"""How many KV blocks an engine gets: a memory budget in bytes, or a fraction of what the
device has free (of the RAM available, on CPU), divided by what one block takes.

On CPU the cache is committed lazily (see `execution.kv_cache.PagedKVCache`), so the budget is a
ceiling: resident memory grows with the tokens the traffic holds at once (and the prefixes
kept in those blocks). Unless the budget is given in bytes, the pool is also capped at
`max_batch` sequences of the longest context (what a reservation per sequence would have
taken; more would only keep old prefixes).

The RAM available is read by `cpu.memory.available_bytes` (MemAvailable, or less under a
memory cgroup's limit), so that a cache sized in a container fits the container.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..cpu.memory import CGROUP, PROC, available_bytes

CPU_FRACTION = 0.25  # of the RAM available when the engine starts
CUDA_FRACTION = 0.9  # of the GPU memory free when the engine starts


@dataclass(frozen=True, slots=True)
class KVBudget:
    """The sizing of one engine's paged cache, and what it was sized from (for the log)."""

    n_blocks: int
    block_size: int
    bytes_per_token: int
    budget_bytes: int
    source: str  # "kv_memory=..." or "0.25 of 20.1 GiB available RAM"

    @property
    def nbytes(self) -> int:
        return self.n_blocks * self.block_size * self.bytes_per_token

    @property
    def tokens(self) -> int:
        return self.n_blocks * self.block_size


RETAINED_FRACTION = 4  # cached prefixes kept: at most 1/4 of the blocks ...
RETAINED_CONTEXTS = 2  # ... and at most two full contexts


def retained_blocks(budget: KVBudget, max_context: int) -> int:
    """How many cached blocks a paged cache keeps before a new block evicts one rather than
    touch a never-used block: a quarter of the cache or two full contexts, whichever is less
    (a few conversations' prefixes, however many distinct prompts pass through)."""
    contexts = -(-RETAINED_CONTEXTS * max_context // budget.block_size)
    return min(budget.n_blocks // RETAINED_FRACTION, contexts)


def check_kv_memory(value: object) -> None:
    """`kv_memory`: bytes (an int >= 1), a fraction in (0, 1], or None (the default)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0 or \
            (isinstance(value, float) and value > 1):
        raise ValueError(f"kv_memory must be a number of bytes (an integer), a fraction of the "
                         f"free memory in (0, 1], or None for the default, got {value!r}")


def plan_blocks(bytes_per_token: int, block_size: int, device: torch.device,
                kv_memory: int | float | None, cap_tokens: int | None,
                proc: Path = PROC, cgroup: Path = CGROUP) -> KVBudget:
    """The block count that fits the budget (at least one block); `cap_tokens` bounds a
    budget given as a fraction (one in bytes is taken as it is). `proc`, `cgroup`: as for
    `available_bytes`."""
    block_bytes = bytes_per_token * block_size
    if isinstance(kv_memory, int):
        budget, source = kv_memory, f"kv_memory={kv_memory / 2**20:.0f} MiB"
    else:
        fraction = kv_memory if kv_memory is not None else \
            CUDA_FRACTION if device.type == "cuda" else CPU_FRACTION
        free, what = available_bytes(device, proc, cgroup)
        budget = int(free * fraction)
        source = f"{fraction:g} of {free / 2**30:.1f} GiB {what}"
        if cap_tokens is not None and cap_tokens * bytes_per_token < budget:
            budget = cap_tokens * bytes_per_token
            source = f"{cap_tokens} tokens: max_batch x max_context, less than {source}"
    n_blocks = budget // block_bytes
    if n_blocks < 1:
        raise ValueError(f"a KV budget of {budget / 2**20:.1f} MiB ({source}) holds no block of "
                         f"{block_size} tokens ({block_bytes / 2**20:.2f} MiB): raise kv_memory")
    return KVBudget(int(n_blocks), block_size, bytes_per_token, budget, source)
