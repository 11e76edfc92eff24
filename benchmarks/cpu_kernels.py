"""Micro-benchmarks behind the CPU choices in nbserve/models/linear.py and nbserve/cpu_threads.py.

For SmolLM2-135M's shapes (30 layers of q, k, v, o, gate, up, down; the 49152 x 576 LM head) it
times, at 1 and 16 input rows: float32 `F.linear`, float32 split by output rows (`bmm`), float32
through oneDNN-packed copies (`PackedCopy`), float16 and bfloat16 `F.linear`; each in the main
thread and in a fresh non-main thread (where the engine runs). Random weights: only shapes
matter.

    python benchmarks/cpu_kernels.py               # ~1 minute on 2 cores
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from nbserve.models.linear import PackedCopy  # noqa: E402

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


def run(where: str, threads: int, rows_list: list[int], n: int) -> None:
    torch.set_num_threads(threads)
    for rows in rows_list:
        for name, fn in cases(rows).items():
            print(f"{where:<7} threads={threads} rows={rows:<3} {name:<22} "
                  f"{median_ms(fn, n):8.1f} ms", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--n", type=int, default=10)
    args = ap.parse_args()
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
