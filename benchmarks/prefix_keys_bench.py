"""Prefix-cache block keys (issue 40): the keyed 128-bit BLAKE2b key (`engine/prefix_keys.py`)
beside Python's hash() of (parent key, tokens), which it replaced.

Prints: microseconds to key one block of 16 tokens; microseconds to find a cached prompt of
2,048 tokens (128 blocks, `BlockSpace.cached_prefix`, what admission does for each waiting
request); and, in process on the default model (or --model), aggregate decode tokens/s of
--streams requests sharing a system prompt of about 300 tokens (output tokens over the wall
time of a round, its prefill included), with each key function in turn (rounds alternate, so
that a machine whose speed drifts weighs on both alike; the median of each), after a warm-up
round. Asserts nothing.

    python benchmarks/prefix_keys_bench.py            # ~2 minutes on 2 cores
    python benchmarks/prefix_keys_bench.py --rounds 1 --streams 4
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import timeit
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nbserve.engine import blocks  # noqa: E402
from nbserve.engine.prefix_keys import ROOT_KEY, block_key  # noqa: E402


def python_hash_key(parent: Any, tokens: Sequence[int]) -> Any:
    """The key before issue 40: Python's hash() of the parent key and the token tuple."""
    return hash((parent, tuple(tokens)))


KEYS: dict[str, Callable[[Any, Sequence[int]], Any]] = {
    "hash()": python_hash_key, "keyed BLAKE2b": block_key}


def per_block_us(key: Callable[[Any, Sequence[int]], Any]) -> float:
    tokens = tuple(range(1000, 1016))
    parent = key(ROOT_KEY, tokens)
    n = 100_000
    return min(timeit.repeat(lambda: key(parent, tokens), number=n, repeat=5)) / n * 1e6


def walk_us(key: Callable[[Any, Sequence[int]], Any]) -> float:
    """cached_prefix of a 2,048-token prompt whose 128 blocks are all cached."""
    blocks.block_key = key  # type: ignore[assignment]
    space = blocks.BlockSpace(256, 16)
    prompt = [(i * 7919) % 49152 for i in range(2049)]
    seq = SimpleNamespace(table=[], keyed=0, last_key=ROOT_KEY, copy=None)
    space.admit(seq, prompt, 2048)
    space.grow(seq, 2049)
    space.commit(seq, prompt, 2049)
    space.release(seq, prompt, keep=True)
    assert space.cached_prefix(prompt, 2048)[0] == 2048
    n = 500
    return min(timeit.repeat(lambda: space.cached_prefix(prompt, 2048), number=n,
                             repeat=5)) / n * 1e6


async def decode_round(engine: Any, prompts: list[list[int]], max_tokens: int) -> float:
    from nbserve.types import Delta, Request, SamplingParams

    async def one(ids: list[int]) -> int:
        n = 0
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        async for ev in engine.generate(Request(prompt_ids=ids, params=params)):
            if isinstance(ev, Delta):
                n += len(ev.token_ids)
        return n

    t0 = time.perf_counter()
    counts = await asyncio.gather(*[one(p) for p in prompts])
    return sum(counts) / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="decode rounds with each key")
    args = ap.parse_args(argv)

    print(f"{'key':<14} {'us per block':>12} {'us per 2,048-token lookup':>26}")
    for name, key in KEYS.items():
        print(f"{name:<14} {per_block_us(key):>12.2f} {walk_us(key):>26.1f}", flush=True)

    import nbserve
    from nbserve.engine import Engine

    loaded = nbserve.load(args.model, verbose=False)
    system = ("You are a patient assistant for a public library. " * 30).strip()
    questions = [f"Question {i}: what is a good book about the number {i}?"
                 for i in range(args.streams)]
    prompts = [loaded.tokenizer.encode(loaded.template.render(
        [{"role": "system", "content": system}, {"role": "user", "content": q}],
        add_generation_prompt=True)) for q in questions]
    print(f"\n{args.streams} streams, prompts of {len(prompts[0])} tokens sharing a system "
          f"prompt, {args.max_tokens} new tokens each; output tokens/s")
    figures: dict[str, list[float]] = {name: [] for name in KEYS}
    with Engine(loaded, max_batch=args.streams, max_context=1024, quiet=True) as engine:
        asyncio.run(decode_round(engine, prompts, args.max_tokens))  # warm-up: the tuner
        for _ in range(args.rounds):
            for name, key in KEYS.items():
                blocks.block_key = key  # type: ignore[assignment]
                figures[name].append(asyncio.run(decode_round(engine, prompts,
                                                              args.max_tokens)))
                print(f"  {name:<14} {figures[name][-1]:8.1f}", flush=True)
    blocks.block_key = block_key
    for name, runs in figures.items():
        print(f"{name:<14} median {statistics.median(runs):8.1f} tok/s over {len(runs)} rounds")


if __name__ == "__main__":
    main()
