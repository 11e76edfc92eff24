"""The cost of LoRA adapters per request (issue 44): in process, the default model (its GGUF
served from its blocks) with a random rank-16 adapter on all seven projections; decode
throughput at 1 and 16 streams with every request on the base, every request on the adapter,
and half on each (one mixed batch), the same prompts and lengths each time.

    python benchmarks/lora_bench.py [--model smollm2] [--tokens 64] [--rank 16]

Prints tok/s and the ratio to base-only per line; `benchmarks/README.md` keeps the runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from nbserve.engine import Engine
from nbserve.loading import load
from nbserve.types import Delta, Request, SamplingParams

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def random_adapter(out: Path, rank: int, layers: int,
                   shapes: dict[str, tuple[int, int]]) -> Path:
    """A PEFT adapter directory with random factors of `shapes` ((in, out) per target)."""
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for i in range(layers):
        for proj, (fan_in, fan_out) in shapes.items():
            part = "mlp" if proj in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{i}.{part}.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.02
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
        "target_modules": sorted(shapes), "fan_in_fan_out": False, "task_type": "CAUSAL_LM"}))
    return out


async def run(engine: Engine, streams: int, adapters: list[str | None], tokens: int) -> float:
    """Tokens per second of `streams` concurrent requests (request i on adapters[i % len])."""
    async def one(i: int) -> int:
        req = Request(prompt=f"Story {i}: once upon a time", adapter=adapters[i % len(adapters)],
                      params=SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
        n = 0
        async for ev in engine.generate(req):
            if isinstance(ev, Delta):
                n += len(ev.token_ids)
        return n

    start = time.perf_counter()
    counts = await asyncio.gather(*(one(i) for i in range(streams)))
    return sum(counts) / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    args = ap.parse_args()
    loaded = load(args.model, verbose=False)
    cfg = loaded.model.config  # the native decoder's (its shapes name the adapter's)
    h, inter = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    with tempfile.TemporaryDirectory() as tmp, Engine(loaded, max_batch=16, quiet=True) as eng:
        eng.add_adapter("a", str(random_adapter(Path(tmp) / "a", args.rank,
                                                cfg.num_hidden_layers, shapes)))
        print(f"{loaded.name}, rank {args.rank} on {len(TARGETS)} projections, "
              f"{args.tokens} tokens a request, {torch.get_num_threads()} threads")
        for streams in (1, 16):
            asyncio.run(run(eng, streams, [None], 8))  # warm
            base = asyncio.run(run(eng, streams, [None], args.tokens))
            for label, adapters in (("base only", [None]), ("adapter only", ["a"]),
                                    ("mixed (half each)", [None, "a"])):
                rate = base if label == "base only" else \
                    asyncio.run(run(eng, streams, adapters, args.tokens))
                print(f"{streams:2d} streams, {label:18s} {rate:7.1f} tok/s  "
                      f"{rate / base:.2f}x base")


if __name__ == "__main__":
    main()
