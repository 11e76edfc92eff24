"""How many KV blocks an engine gets: a memory budget in bytes, or a fraction of what the
device has free (of the RAM available, on CPU), divided by what one block takes.

On CPU the cache is committed lazily (see `models.kv_cache.PagedKVCache`), so the budget is a
ceiling: resident memory grows with the tokens the traffic holds at once (and the prefixes
kept in those blocks). Unless the budget is given in bytes, the pool is also capped at
`max_batch` sequences of the longest context (what a reservation per sequence would have
taken; more would only keep old prefixes).

The RAM available is the kernel's `MemAvailable`, or less where the process's memory cgroup
(v2, or v1's memory controller: a container's `--memory`, a JupyterHub pod, a batch job)
leaves less before its limit, so that a cache sized in a container fits the container.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

CPU_FRACTION = 0.25  # of the RAM available when the engine starts
CUDA_FRACTION = 0.9  # of the GPU memory free when the engine starts
PROC, CGROUP = Path("/proc"), Path("/sys/fs/cgroup")
NO_LIMIT = 2**60  # cgroup v1 writes "no limit" as the largest page-aligned int64


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


def available_bytes(device: torch.device, proc: Path = PROC,
                    cgroup: Path = CGROUP) -> tuple[int, str]:
    """Free memory of `device` (CUDA), or RAM available to a new allocation (elsewhere): the
    kernel's estimate, or what the process's memory cgroups leave before their limits, if
    less. `proc`, `cgroup`: where /proc and the cgroup tree are (a test gives a fake tree)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()  # loading leaves freed blocks in torch's allocator
        free, _ = torch.cuda.mem_get_info(device)
        return int(free), "GPU memory free"
    try:
        with open(proc / "meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        available = int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        import psutil

        available = int(psutil.virtual_memory().available)
    room = cgroup_room(proc, cgroup)
    if room is not None and room < available:
        return room, "RAM left under the cgroup's memory limit"
    return available, "RAM available"


def cgroup_room(proc: Path = PROC, cgroup: Path = CGROUP) -> int | None:
    """Bytes this process's memory cgroups leave before their limits (the least over its
    cgroup and the ones above it, v2 or v1), counting reclaimable file cache as free; None
    where no limit is set or no cgroup is found."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    rooms: list[int] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and not controllers:  # v2: one unified tree
            files = (cgroup, "memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):  # v1: the memory controller's tree
            files = (cgroup / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes",
                     "total_inactive_file")
        else:
            continue
        root = files[0]
        here = root / path.lstrip("/")
        # the cgroup and those above it; in a container its own cgroup is the tree's root
        levels = [here, *here.parents[:len(here.relative_to(root).parts)]] \
            if here.is_relative_to(root) else []
        for level in levels + [root]:
            room = _room(level, *files[1:])
            if room is not None:
                rooms.append(room)
    return min(rooms) if rooms else None


def _room(level: Path, limit_file: str, usage_file: str, inactive_key: str) -> int | None:
    """What one cgroup leaves before its memory limit; None without a limit (or files)."""
    try:
        limit_text = (level / limit_file).read_text().strip()
        if limit_text == "max" or int(limit_text) >= NO_LIMIT:
            return None
        usage = int((level / usage_file).read_text().strip())
    except (OSError, ValueError):
        return None
    inactive = 0
    try:
        for line in (level / "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == inactive_key:
                inactive = int(value)
    except (OSError, ValueError):
        pass
    return max(int(limit_text) - max(usage - inactive, 0), 0)


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
