"""How many KV blocks an engine gets: a memory budget in bytes, or a fraction of what the
device has free (of the RAM available, on CPU), divided by what one block takes.

On CPU the cache is committed lazily (see `models.kv_cache.PagedKVCache`), so the budget is a
ceiling: resident memory grows with the tokens actually cached. Unless the budget is given
in bytes, the pool is also capped at `max_batch` sequences of the longest context (what a
reservation per sequence would have taken; more would only keep old prefixes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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


def available_bytes(device: torch.device) -> tuple[int, str]:
    """Free memory of `device` (CUDA), or RAM available to a new allocation (elsewhere)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()  # loading leaves freed blocks in torch's allocator
        free, _ = torch.cuda.mem_get_info(device)
        return int(free), "GPU memory free"
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024, "RAM available"
    except (OSError, KeyError, ValueError):
        import psutil

        return int(psutil.virtual_memory().available), "RAM available"


def check_kv_memory(value: object) -> None:
    """`kv_memory`: bytes (an int >= 1), a fraction in (0, 1], or None (the default)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0 or \
            (isinstance(value, float) and value > 1):
        raise ValueError(f"kv_memory must be a number of bytes (an integer), a fraction of the "
                         f"free memory in (0, 1], or None for the default, got {value!r}")


def plan_blocks(bytes_per_token: int, block_size: int, device: torch.device,
                kv_memory: int | float | None, cap_tokens: int | None) -> KVBudget:
    """The block count that fits the budget (at least one block); `cap_tokens` bounds a
    budget given as a fraction (one in bytes is taken as it is)."""
    block_bytes = bytes_per_token * block_size
    if isinstance(kv_memory, int):
        budget, source = kv_memory, f"kv_memory={kv_memory / 2**20:.0f} MiB"
    else:
        fraction = kv_memory if kv_memory is not None else \
            CUDA_FRACTION if device.type == "cuda" else CPU_FRACTION
        free, what = available_bytes(device)
        budget = int(free * fraction)
        source = f"{fraction:g} of {free / 2**30:.1f} GiB {what}"
        if cap_tokens is not None:
            budget = min(budget, cap_tokens * bytes_per_token)
    n_blocks = budget // block_bytes
    if n_blocks < 1:
        raise ValueError(f"a KV budget of {budget / 2**20:.1f} MiB ({source}) holds no block of "
                         f"{block_size} tokens ({block_bytes / 2**20:.2f} MiB): raise kv_memory")
    return KVBudget(int(n_blocks), block_size, bytes_per_token, budget, source)
