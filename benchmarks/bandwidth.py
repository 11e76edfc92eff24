"""The machine's memory read bandwidth, measured the way a decode step reads its weights: a C
loop (compiled here with the compiler nbserve's kernels use, `-O3 -march=native -fopenmp`,
unrolled)
that sums a buffer larger than the caches, each thread reading its own contiguous part, the
best of several passes.

    python benchmarks/bandwidth.py                   # 1 and 2 threads, a 1 GiB buffer
    python benchmarks/bandwidth.py --threads 1,2,4 --mib 2048

It is the bound a lone decode stream meets: every weight is read once per token, so tokens/s
cannot pass (read bandwidth / weight bytes read per token). serve_bench.py prints that bound
for a GGUF model and each server's fraction of it (issue 42 item 4).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SOURCE = r"""
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* Fill the buffer (every page committed, no zero-page sharing). */
void bw_fill(uint64_t *buf, size_t n) {
    #pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) buf[i] = i * 0x9E3779B97F4A7C15ull;
}

/* Sum `n` words with `threads` threads, each over its own contiguous part: integer adds,
   which the compiler vectorizes without reassociation flags. The sum is returned so the
   reads cannot be dropped. */
uint64_t bw_read(const uint64_t *buf, size_t n, int threads) {
    uint64_t total = 0;
    #pragma omp parallel for schedule(static) num_threads(threads) reduction(+:total)
    for (size_t i = 0; i < n; i++) total += buf[i];
    return total;
}
"""
CACHE = Path.home() / ".cache" / "nbserve-bench" / "bandwidth"


def _library() -> ctypes.CDLL:
    """The read loop, compiled once per compiler and source (cached)."""
    from nbserve.cpu.kernels.build import compiler

    cc = compiler()
    key = hashlib.sha256((cc + SOURCE).encode()).hexdigest()[:16]
    lib = CACHE / f"bw-{key}.so"
    if not lib.is_file():
        CACHE.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / "bw.c"
            src.write_text(SOURCE)
            out = Path(tmp) / "bw.so"
            # -funroll-loops: several vector accumulators, so loads stay in flight
            subprocess.run([cc, "-O3", "-march=native", "-funroll-loops", "-fopenmp", "-fPIC",
                            "-shared", "-o", str(out), str(src)], check=True)
            out.replace(lib)
    dll = ctypes.CDLL(str(lib))
    dll.bw_fill.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    dll.bw_fill.restype = None
    dll.bw_read.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    dll.bw_read.restype = ctypes.c_uint64
    return dll


def read_bandwidth(threads: int, mib: int = 1024, passes: int = 8) -> float:
    """Best read bandwidth in GB/s (1e9 bytes/s) over `passes` sums of a `mib`-MiB buffer
    with `threads` threads."""
    lib = _library()
    words = mib * 2**20 // 8
    buf = (ctypes.c_uint64 * words)()
    addr = ctypes.addressof(buf)
    lib.bw_fill(addr, words)
    lib.bw_read(addr, words, threads)  # warm: pages mapped, threads started
    best = float("inf")
    for _ in range(passes):
        t0 = time.perf_counter()
        lib.bw_read(addr, words, threads)
        best = min(best, time.perf_counter() - t0)
    del buf
    return words * 8 / best / 1e9


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    p.add_argument("--mib", type=int, default=1024, help="buffer size (larger than the caches)")
    p.add_argument("--passes", type=int, default=8)
    args = p.parse_args()
    from machine import cpu_line

    print(cpu_line(), flush=True)
    for t in (int(x) for x in args.threads.split(",")):
        gbs = read_bandwidth(t, args.mib, args.passes)
        print(f"read bandwidth, {t} thread{'s' * (t > 1)}: {gbs:.1f} GB/s "
              f"(best of {args.passes} sums of {args.mib} MiB)", flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
