"""The memory a new allocation can take: the RAM available (the kernel's `MemAvailable`, or
less where the process's memory cgroup, v2 or v1's memory controller, leaves less before its
limit: a container's `--memory`, a JupyterHub pod, a batch job), or a GPU's free memory.

Read by the KV budget (`engine.kv_budget`) and by the loaders' check that a model fits
(`loading.memory_check`): both must see a container's limit, not the host's RAM.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

PROC, CGROUP = Path("/proc"), Path("/sys/fs/cgroup")
NO_LIMIT = 2**60  # cgroup v1 writes "no limit" as the largest page-aligned int64


def return_freed_memory() -> None:
    """Give the heap pages that freed temporaries left back to the system: glibc keeps them
    for the process otherwise (loading's dequantized tensors, unfused projections, a parsed
    file). No-op where there is no malloc_trim."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)


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
