"""The same answers on a GPU: the tiny Llama in bfloat16 on CUDA against float32 on the CPU, an
engine batch of 8 against each request alone, and a pool on cuda:0 sized from free memory.

Skipped without CUDA; `benchmarks/gpu_check.sh` runs it on a lent GPU machine. bfloat16 keeps
about 3 significant digits, so greedy picks may differ where the two best tokens nearly tie:
a difference is accepted only at such a near-tie.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from nbserve.engine import Engine
from nbserve.engine.config import PAGED_MAX_BATCH
from nbserve.loading.hf_dir import load_hf_dir
from nbserve.pool import Pool
from nbserve.types import Delta, Finished, Request, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPTS = ["Hello there", "The cat sat on the mat and then", "a",
           "Numbers: 1 2 3 4 5 6 7 8 9 10 11 12 13 14", "Why is the sky blue?",
           "def add(a, b):", "Bonjour, comment", "One more prompt of a middling length here"]
NEAR_TIE = 0.1  # logprob gap between the two best tokens under which bf16 may flip the pick


@pytest.fixture(scope="module")
def cpu32(tiny_llama_dir):
    return load_hf_dir(tiny_llama_dir)


@pytest.fixture(scope="module")
def gpu16(tiny_llama_dir):
    return load_hf_dir(tiny_llama_dir, device="cuda", dtype=torch.bfloat16)


def greedy(max_tokens: int = 20) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          logprobs=True, top_logprobs=2)


async def collect(backend, request: Request) -> list:
    """[(token id, logprob gap to the runner-up)] of choice 0."""
    out = []
    async for ev in backend.generate(request):
        if isinstance(ev, Delta) and ev.index == 0:
            for tok, lp in zip(ev.token_ids, ev.logprobs or [None] * len(ev.token_ids)):
                gap = lp.top[0][2] - lp.top[1][2] if lp is not None and len(lp.top) > 1 else 0.0
                out.append((tok, gap))
        assert not isinstance(ev, Finished) or ev.reason == "length"
    return out


def assert_same_or_near_tie(ref: list, got: list, label: str) -> None:
    ref_ids, got_ids = [t for t, _ in ref], [t for t, _ in got]
    assert len(ref_ids) == len(got_ids), label
    for i, (a, b) in enumerate(zip(ref_ids, got_ids)):
        if a != b:  # after the first difference the continuations legitimately diverge
            assert ref[i][1] < NEAR_TIE, f"{label}: token {i} differs ({a} vs {b}) although " \
                                         f"the logprob gap was {ref[i][1]:.3f}"
            return


def forward_all(loaded, ids: list[int]) -> torch.Tensor:
    model = loaded.model
    dev = model.device
    cache = model.make_cache(1, 256)
    logits = model.forward(torch.tensor([ids], device=dev),
                           torch.arange(len(ids), device=dev)[None],
                           torch.tensor([0], device=dev), cache)
    return logits[0].float().cpu()  # (T, V)


def test_bf16_on_cuda_matches_float32_on_cpu(cpu32, gpu16):
    assert gpu16.model.device.type == "cuda" and gpu16.model.dtype == torch.bfloat16
    for text in PROMPTS + ["The quick brown fox jumps over the lazy dog. " * 6]:
        ids = cpu32.tokenizer.encode(text)
        ref, got = forward_all(cpu32, ids), forward_all(gpu16, ids)
        err, scale = (ref - got).abs().max().item(), ref.abs().max().item()
        assert err <= 0.05 * scale, f"{text!r}: max |diff| {err:.4f} vs logit scale {scale:.3f}"
        probs_err = (ref.softmax(-1) - got.softmax(-1)).abs().max().item()
        assert probs_err < 0.02, f"{text!r}: probabilities differ by {probs_err:.4f}"
        # where the top-1 differs, bf16's pick must be nearly as likely under float32
        picked = ref.gather(-1, got.argmax(-1, keepdim=True))[:, 0]
        deficit = (ref.max(-1).values - picked).max().item()
        assert deficit < NEAR_TIE, f"{text!r}: bf16's top-1 is {deficit:.3f} below float32's"


def test_engine_batch_of_eight_equals_each_alone_on_cuda(gpu16):
    with Engine(gpu16, max_batch=8, max_context=256, prefill_chunk=16, quiet=True) as eng:
        async def main():
            alone = [await collect(eng, Request(prompt=p, params=greedy())) for p in PROMPTS]
            together = await asyncio.gather(*[collect(eng, Request(prompt=p, params=greedy()))
                                              for p in PROMPTS])
            return alone, together

        alone, together = asyncio.run(main())
    for p, a, t in zip(PROMPTS, alone, together):
        assert_same_or_near_tie(a, t, p)


def test_pool_on_cuda0_sizes_its_cache_and_matches_the_engine(gpu16, tiny_llama_dir, capsys):
    with Engine(gpu16, max_batch=4, max_context=256, quiet=True) as eng:
        ref = [asyncio.run(collect(eng, Request(prompt=p, params=greedy()))) for p in PROMPTS]
    with Pool(str(tiny_llama_dir), devices=["cuda:0"], max_context=256) as pool:
        assert "KV cache" in capsys.readouterr().out  # the sizes are printed
        rep = pool.stats()["replicas"][0]
        # a paged cache: the engine's default running sequences, and blocks for all of them
        # at the longest context (the default budget, capped so)
        assert rep["device"] == "cuda:0" and rep["slots_total"] == PAGED_MAX_BATCH
        st = pool.engines[0].stats()
        assert st["kv_blocks_total"] * st["kv_block_size"] >= PAGED_MAX_BATCH * 256
        assert pool.engines[0].model.dtype == torch.bfloat16

        async def main():
            return await asyncio.gather(*[collect(pool, Request(prompt=p, params=greedy()))
                                          for p in PROMPTS])

        for p, a, t in zip(PROMPTS, ref, asyncio.run(main())):
            assert_same_or_near_tie(a, t, p)
        assert pool.health()["ready"]


def test_two_replicas_on_one_gpu_share_weights_and_split_memory(gpu16, cpu32):
    with Pool(gpu16, devices=["cuda:0", "cuda:0"], max_context=256, quiet=True) as pool:
        a, b = pool.engines
        assert a.model is b.model and a.cache is not b.cache
        texts = [pool.complete(p, temperature=0, max_tokens=4, ignore_eos=True) for p in PROMPTS]
        assert len(texts) == 8
    # a CPU model given for a GPU device is copied there (float32 stays float32)
    with Pool(cpu32, devices=["cuda:0"], max_batch=4, max_context=256, quiet=True) as pool:
        model = pool.engines[0].model
        assert model.device.type == "cuda" and model.dtype == torch.float32
        assert cpu32.model.device.type == "cpu"
        ids = cpu32.tokenizer.encode(PROMPTS[1])
        diff = (forward_all(cpu32, ids) - forward_all(pool.engines[0].loaded, ids)).abs().max()
        assert diff < 1e-3


def test_bf16_logits_match_transformers_on_the_same_weights(gpu16, tiny_llama_dir):
    """nbserve's bfloat16 forward on CUDA against transformers' bfloat16 forward of the same
    checkpoint on the same GPU."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16).to("cuda")
    for text in PROMPTS:
        ids = gpu16.tokenizer.encode(text)
        with torch.no_grad():
            ref = hf.eval()(torch.tensor([ids], device="cuda")).logits[0].float().cpu()
        got = forward_all(gpu16, ids)
        err, scale = (ref - got).abs().max().item(), ref.abs().max().item()
        assert err <= 0.05 * scale, f"{text!r}: max |diff| {err:.4f} vs logit scale {scale:.3f}"
        assert (ref.softmax(-1) - got.softmax(-1)).abs().max().item() < 0.02, text


def _prefilled(model, prompts: list[list[int]], block_size: int = 16):
    per = 256 // block_size
    cache = model.make_paged_cache(per * len(prompts), block_size)
    tables = torch.arange(per * len(prompts), device="cuda").view(len(prompts), per)
    for i, ids in enumerate(prompts):
        model.forward(torch.tensor([ids], device="cuda"),
                      torch.arange(len(ids), device="cuda")[None], tables[i:i + 1], cache)
    return cache, tables


def test_cuda_graphs_replay_what_the_eager_static_step_computes(gpu16):
    """The captured decode steps (every bucket at start-up) replay the eager bucketed step's
    logits exactly, for a full and a padded batch and for one row."""
    from nbserve.execution.static_decode import StaticDecode

    model = gpu16.model
    prompts = [gpu16.tokenizer.encode(p) for p in PROMPTS[:5]]
    for rows in (5, 1, 4):
        sub = prompts[:rows]
        eager_cache, tables = _prefilled(model, sub)
        graph_cache, _ = _prefilled(model, sub)
        eager = StaticDecode(model, eager_cache, max_batch=8, max_context=256, capture=False)
        graphs = StaticDecode(model, graph_cache, max_batch=8, max_context=256, capture=True)
        assert graphs.captured and graphs.capture_error is None and not eager.captured
        ids = torch.tensor([[p[-1]] for p in sub], device="cuda")
        positions = torch.tensor([[len(p)] for p in sub], device="cuda")
        max_pos = int(positions.max())
        width = max_pos // 16 + 1
        a = eager(ids, positions, tables[:, :width], max_pos)
        b = graphs(ids, positions, tables[:, :width], max_pos)
        assert graphs.replays == 1 and torch.equal(a, b), rows
        for layer in range(len(eager_cache.k)):  # and the same keys and values written
            assert torch.equal(eager_cache.k[layer][:-1], graph_cache.k[layer][:-1])


def test_the_engine_decodes_through_cuda_graphs_by_default(gpu16):
    """On CUDA the engine captures its decode steps at start-up and replays them; the answers
    are the eager engine's (or differ only at a bfloat16 near-tie)."""
    results = {}
    for static in (None, False):
        with Engine(gpu16, max_batch=8, max_context=256, quiet=True,
                    static_decode=static) as eng:
            async def main():
                return await asyncio.gather(*[collect(eng, Request(prompt=p, params=greedy()))
                                              for p in PROMPTS])

            results[static] = asyncio.run(main())
            info = eng.static_decode
            if static is None:
                assert info is not None and info["graphs"] > 0 and info["replays"] > 0, info
            else:
                assert info is None
    for p, a, t in zip(PROMPTS, results[False], results[None]):
        assert_same_or_near_tie(a, t, p)
