"""Per-machine choices between kernel paths that only a measurement can make.

One today: whether the 16-bit row kernels (flag NBQ_ROUND16 of `quant_matmul.c`: steps of one or
two rows with their inputs rounded to 16 bits per block) beat the exact float32 row kernels. On
an AVX2 build they are the only fast row path, so they always run. An AVX-512 build has both,
and which wins depends on the core: the 16-bit kernels were faster on an Intel Xeon, the
AVX-512 table path on a Zen 5 (benchmarks/README.md). So there the two are timed once on a
weight of the default model's MLP size, and the answer is kept beside the cached library, so
that a machine keeps one choice (and one set of greedy answers) from run to run.

`NBSERVE_ROUND16=1` or `0` decides without measuring.

8-bit inputs (flag NBQ_ROUND8 of `gguf_blocks.c`, llama.cpp's Q8_K: 8 bits per 256 inputs):
Q4_K's and Q6_K's products in decode steps take them by default, and prompt chunks of more than
8 rows take 8 bits per 32 where gemm8 takes them (flag NBQ_ROUND8_MANY), where rounding is
allowed (weights="blocks" without exact=True) and the build has those kernels.
`NBSERVE_ROUND8=decode` keeps prompts at 16 bits, `NBSERVE_ROUND8=all` rounds every prompt chunk
per 256, `NBSERVE_ROUND8=0` keeps the 16-bit choice above everywhere. Not measured per machine:
the 8-bit kernels read fewer bytes of input and do half the integer work of the 16-bit ones on
every core measured.
"""

from __future__ import annotations

import ctypes
import json
import os
import threading
import time
from pathlib import Path

import numpy as np

from .abi import KernelFlag

_choices: dict[str, bool] = {}  # by library path, for this process
_lock = threading.Lock()


def round16_pays(lib: ctypes.CDLL, threads: int = 1) -> bool:
    """Whether `lib`'s one- and two-row products should take their inputs rounded to 16 bits
    (where the caller allows it: weights="blocks"): False where the build has no 16-bit row
    kernels, True on a build whose only fast row kernels they are (AVX2), else measured."""
    if not lib.nbq_round16_max_rows():
        return False
    forced = os.environ.get("NBSERVE_ROUND16", "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    if forced:
        raise ValueError(f"NBSERVE_ROUND16={forced!r}: use 1 (round the inputs of one- and "
                         "two-row steps to 16 bits), 0 (keep them float32) or leave it unset")
    if lib.nbq_simd_width() != 16:  # AVX2: no other fast row path
        return True
    name = lib._name
    with _lock:
        if name not in _choices:
            _choices[name] = _remembered_or_measured(lib, Path(name), threads)
        return _choices[name]


ROUND8_MODES = {"": "many", "1": "many", "decode": "decode", "all": "all", "0": "none"}


def round8_wanted() -> str:
    """Which Q4_K and Q6_K products round their inputs to 8 bits: "many" (unset or
    NBSERVE_ROUND8=1: decode steps, and prompt chunks where gemm8 takes them, past 8 rows),
    "decode" (NBSERVE_ROUND8=decode: decode steps only), "all" (every prompt chunk too) or
    "none" (0); anything else is refused. Read once per weight, when its kernel is made (at
    load)."""
    forced = os.environ.get("NBSERVE_ROUND8", "").strip()
    if forced in ROUND8_MODES:
        return ROUND8_MODES[forced]
    raise ValueError(f"NBSERVE_ROUND8={forced!r}: use 1 or leave it unset (round the inputs of "
                     "Q4_K and Q6_K products to 8 bits in decode steps, and in prompt chunks "
                     "past 8 rows to 8 bits per 32), decode (decode steps only), all (every "
                     "prompt chunk too), or 0 (keep them at 16 bits)")


def _remembered_or_measured(lib: ctypes.CDLL, library: Path, threads: int) -> bool:
    record = library.with_name(library.name + ".round16.json")
    try:
        return bool(json.loads(record.read_text())["round16"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    timings = time_row_paths(lib, threads)
    choice = timings["round16"] < timings["float32"]
    try:
        record.write_text(json.dumps({"round16": choice, "ms": timings}))
    except OSError:  # a read-only cache: decided again in the next process
        pass
    return choice


def time_row_paths(lib: ctypes.CDLL, threads: int, n: int = 6144, k: int = 1536,
                   rounds: int = 7) -> dict[str, float]:
    """The best of `rounds` one-row products over random Q4 blocks (n, k) on each row path,
    alternating, in ms: {"float32": ..., "round16": ...}."""
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    scales = (rng.random((n, k // 32)) * 0.01 + 0.001).astype(np.float16)
    mins = (-rng.random((n, k // 32)) * 0.05).astype(np.float16)
    x = rng.standard_normal((1, k)).astype(np.float32)
    y = np.empty((1, n), dtype=np.float32)
    best = {"float32": float("inf"), "round16": float("inf")}
    for _ in range(rounds):
        for path, flags in (("float32", 0), ("round16", int(KernelFlag.ROUND16))):
            start = time.perf_counter()
            lib.nbq_q4_matmul(x.ctypes.data, 1, k, codes.ctypes.data, scales.ctypes.data,
                              mins.ctypes.data, n, y.ctypes.data, threads, None, 0.0, flags)
            best[path] = min(best[path], (time.perf_counter() - start) * 1e3)
    return best
