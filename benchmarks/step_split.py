"""Where a decode step's time goes, in process, on the default model (or --model): at 1 and 16
concurrent streams (--streams), the engine's decode steps split into matmuls, attention, the
rest of the model (norms, rope, residuals, embedding, Python), sampling and bookkeeping.

The engine serves `streams` requests of about 60 prompt tokens together (greedy, past
end-of-text); the figures cover the steps in which every stream decodes: no prefill. Each
step's parts are read at its own end, in the engine's thread (the engine's step record gives
its model / sampling / bookkeeping time); matmuls are timed around every call of the model's
matmul paths (nbserve's C kernel, oneDNN-packed copies), attention around its C kernels.
Timing wrappers add a little to "rest of the model". Asserts nothing.

    python benchmarks/step_split.py                  # ~1 minute on 2 cores
    python benchmarks/step_split.py --streams 1,16,64
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

SPENT: Counter[str] = Counter()  # seconds per part, while timing is on


def timed(part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn`, adding the time of each call to SPENT[part]."""
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            SPENT[part] += time.perf_counter() - t0
    return wrapper


def instrument() -> None:
    """Wrap the matmul and attention paths of nbserve's models with timers, and have the
    lone step's single C call (models/decode_stack.py) time its own matmuls and attention."""
    import ctypes

    from nbserve.execution import formats, holders, linear, quant
    from nbserve.execution.decode_stack import DecodeStack
    from nbserve.models import attention as llama

    DecodeStack.spent = (ctypes.c_double * 2)()

    quant.KernelLinear.__call__ = timed("matmul", quant.KernelLinear.__call__)  # type: ignore
    linear.PackedCopy.__call__ = timed("matmul", linear.PackedCopy.__call__)  # type: ignore
    linear.HalfCopy.__call__ = timed("matmul", linear.HalfCopy.__call__)  # type: ignore
    split = timed("matmul", linear.split_linear)
    formats.split_linear = holders.split_linear = split  # where the forms and holders call it
    for name in ("paged_lone_attention", "paged_decode_step"):
        setattr(llama, name, timed("attention", getattr(llama, name)))
    llama.Attention._decode_attention = timed(  # type: ignore[method-assign]
        "attention", llama.Attention._decode_attention)


def absorb() -> None:
    """Move the lone stack's own timings into SPENT."""
    from nbserve.execution.decode_stack import DecodeStack

    if DecodeStack.spent is not None:
        SPENT["matmul"] += DecodeStack.spent[0]
        SPENT["attention"] += DecodeStack.spent[1]
        DecodeStack.spent[0] = DecodeStack.spent[1] = 0.0


def split_one(engine: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    """ms per decode step of each part, over the steps in which every stream decodes (all
    prompts prefilled, none done): each step's figures are taken at its own end, in the
    engine's thread, so no prefill step and no part of one falls into the window."""
    from nbserve.types import Request, SamplingParams

    stats = engine._step.stats
    steps: list[dict[str, float]] = []
    record = stats.record_step

    def record_and_split(total: float, model: float, sampling: float, decoded: int) -> None:
        record(total, model, sampling, decoded)
        absorb()
        steps.append({"decoded": decoded, "step": total, "model": model, "sampling": sampling,
                      "matmul": SPENT["matmul"], "attention": SPENT["attention"]})
        SPENT.clear()

    async def one(ids: list[int]) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        async for _ in engine.generate(Request(prompt_ids=ids, params=params)):
            pass

    async def run() -> None:
        await asyncio.gather(*[one(p) for p in prompts])

    stats.record_step = record_and_split
    try:
        asyncio.run(run())
    finally:
        del stats.record_step  # the class's method again
    window = [st for st in steps if st["decoded"] == len(prompts)]
    n = len(window)
    per = 1000.0 / max(n, 1)
    total = {key: sum(st[key] for st in window) * per
             for key in ("step", "model", "sampling", "matmul", "attention")}
    return {"steps": n, "step": total["step"], "matmul": total["matmul"],
            "attention": total["attention"],
            "rest of the model": total["model"] - total["matmul"] - total["attention"],
            "sampling": total["sampling"],
            "bookkeeping": total["step"] - total["model"] - total["sampling"]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default=None, help="nbserve's weights (default: the loader's)")
    ap.add_argument("--streams", default="1,16", help="comma-separated concurrent streams")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--no-stack", action="store_true",
                    help="run a lone step's layers one by one (no single C call)")
    args = ap.parse_args(argv)
    from engine_bench import chat_prompts
    from machine import cpu_line
    from serve_bench import kernel_line

    import nbserve
    from nbserve.engine import Engine

    print(cpu_line())
    print(kernel_line())
    instrument()
    loaded = nbserve.load(args.model, dtype=args.dtype)
    if args.no_stack:
        loaded.model.__dict__["_decode_stack"] = None
    levels = [int(x) for x in args.streams.split(",") if x.strip()]
    prompts = chat_prompts(loaded.tokenizer, loaded.template, max(levels))
    with Engine(loaded, max_batch=max(levels), max_context=1024, quiet=True) as engine:
        split_one(engine, prompts[:1], 16)  # warm-up: the thread tuner, the kernels' build
        print(f"\n{'streams':>7} {'steps':>5} {'step ms':>8} {'matmul':>8} {'attention':>9} "
              f"{'rest of model':>13} {'sampling':>8} {'bookkeeping':>11}  "
              "(ms per decode step)")
        for n in levels:
            r = split_one(engine, prompts[:n], args.max_tokens)
            print(f"{n:>7} {r['steps']:>5.0f} {r['step']:>8.2f} {r['matmul']:>8.2f} "
                  f"{r['attention']:>9.2f} {r['rest of the model']:>13.2f} "
                  f"{r['sampling']:>8.2f} {r['bookkeeping']:>11.2f}",
                  flush=True)
            outside = r["step"] - r["matmul"]
            print(f"{'':>7} outside the matmuls: {outside:.2f} ms "
                  f"({outside / r['step']:.0%} of the step)", flush=True)


if __name__ == "__main__":
    main()
