"""Keep the caller's thread from slowing down the engine thread's parallel torch ops.

libgomp (the OpenMP runtime of torch's Linux builds) stops spinning between parallel regions
once it manages more threads than there are cores, and every thread's pool counts. After the
caller's thread (a notebook's main thread, where cells run) has run torch ops on several
threads, its pool stays, and from then on every parallel op of the engine thread pays a futex
wake-up. Measured on this project's 2-core machine (benchmarks/README.md, "Threads"): a 2-thread
add of 70k floats took 7.6 us in a fresh thread, 41 us once the main thread had a pool, and 7.8
us again after the main thread freed it. A one-row decode step of SmolLM2 went from 36 to 63 ms.

OpenMP 5.0's `omp_pause_resource_all` frees the calling thread's pool (libgomp implements it for
the host). nbserve calls it in the caller's thread when an engine starts and, in IPython or
Jupyter, after every cell while an engine thread is alive, so a cell that trained or built a
model does not leave the engine slower. The next parallel op of that thread starts a new pool
(tens of microseconds). Elsewhere (macOS, Intel's OpenMP, no OpenMP) these are no-ops.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Callable
from typing import Any

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free threads, keep what is cheap to keep


@functools.lru_cache(maxsize=1)
def _pause_function() -> Callable[[int], int] | None:
    """libgomp's `omp_pause_resource_all` as loaded in this process by torch, if it is."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line and "/" in line}
    except OSError:  # not Linux
        return None
    for path in sorted(paths):
        try:
            fn = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):  # an old libgomp without OpenMP 5.0
            continue
        fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
        return fn
    return None


def release_openmp_pool() -> bool:
    """Free the calling OS thread's OpenMP thread pool; True when it did (torch on libgomp).
    Call it only between torch ops of this thread (never from inside one)."""
    import torch  # noqa: F401 -- loads libgomp, so that _pause_function can find it

    fn = _pause_function()
    return fn is not None and fn(OMP_PAUSE_SOFT) == 0


def engine_threads_alive() -> bool:
    return any(t.name.startswith("nbserve-engine") for t in threading.enumerate())


def _after_cell(*_: Any) -> None:
    if engine_threads_alive():
        release_openmp_pool()


def release_after_each_cell() -> bool:
    """In IPython / Jupyter, free the cell thread's OpenMP pool after every cell while an
    engine runs (registered once per kernel). Returns whether it is registered."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    if shell is None:
        return False
    if _after_cell not in shell.events.callbacks.get("post_run_cell", []):
        shell.events.register("post_run_cell", _after_cell)
    return True
