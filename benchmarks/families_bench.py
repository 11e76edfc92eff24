"""Decode tokens/s of each native family on the engine against the path it had before (issue 18):
`TransformersAdapter` for a transformers model (each sequence runs alone through the model's own
cache) and `RecomputeAdapter` for a nanoGPT module (the whole sequence again for every token),
at 1 and 16 concurrent streams, in one run, on the same random weights.

The models are small random ones of each family's shape (hidden 256, 4 layers, 8 heads of 32,
4 kv heads, 640-token vocabulary, the family's options on: windows, softcaps, q/k norms...;
the mixture-of-experts ones 8 experts, top-2, of the tests' sizes; nanochat's GPT of
tests/nanochat_model.py against the same module recomputed),
so the figures measure the serving path, not a real model's quality. Greedy answers of the
native path are checked against the old path's (token for token, first stream).

    python benchmarks/families_bench.py            # every family (a few minutes on 2 cores)
    python benchmarks/families_bench.py --only qwen3,gpt2 --tokens 32
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the families' tiny configs and the tiny tokenizer

from family_models import CASES, save_family_dir  # noqa: E402
from machine import cpu_line  # noqa: E402
from moe_models import CASES as MOE_CASES  # noqa: E402
from moe_models import save_moe_dir  # noqa: E402

import nbserve  # noqa: E402
from nbserve.engine import Engine  # noqa: E402
from nbserve.models.adapters import RecomputeAdapter, TransformersAdapter  # noqa: E402
from nbserve.models.base import LoadedModel  # noqa: E402
from nbserve.types import Delta, Request, SamplingParams  # noqa: E402

SIZES = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, head_dim=32)
GPT2_SIZES = dict(n_embd=256, n_layer=4, n_head=8)
DEFAULT_CASES = ("qwen3", "gemma3", "gemma2", "phi4-mini", "olmo2", "smollm3", "mistral-window",
                 "gpt2", "qwen3-moe", "mixtral-window")
MOE_SIZES = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=4, head_dim=32)


def sized(case: str) -> None:
    """Scale the tiny test config of `case` up to the benchmark's sizes (in place); the
    mixture-of-experts ones keep their expert sizes (8 experts, top-2)."""
    if case in MOE_CASES:
        MOE_CASES[case][2].update(MOE_SIZES)
        return
    kwargs = CASES[case][2]
    kwargs.update(GPT2_SIZES if case == "gpt2" else SIZES)
    if "layer_types" in kwargs:  # keep the pattern, over the new layer count
        pattern = kwargs["layer_types"]
        layers = SIZES["num_hidden_layers"]
        kwargs["layer_types"] = [pattern[i % len(pattern)] for i in range(layers)]
    if "sliding_window" in kwargs:
        kwargs["sliding_window"] = 64  # answers pass it


def prompts(loaded: LoadedModel, n: int) -> list[list[int]]:
    words = "the moon bread rivers chess owls piano tea comets maps clocks whales".split()
    return [loaded.tokenizer.encode(" ".join(words[(i + j) % len(words)] for j in range(24)))
            for i in range(n)]


async def decode_rate(engine: Engine, batch: list[list[int]], tokens: int
                      ) -> tuple[float, list[int]]:
    """(output tokens/s over the wall time of all streams together, the first's tokens)."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)

    async def one(ids: list[int]) -> list[int]:
        out: list[int] = []
        async for ev in engine.generate(Request(prompt_ids=ids, params=params)):
            if isinstance(ev, Delta):
                out += ev.token_ids
        return out

    t0 = time.perf_counter()
    outs = await asyncio.gather(*[one(p) for p in batch])
    return sum(len(o) for o in outs) / (time.perf_counter() - t0), outs[0]


def measure(loaded: LoadedModel, tokens: int, streams: tuple[int, ...]) -> dict[int, Any]:
    out: dict[int, Any] = {}
    with Engine(loaded, max_batch=max(streams), max_context=256, quiet=True) as engine:
        asyncio.run(decode_rate(engine, prompts(loaded, 1), 8))  # warm-up
        for n in streams:
            out[n] = asyncio.run(decode_rate(engine, prompts(loaded, n), tokens))
    return out


def old_path(case: str, path: Path, native: LoadedModel) -> LoadedModel:
    """The same weights through the path the family had before: the transformers adapter."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    step = TransformersAdapter(hf, max_context=256, warn=False)
    return LoadedModel(model=step, tokenizer=native.tokenizer, template=native.template,
                       name=f"{case}-adapter", stop_token_ids=native.stop_token_ids)


def nanochat_pair() -> tuple[LoadedModel, LoadedModel]:
    """A nanochat GPT (tests/nanochat_model.py, the version nbserve follows): adopted natively,
    and through RecomputeAdapter."""
    from nanochat_model import tiny_gpt
    from test_nanochat import SPECIAL_TOKENS
    from tiny_models import make_tiny_tokenizer
    from tokenizers import AddedToken

    tok = make_tiny_tokenizer()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    module = tiny_gpt(tok.get_vocab_size(), sequence_len=256, n_layer=4, n_head=8, n_kv_head=4,
                      n_embd=256)
    native = nbserve.load(module, tokenizer=tok, verbose=False)
    step = RecomputeAdapter(module, max_context=256, warn=False)
    old = LoadedModel(model=step, tokenizer=native.tokenizer, template=native.template,
                      name="nanochat-recompute", stop_token_ids=native.stop_token_ids)
    return native, old


def nanogpt_pair(tokenizer: Any) -> tuple[LoadedModel, LoadedModel]:
    """A nanoGPT-named module: adopted natively, and through RecomputeAdapter."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_byo_model import NamedNanoGPT, NanoGPTConfig

    torch.manual_seed(0)
    module = NamedNanoGPT(NanoGPTConfig(block_size=256, n_layer=4, n_head=8, n_embd=256)).eval()
    native = nbserve.load(module, tokenizer=tokenizer, verbose=False)
    step = RecomputeAdapter(module, max_context=256, warn=False)
    old = LoadedModel(model=step, tokenizer=native.tokenizer, template=native.template,
                      name="nanogpt-recompute", stop_token_ids=native.stop_token_ids)
    return native, old


def row(name: str, new: dict[int, Any], old: dict[int, Any], streams: tuple[int, ...]) -> str:
    cells = []
    for n in streams:
        cells.append(f"{new[n][0]:8.1f} {old[n][0]:8.1f} {new[n][0] / old[n][0]:6.2f}x")
    same = "yes" if new[streams[0]][1] == old[streams[0]][1] else "NO"
    return f"{name:16s} " + "  ".join(cells) + f"   {same}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default=",".join((*DEFAULT_CASES, "nanogpt", "nanochat")))
    parser.add_argument("--tokens", type=int, default=48, help="tokens per stream")
    args = parser.parse_args()
    streams = (1, 16)
    print(cpu_line())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.tokens} tokens "
          "per stream, greedy; tokens/s: native (engine), old path, ratio")
    head = "  ".join(f"{f'{n} stream' + ('s' if n > 1 else ''):>26s}" for n in streams)
    print(f"{'family':16s} {head}   same answer")
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.only.split(","):
            if case == "nanogpt":
                from tiny_models import make_tiny_tokenizer
                native, old = nanogpt_pair(make_tiny_tokenizer())
            elif case == "nanochat":
                native, old = nanochat_pair()
            else:
                sized(case)
                save = save_moe_dir if case in MOE_CASES else save_family_dir
                path = save(case, Path(tmp) / case)
                native = nbserve.load(str(path), dtype="float32", verbose=False)
                old = old_path(case, path, native)
            new_figs = measure(native, args.tokens, streams)
            old_figs = measure(old, args.tokens, streams)
            print(row(case, new_figs, old_figs, streams), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
