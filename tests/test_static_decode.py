"""Decode steps at bucketed shapes (nbserve/models/static_decode.py), the path CUDA graphs
capture: on CPU the same steps run eagerly, and must equal the dynamic decode path, logits to
float tolerance, greedy tokens identical, the cache's real blocks written the same. The
captured-against-eager comparison on CUDA is in tests/test_cuda.py."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from gguf_util import hf_dir_to_gguf
from kernel_paths import NEEDS_COMPILER

from nbserve.engine import Engine
from nbserve.engine.config import EngineConfig
from nbserve.execution.static_decode import StaticDecode, bucket, powers_of_two_up_to
from nbserve.loading import load
from nbserve.types import Delta, Request, SamplingParams


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    return load(str(tiny_llama_dir), verbose=False)


@pytest.fixture(scope="module")
def tiny_q4(tiny_llama_dir, tmp_path_factory):
    """The tiny llama as a Q4_1 GGUF, served from its blocks: its matmuls give a row the same
    result whatever the other rows of the step (up to 8 rows, the row kernels), so a step
    padded to a bucket computes the real rows exactly as the unpadded one."""
    path = hf_dir_to_gguf(tiny_llama_dir, tmp_path_factory.mktemp("q4") / "m.gguf", "Q4_1",
                          tensor_types={"token_embd.weight": "Q8_0"})
    return load(str(path), verbose=False)


def test_buckets_are_powers_of_two_ending_at_the_limit() -> None:
    assert powers_of_two_up_to(64) == [1, 2, 4, 8, 16, 32, 64]
    assert powers_of_two_up_to(48) == [1, 2, 4, 8, 16, 32, 48]
    assert powers_of_two_up_to(256, 8) == [8, 16, 32, 64, 128, 256]
    assert powers_of_two_up_to(3, 8) == [3]
    assert bucket(5, [1, 2, 4, 8]) == 8 and bucket(1, [1, 2]) == 1
    with pytest.raises(ValueError, match="past the largest bucket 8"):
        bucket(9, [1, 2, 4, 8])


def _prefilled(model, prompts: list[list[int]], block_size: int = 4):
    """A paged cache holding each prompt's keys and values in blocks of its own, and the
    block tables."""
    per = 40 // block_size
    cache = model.make_paged_cache(per * len(prompts), block_size, torch.float32)
    tables = torch.arange(per * len(prompts)).view(len(prompts), per)
    for i, ids in enumerate(prompts):
        model.forward(torch.tensor([ids]), torch.arange(len(ids))[None], tables[i:i + 1], cache)
    return cache, tables


@pytest.mark.parametrize("lengths", [(5, 17, 30), (5,), (30,)])
def test_a_bucketed_step_equals_the_dynamic_one(tiny, lengths) -> None:
    """Rows at positions 5, 17, 30 (bucket 4: one padded row), or one row alone (whose key
    mask is needed too: the length is rounded up past its position), blocks of 4 (a bucket
    of 8 blocks, 32 positions): the same logits as the dynamic decode step, the same keys and
    values written to the rows' blocks, and nothing written to any other real block."""
    model = tiny.model
    prompts = [list(range(3, 3 + n)) for n in lengths]
    cache, tables = _prefilled(model, prompts)
    twin, _ = _prefilled(model, prompts)  # the same values: a cache is not copyable (a map)
    rows = len(prompts)
    ids = torch.tensor([[9], [11], [13]])[:rows]
    positions = torch.tensor([[len(p)] for p in prompts])
    max_pos = int(positions.max())
    width = -(-(max_pos + 1) // cache.block_size)
    want = model.forward(ids, positions, tables[:, :width], cache,
                         logit_index=torch.zeros(rows, dtype=torch.long), max_pos=max_pos)
    static = StaticDecode(model, twin, max_batch=8, max_context=40, capture=False)
    got = static(ids, positions, tables[:, :width], max_pos)
    assert got.shape == want.shape == (rows, model.vocab_size)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for layer in range(len(cache.k)):
        real = slice(0, cache.n_blocks)  # every block but the pad block
        # up to rounding: the dynamic lone step attends in the C kernel, the bucketed one in
        # torch (layer 0's outputs differ in summation order, so do layer 1's inputs)
        torch.testing.assert_close(twin.k[layer][real], cache.k[layer][real], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(twin.v[layer][real], cache.v[layer][real], rtol=1e-5, atol=1e-6)
    assert static.describe()["steps"] == 1 and static.describe()["replays"] == 0


async def _answers(engine: Engine, prompts: list[list[int]], **params) -> list[list[int]]:
    import asyncio

    async def one(ids: list[int]) -> list[int]:
        out: list[int] = []
        async for ev in engine.generate(Request(prompt_ids=ids, params=SamplingParams(
                max_tokens=24, ignore_eos=True, **params))):
            if isinstance(ev, Delta):
                out += ev.token_ids
        return out

    return list(await asyncio.gather(*[one(p) for p in prompts]))


@NEEDS_COMPILER
def test_the_engine_decodes_the_same_tokens_through_static_steps(tiny_q4) -> None:
    """Five requests of mixed lengths decoding together (batch bucket 8, smaller ones as they
    arrive and finish; attention lengths crossing buckets as they grow): greedy tokens and
    seeded samples identical with static_decode on and off, and the static steps were taken.
    (A model whose matmuls round differently by row count, oneDNN's, can flip a near-tie
    between a padded step and an unpadded one: the quantized model's row kernels do not.)"""
    import asyncio

    prompts = [list(range(3, 3 + n)) for n in (2, 9, 17, 30, 5)]
    got = {}
    for on in (False, True):
        with Engine(tiny_q4, max_batch=8, max_context=128, kv_block_size=4,
                    kv_memory=1 << 22, kv_dtype="float32", quiet=True,
                    static_decode=on) as engine:
            greedy = asyncio.run(_answers(engine, prompts, temperature=0.0))
            sampled = asyncio.run(_answers(engine, prompts, temperature=0.9, seed=5))
            got[on] = (greedy, sampled)
            info = engine.static_decode
            if on:
                assert info is not None and info["steps"] > 20 and info["graphs"] == 0
                assert info["batch_buckets"] == [1, 2, 4, 8]
                assert info["length_buckets"] == [32, 64, 128]
            else:
                assert info is None
    assert got[True] == got[False]


def test_static_decode_is_off_on_cpu_unless_asked(tiny) -> None:
    with Engine(tiny, max_batch=2, max_context=64, quiet=True) as engine:
        assert engine.static_decode is None  # the C kernels serve CPU decode steps


def test_a_model_without_static_steps_says_so_and_decodes(tiny, caplog) -> None:
    """A one-row-per-sequence cache (a model without make_paged_cache) has no static steps:
    asked for them, the engine logs why and decodes as usual."""

    class RowsOnly:
        def __init__(self, inner):
            self._inner = inner
            self.max_context, self.vocab_size = inner.max_context, inner.vocab_size
            self.device, self.dtype = inner.device, inner.dtype

        def make_cache(self, max_batch, max_context):
            return self._inner.make_cache(max_batch, max_context)

        def forward(self, ids, positions, slots, cache, logit_index=None):
            return self._inner.forward(ids, positions, slots, cache, logit_index=logit_index)

    loaded = copy.copy(tiny)
    loaded.model = RowsOnly(tiny.model)
    with caplog.at_level(logging.WARNING, logger="nbserve.engine"), \
            Engine(loaded, max_batch=2, max_context=64, quiet=True,
                   static_decode=True) as engine:
        import asyncio

        assert engine.static_decode is None
        assert len(asyncio.run(_answers(engine, [[3, 4, 5]], temperature=0.0))[0]) == 24
    assert "has no static decode steps" in caplog.text


def test_static_decode_must_be_a_bool_or_none() -> None:
    with pytest.raises(ValueError, match="static_decode must be True, False or None"):
        EngineConfig(static_decode="yes")  # type: ignore[arg-type]


def test_only_buckets_that_exist_and_are_captured_where_graphs_are_run_static(tiny) -> None:
    """Past the largest buckets a step takes the dynamic path; where graphs are captured
    (CUDA), a bucket without one (too large to capture, or every bucket after a failed
    capture) does too, unpadded, instead of running padded eagerly."""
    cache, _ = _prefilled(tiny.model, [[3, 4, 5]])
    static = StaticDecode(tiny.model, cache, max_batch=4, max_context=40, capture=False)
    assert static.serves(4, 39, 10) and not static.serves(5, 3, 1)
    assert not static.serves(1, 40, 11)  # 41 positions: past the largest length bucket
    static.capturing = True  # as on CUDA, with no graph captured (a failed capture)
    assert not static.serves(1, 3, 1)
    static.graphs[1, static.block_buckets[0]] = (None, torch.zeros(1))
    assert static.serves(1, 3, 1) and not static.serves(2, 3, 1)
