"""Micro-benchmarks behind the CPU choices in nbserve/models/linear.py and nbserve/cpu_threads.py.

For SmolLM2-135M's shapes (30 layers of q, k, v, o, gate, up, down; the 49152 x 576 LM head) it
times, at 1 and 16 input rows: float32 `F.linear`, float32 split by output rows (`bmm`), float32
through oneDNN-packed copies (`PackedCopy`), float16 and bfloat16 `F.linear`; each in the main
thread and in a fresh non-main thread (where the engine runs). Random weights: only shapes
matter.

Then the OpenMP trap (`nbserve/openmp_pool.py`): the same one-row packed layers and a 2-thread
add of 70k floats in a fresh thread, with no pool in the main thread, with one, and after
`release_openmp_pool()` freed it.

With `--crossover`: nbserve's C kernels (`nbserve/models/quant.py`) against oneDNN-packed
float32, the 30 layers and the head at 1 to 128 rows in a fresh thread: where FLOAT_MAX_ROWS and
the kernel's ROW_PATH_MAX (row kernels, then panels) come from (float32 weights as they are;
random Q4_1-style and Q8_0 blocks), and the blocks again with 16-bit inputs (`round16`, where
ROUND16_MAX_ROWS comes from; the same as without on a build that has no such kernels).

With `--blocks`: the C kernels over GGUF's own blocks (`cpu/kernels/gguf_blocks.c`), one
input row against a weight of every block type (or those of `--types`) larger than the caches
(256 MB of random blocks, rows of 4096), at 1 and 2 threads, in exact mode and with the input
rounded to 16 bits per block (`round16`, the integer row kernels; the same as exact on a build
without them) and, for Q4_K and Q6_K, to 8 bits per 256 (`round8`, llama.cpp's Q8_K): GB/s of
blocks read, beside the machine's read bandwidth measured by a C loop over a buffer of the same
size with the same threads just before each (the bound a decode step's matmuls can reach).
`NBSERVE_KERNEL_ISA=avx2` (or `plain`) times that path's build. With `--in-cache` as well: the
same modes on a weight that stays in the caches (256 rows of 4096), at 1, 2 and 4 input rows,
1 thread, in microseconds a product: the kernels' arithmetic alone.

    python benchmarks/cpu_kernels.py               # ~1 minute on 2 cores
    python benchmarks/cpu_kernels.py --crossover   # ~1 minute; needs a C compiler
    python benchmarks/cpu_kernels.py --blocks      # ~2 minutes; needs a C compiler
    python benchmarks/cpu_kernels.py --blocks --in-cache --types Q4_K,Q6_K  # seconds

With `--blocks --many`: Q4_K and Q6_K products of 16 and 64 input rows (decode batches, prompt
chunks) over the 1.5B shape's q/o (2048 x 1536 here: 1536 rounded up to whole groups) and FFN
(8960 x 1536, 1536 x 8960) weights, 1 thread, us per input row: 8-bit inputs in one call (gemm8
where the build has it, `blocks_rounded8_many`), the same 8 rows at a time (the 8-bit row
kernels), and 16-bit inputs (gemm16 on AVX-512, the row kernels or panels elsewhere).

    python benchmarks/cpu_kernels.py --blocks --many    # ~1 minute
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from nbserve.cpu.openmp_pool import release_openmp_pool  # noqa: E402
from nbserve.execution.linear import PackedCopy  # noqa: E402
from nbserve.execution.quant import KernelLinear, QuantBlocks  # noqa: E402

SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
HEAD = (49152, 576)


def split(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    k = torch.get_num_threads()
    return torch.bmm(x.expand(k, -1, -1), w.view(k, -1, w.shape[1]).transpose(1, 2))


def median_ms(fn: Callable[[], object], n: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[n // 2] * 1e3


def cases(rows: int) -> dict[str, Callable[[], object]]:
    g = torch.Generator().manual_seed(0)
    layers = [torch.randn(o, i, generator=g) for _ in range(30) for o, i in SHAPES]
    head = torch.randn(*HEAD, generator=g)
    x = {i: torch.randn(rows, i, generator=g) for i in (576, 1536)}
    half = [w.half() for w in layers]
    bf = [w.bfloat16() for w in layers]
    packed = [PackedCopy(w) for w in layers]
    packed_head = PackedCopy(head)
    return {
        "layers f32 F.linear": lambda: [F.linear(x[w.shape[1]], w) for w in layers],
        "layers f32 split bmm": lambda: [split(x[w.shape[1]], w) for w in layers],
        "layers f32 packed": lambda: [p(x[p.weight.shape[1]]) for p in packed],
        "layers f16 F.linear": lambda: [F.linear(x[w.shape[1]].half(), w).float() for w in half],
        "layers bf16 F.linear": lambda: [F.linear(x[w.shape[1]].bfloat16(), w).float()
                                         for w in bf],
        "head f32 F.linear": lambda: F.linear(x[576], head),
        "head f32 split bmm": lambda: split(x[576], head),
        "head f32 packed": lambda: packed_head(x[576]),
    }


def random_blocks(rows: int, k: int, kind: str, g: torch.Generator) -> QuantBlocks:
    scales = torch.rand(rows, k // 32, generator=g) * 0.01
    if kind == "q8":
        return QuantBlocks("q8", torch.randint(-127, 128, (rows, k), generator=g,
                                               dtype=torch.int8), scales, None)
    return QuantBlocks("q4", torch.randint(0, 256, (rows, k // 2), generator=g,
                                           dtype=torch.uint8), scales, -8 * scales)


def crossover(rows_list: list[int], n: int) -> None:
    """C kernel (float32 weights, q4 blocks) against oneDNN-packed float32, by input rows
    (the kernel's row paths up to nbq_row_path_max rows, its panels past that)."""
    g = torch.Generator().manual_seed(0)
    layers = [torch.randn(o, i, generator=g) for _ in range(30) for o, i in SHAPES]
    head = torch.randn(*HEAD, generator=g)
    packed = [PackedCopy(w) for w in [*layers, head]]
    f32 = [KernelLinear(w) for w in [*layers, head]]
    quant = [KernelLinear(random_blocks(*w.shape, "q4", g)) for w in layers]
    quant.append(KernelLinear(random_blocks(*head.shape, "q8", g)))
    rounded = [KernelLinear(op.weight, round16=True) for op in quant]

    def body() -> None:
        torch.set_num_threads(2)
        for rows in rows_list:
            x = {i: torch.randn(rows, i, generator=g) for i in (576, 1536)}
            cells = []
            for name, ops in (("f32 oneDNN-packed", packed), ("f32 C kernel", f32),
                              ("q4/q8 C kernel", quant), ("the same, 16-bit inputs", rounded)):
                def all_ops(ops: list = ops, x: dict = x) -> None:
                    for op in ops:
                        op(x[op.weight.shape[1] if isinstance(op, PackedCopy)
                             else op.in_features])
                cells.append(f"{name} {median_ms(all_ops, n):6.1f} ms")
            print(f"crossover rows={rows:<3} layers + head: " + " | ".join(cells), flush=True)

    release_openmp_pool()
    t = threading.Thread(target=body)
    t.start()
    t.join()


READ_LOOP = r"""
#include <stdint.h>
uint64_t read_all(const uint64_t *p, long n, int threads);
uint64_t read_all(const uint64_t *p, long n, int threads) {  /* every word read, once */
    uint64_t acc = 0;
    #pragma omp parallel for num_threads(threads) reduction(^:acc) schedule(static)
    for (long i = 0; i < n; i++) acc ^= p[i];
    return acc;
}
"""


def read_loop() -> ctypes.CDLL:
    """The C read loop, compiled with the kernels' flags for this CPU (or NBSERVE_KERNEL_ISA's)."""
    from nbserve.cpu.kernels import build

    folder = Path(tempfile.mkdtemp())
    (folder / "read.c").write_text(READ_LOOP)
    subprocess.run([build.compiler(), *build.FLAGS, *build._isa_arch()[0], "-o",
                    str(folder / "read.so"), str(folder / "read.c")], check=True)
    lib = ctypes.CDLL(str(folder / "read.so"))
    lib.read_all.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_int]
    lib.read_all.restype = ctypes.c_uint64
    return lib


def block_throughput(n: int, types: list[str] | None = None, size_mb: int = 256,
                     k: int = 4096) -> None:
    """GB/s of blocks a one-row product reads, per GGUF block type (all, or `types`), exact and
    rounded to 16 bits, at 1 and 2 threads, beside the read bandwidth of a C loop over as many
    bytes."""
    from nbserve.cpu.kernels import build
    from nbserve.cpu.kernels.blocks import BlockType, row_bytes

    lib, reader = build.quant_kernels(), read_loop()
    rng = np.random.default_rng(0)
    print(f"blocks: simd width {lib.nbq_simd_width()}, NBSERVE_KERNEL_ISA="
          f"{os.environ.get('NBSERVE_KERNEL_ISA', 'native')}, {size_mb} MB a weight, k={k}, "
          f"load average {os.getloadavg()[0]:.1f}")
    chosen = [BlockType[name] for name in types] if types else list(BlockType)

    def body() -> None:
        buf = np.ones(size_mb << 20, dtype=np.uint8)

        def read_rate(threads: int) -> float:  # GB/s of the C read loop now
            s = median_ms(lambda: reader.read_all(buf.ctypes.data, buf.nbytes // 8, threads),
                          n) / 1e3
            return buf.nbytes / s / 1e9

        x, y = torch.randn(1, k), torch.empty(1, (size_mb << 20) // 64)
        for block_type in chosen:
            rows = (size_mb << 20) // row_bytes(block_type, k)
            raw = rng.integers(0, 256, rows * row_bytes(block_type, k), dtype=np.uint8)
            for mode, flags in block_modes(lib, block_type):
                cells = []
                for threads in (1, 2):
                    def product(t: int = threads, kind: int = int(block_type),
                                w: np.ndarray = raw, n_out: int = rows, f: int = flags) -> None:
                        lib.nbq_blocks_matmul(x.data_ptr(), 1, k, kind, w.ctypes.data, n_out,
                                              y.data_ptr(), t, None, 0.0, f)

                    bound = read_rate(threads)  # just before: the machine's load moves
                    rate = raw.nbytes / (median_ms(product, n) / 1e3) / 1e9
                    cells.append(f"{threads} thread(s) {rate:6.2f} GB/s, read loop {bound:5.1f} "
                                 f"({100 * rate / bound:3.0f}%)")
                print(f"blocks: {block_type.name:<7} {mode:<7} 1 row: " + " | ".join(cells),
                      flush=True)

    release_openmp_pool()
    t = threading.Thread(target=body)  # a fresh thread, as the engine's
    t.start()
    t.join()


def block_modes(lib: ctypes.CDLL, block_type: int) -> list[tuple[str, int]]:
    """The kernel modes a build has for a block type: exact, round16, round8, with their flags."""
    from nbserve.cpu.kernels.abi import KernelFlag
    from nbserve.cpu.kernels.blocks import blocks_rounded, blocks_rounded8

    modes = [("exact", 0)]
    if blocks_rounded(block_type, lib):
        modes.append(("round16", int(KernelFlag.ROUND16)))
    if blocks_rounded8(block_type, lib):
        modes.append(("round8", int(KernelFlag.ROUND8)))
    return modes


def block_in_cache(n: int, types: list[str] | None = None, n_out: int = 256,
                   k: int = 4096) -> None:
    """Microseconds of a product over a weight that stays in the caches (n_out rows of k), per
    block type and mode, at 1, 2 and 4 input rows, 1 thread: the row kernels' arithmetic."""
    from nbserve.cpu.kernels import build
    from nbserve.cpu.kernels.blocks import BlockType, row_bytes

    lib = build.quant_kernels()
    rng = np.random.default_rng(0)
    chosen = [BlockType[name] for name in types] if types else list(BlockType)
    print(f"blocks in cache: simd width {lib.nbq_simd_width()}, {n_out} rows of {k}, 1 thread, "
          f"load average {os.getloadavg()[0]:.2f}")

    def body() -> None:
        for block_type in chosen:
            raw = rng.integers(0, 256, n_out * row_bytes(block_type, k), dtype=np.uint8)
            for mode, flags in block_modes(lib, block_type):
                cells = []
                for rows in (1, 2, 4):
                    x, y = torch.randn(rows, k), torch.empty(rows, n_out)

                    def product(r: int = rows, kind: int = int(block_type), f: int = flags,
                                x: torch.Tensor = x, y: torch.Tensor = y,
                                w: np.ndarray = raw) -> None:
                        for _ in range(10):
                            lib.nbq_blocks_matmul(x.data_ptr(), r, k, kind, w.ctypes.data,
                                                  n_out, y.data_ptr(), 1, None, 0.0, f)

                    cells.append(f"{rows} row(s) {median_ms(product, n) * 100:7.1f} us")
                print(f"blocks in cache: {block_type.name:<7} {mode:<7} " + " | ".join(cells),
                      flush=True)

    release_openmp_pool()
    t = threading.Thread(target=body)
    t.start()
    t.join()


def block_many(n: int, shapes: tuple[tuple[int, int], ...] = ((2048, 1536), (8960, 1536),
                                                              (1536, 8960))) -> None:
    """Microseconds per input row of Q4_K and Q6_K products of 16 and 64 rows, 1 thread: 8-bit
    inputs in one call, 8 rows a call (the row kernels), and 16-bit inputs."""
    from nbserve.cpu.kernels import build
    from nbserve.cpu.kernels.abi import KernelFlag
    from nbserve.cpu.kernels.blocks import BlockType, blocks_rounded8_many, row_bytes

    lib = build.quant_kernels()
    rng = np.random.default_rng(0)
    r8, r16 = int(KernelFlag.ROUND8), int(KernelFlag.ROUND16)
    print(f"blocks, many rows: simd width {lib.nbq_simd_width()}, 1 thread, load average "
          f"{os.getloadavg()[0]:.2f}")

    def body() -> None:
        for block_type in (BlockType.Q4_K, BlockType.Q6_K):
            gemm8 = "gemm8" if blocks_rounded8_many(block_type, lib) else "row kernels"
            for n_out, k in shapes:
                raw = rng.integers(0, 256, (n_out, row_bytes(block_type, k)), dtype=np.uint8)
                raw[:, ::row_bytes(block_type, 256)] = 0  # no inf / nan scales: Q4_K's d
                for rows in (16, 64):
                    x, y = torch.randn(rows, k), torch.empty(rows, n_out)

                    def call(r0: int, r1: int, flags: int, x: torch.Tensor = x,
                             y: torch.Tensor = y, w: np.ndarray = raw,
                             kind: int = int(block_type), n_out: int = n_out,
                             k: int = k) -> None:
                        lib.nbq_blocks_matmul(x[r0:].data_ptr(), r1 - r0, k, kind, w.ctypes.data,
                                              n_out, y[r0:].data_ptr(), 1, None, 0.0, flags)

                    def eights(rows: int = rows, call: Callable[..., None] = call) -> None:
                        for i in range(0, rows, 8):
                            call(i, i + 8, r8)

                    many = median_ms(partial(call, 0, rows, r8), n) * 1e3 / rows
                    by_eight = median_ms(eights, n) * 1e3 / rows
                    sixteen = median_ms(partial(call, 0, rows, r16), n) * 1e3 / rows
                    print(f"blocks, many rows: {block_type.name} {n_out}x{k} {rows:>2} rows: "
                          f"8-bit one call ({gemm8}) {many:6.1f} us/row | 8 rows a call "
                          f"{by_eight:6.1f} | 16-bit {sixteen:6.1f}", flush=True)

    release_openmp_pool()
    t = threading.Thread(target=body)
    t.start()
    t.join()


def run(where: str, threads: int, rows_list: list[int], n: int) -> None:
    torch.set_num_threads(threads)
    for rows in rows_list:
        for name, fn in cases(rows).items():
            print(f"{where:<7} threads={threads} rows={rows:<3} {name:<22} "
                  f"{median_ms(fn, n):8.1f} ms", flush=True)


def openmp_trap(n: int) -> None:
    """Fresh-thread timings with and without an OpenMP pool in the main thread."""
    g = torch.Generator().manual_seed(0)
    packed = [PackedCopy(torch.randn(o, i, generator=g)) for _ in range(30) for o, i in SHAPES]
    x = {i: torch.randn(1, i, generator=g) for i in (576, 1536)}
    a, b, out = torch.randn(70_000), torch.randn(70_000), torch.empty(70_000)

    def in_thread(label: str) -> None:
        def body() -> None:
            torch.set_num_threads(2)
            add = median_ms(lambda: [torch.add(a, b, out=out) for _ in range(100)], n) * 10
            layers = median_ms(lambda: [p(x[p.weight.shape[1]]) for p in packed], n)
            print(f"openmp trap, {label:<34} add {add:6.1f} us   layers f32 packed 1 row "
                  f"{layers:6.1f} ms", flush=True)
        t = threading.Thread(target=body)
        t.start()
        t.join()

    release_openmp_pool()  # building the weights above may have started one
    in_thread("no pool in the main thread")
    torch.set_num_threads(2)
    torch.randn(4_000_000).exp()  # the main thread now has a pool
    in_thread("main thread holds a pool")
    release_openmp_pool()
    in_thread("after release_openmp_pool()")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--n", type=int, default=10)
    ap.add_argument("--trap-only", action="store_true", help="only the OpenMP trap figures")
    ap.add_argument("--crossover", action="store_true",
                    help="only the C kernels against oneDNN, 1 to 128 rows")
    ap.add_argument("--blocks", action="store_true",
                    help="only the GGUF block kernels' throughput against the read bandwidth")
    ap.add_argument("--in-cache", action="store_true",
                    help="with --blocks: microseconds over a weight in the caches, 1-4 rows")
    ap.add_argument("--types", default="",
                    help="with --blocks: the block types to time, e.g. Q4_K,Q6_K (default all)")
    ap.add_argument("--many", action="store_true",
                    help="with --blocks: Q4_K/Q6_K products of 16 and 64 rows, gemm8 and the rest")
    args = ap.parse_args()
    if args.blocks and args.many:
        block_many(args.n)
        return
    if args.blocks and args.in_cache:
        block_in_cache(args.n, args.types.split(",") if args.types else None)
        return
    if args.blocks:
        block_throughput(args.n, args.types.split(",") if args.types else None)
        return
    if args.crossover:
        crossover([1, 2, 4, 8, 9, 12, 16, 32, 64, 128], args.n)
        return
    if args.trap_only:
        openmp_trap(args.n)
        return
    openmp_trap(args.n)  # first: the rest leaves a pool in the main thread
    rows = [int(r) for r in args.rows.split(",")]
    for th in (int(t) for t in args.threads.split(",")):
        # a fresh thread first: once the main thread has run parallel ops, other threads slow
        # down (see nbserve/cpu_threads.py), which is the engine's situation in a notebook
        t = threading.Thread(target=run, args=("thread", th, rows, args.n))
        t.start()
        t.join()
    for th in (int(t) for t in args.threads.split(",")):
        run("main", th, rows, args.n)


if __name__ == "__main__":
    main()
