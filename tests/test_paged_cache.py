"""The paged KV cache end to end, on the tiny random Llama: attention over scattered block
tables equals one forward over the whole sequence (prefill, chunked prefill, decode, a mixed
batch with a shared prefix, in torch and in the C kernels); the engine shares a system prompt's
blocks between users, preempts and recomputes without changing answers, refuses a request
larger than the whole budget with both numbers, lets small requests pass a big one without
starving it, and commits memory only for the blocks it uses."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from nbserve.engine import Engine
from nbserve.loading.hf_dir import load_hf_dir
from nbserve.types import (
    ContextLengthError,
    Delta,
    ErrorEvent,
    InvalidRequestError,
    Request,
    SamplingParams,
)


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir):
    return load_hf_dir(tiny_llama_dir)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def ids_of(engine: Engine, request: Request) -> list[int]:
    out: list[int] = []
    for ev in engine.stream(request):
        assert not isinstance(ev, ErrorEvent), ev.message
        if isinstance(ev, Delta):
            out += ev.token_ids
    return out


async def ids_async(engine: Engine, request: Request) -> list[int]:
    out: list[int] = []
    async for ev in engine.generate(request):
        assert not isinstance(ev, ErrorEvent), ev.message
        if isinstance(ev, Delta):
            out += ev.token_ids
    return out


def full_logits(model, ids: list[int]) -> torch.Tensor:
    """Logits at every position from one forward over the whole sequence (a fresh cache)."""
    cache = model.make_cache(1, len(ids) + 1)
    return model.forward(torch.tensor([ids]), torch.arange(len(ids))[None], torch.tensor([0]),
                         cache)[0]


# ----------------------------------------------------------------------------- the model


@pytest.fixture(params=["1", "0"], ids=["C-kernels", "torch"])
def model(request, tiny_llama_dir, monkeypatch):
    """The tiny Llama with nbserve's C kernels (the paged-attention kernels), or without."""
    import nbserve

    monkeypatch.setenv("NBSERVE_KERNELS", request.param)
    return nbserve.load(str(tiny_llama_dir), verbose=False).model


def test_scattered_blocks_chunked_prefill_and_decode_equal_one_whole_forward(model):
    rng = random.Random(0)
    seq = [rng.randrange(model.vocab_size) for _ in range(45)]
    want = full_logits(model, seq)
    bs = 4
    cache = model.make_paged_cache(40, bs)
    table = rng.sample(range(40), 12)  # 12 blocks in no order: positions 0..47
    tables = torch.tensor([table])
    got = []
    for start in range(0, 30, 7):  # chunked prefill of 7 (chunks end mid-block)
        chunk = seq[start:min(start + 7, 30)]
        pos = torch.arange(start, start + len(chunk))[None]
        got.append(model.forward(torch.tensor([chunk]), pos, tables, cache)[0])
    for p in range(30, 45):  # decode, one token a step, through the lone step (max_pos given)
        got.append(model.forward(torch.tensor([[seq[p]]]), torch.tensor([[p]]), tables, cache,
                                 max_pos=p)[0])
    torch.testing.assert_close(torch.cat(got), want, rtol=1e-4, atol=1e-4)
    assert torch.equal(torch.cat(got).argmax(-1), want.argmax(-1))


def test_a_mixed_decode_batch_over_a_shared_prefix_equals_each_sequence_alone(model):
    rng = random.Random(1)
    prefix = [rng.randrange(model.vocab_size) for _ in range(16)]  # four full blocks of 4
    a = prefix + [rng.randrange(model.vocab_size) for _ in range(9)]
    b = prefix + [rng.randrange(model.vocab_size) for _ in range(3)]
    cache = model.make_paged_cache(32, 4)
    shared = [7, 3, 30, 12]
    ta, tb = shared + [5, 9, 21], shared + [14, 2]  # b reuses a's four prefix blocks
    model.forward(torch.tensor([a[:-1]]), torch.arange(len(a) - 1)[None],
                  torch.tensor([ta]), cache)
    before = [t[shared].clone() for t in cache.k]
    model.forward(torch.tensor([b[16:-1]]), torch.arange(16, len(b) - 1)[None],
                  torch.tensor([tb]), cache)  # only b's own tokens are prefilled
    assert all(torch.equal(t[shared], x) for t, x in zip(cache.k, before))  # never rewritten
    pad = cache.pad_block
    tables = torch.tensor([ta, tb + [pad]])
    positions = torch.tensor([[len(a) - 1], [len(b) - 1]])
    out = model.forward(torch.tensor([[a[-1]], [b[-1]]]), positions, tables, cache,
                        logit_index=torch.zeros(2, dtype=torch.long), max_pos=len(a) - 1)
    torch.testing.assert_close(out[0], full_logits(model, a)[-1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out[1], full_logits(model, b)[-1], rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- the engine


def test_sixteen_users_of_one_system_prompt_prefill_it_once(loaded):
    with Engine(loaded, max_batch=16, max_context=512, kv_block_size=16, quiet=True) as eng:
        system = eng.tokenizer.encode("You are a careful assistant. " * 20)[:200]
        questions = [eng.tokenizer.encode(f" Question {i}: what is {i} + {i}?") for i in
                     range(17)]
        ids_of(eng, Request(prompt_ids=system + questions[16], params=greedy(2)))  # seen once
        before = eng.stats()

        async def users() -> list[list[int]]:
            return await asyncio.gather(*[ids_async(eng, Request(
                prompt_ids=system + q, params=greedy(4))) for q in questions[:16]])

        answers = asyncio.run(users())
        after = eng.stats()
        prefilled = after["tokens_prefilled"] - before["tokens_prefilled"]
        reusable = len(system) // 16 * 16  # the system prompt's full blocks
        assert prefilled <= sum(len(system) - reusable + len(q) for q in questions[:16])
        assert after["prefix_cache_hits"] - before["prefix_cache_hits"] >= 16 * reusable
        assert after["kv_blocks_used"] == 0 and after["kv_blocks_cached"] > 0
        alone = [ids_of(eng, Request(prompt_ids=system + q, params=greedy(4)))
                 for q in questions[:3]]
        assert answers[:3] == alone


def test_sixteen_users_arriving_together_with_a_new_system_prompt_prefill_it_once(loaded):
    with Engine(loaded, max_batch=16, max_context=512, kv_block_size=16, prefill_chunk=64,
                quiet=True) as eng:
        system = eng.tokenizer.encode("Answer in one short line, politely. " * 20)[:200]
        questions = [eng.tokenizer.encode(f" Q{i}: name a colour.") for i in range(16)]

        async def users() -> list[list[int]]:
            return await asyncio.gather(*[ids_async(eng, Request(
                prompt_ids=system + q, params=greedy(3))) for q in questions])

        answers = asyncio.run(users())
        st = eng.stats()
        tail = len(system) % 16  # the system prompt's last, partial block: each user's own
        assert st["tokens_prefilled"] <= len(system) + sum(tail + len(q) for q in questions)
        assert st["prefix_cache_hits"] >= 15 * (len(system) - tail)
        assert answers[0] == ids_of(eng, Request(prompt_ids=system + questions[0],
                                                 params=greedy(3)))


def test_preemption_recomputes_and_keeps_every_answer(loaded):
    prompts = [loaded.tokenizer.encode(f"Story number {i} begins like this:") for i in range(6)]
    with Engine(loaded, max_batch=8, max_context=256, kv_block_size=8, quiet=True) as roomy:
        alone = [ids_of(roomy, Request(prompt_ids=p, params=greedy(40))) for p in prompts]
    per_token = loaded.model.kv_bytes_per_token()
    # 24 blocks of 8: room for about three of the six 50-token sequences at once
    with Engine(loaded, max_batch=8, max_context=160, kv_block_size=8,
                kv_memory=24 * 8 * per_token, quiet=True) as tight:

        async def together() -> list[list[int]]:
            return await asyncio.gather(*[ids_async(tight, Request(
                prompt_ids=p, params=greedy(40))) for p in prompts])

        assert asyncio.run(together()) == alone
        st = tight.stats()
        assert st["preemptions"] > 0 and st["kv_blocks_used"] == 0
        assert st["kv_blocks_total"] == 24


def test_a_request_larger_than_the_whole_budget_is_refused_with_both_numbers(loaded):
    per_token = loaded.model.kv_bytes_per_token()
    with Engine(loaded, kv_block_size=8, kv_memory=10 * 8 * per_token, quiet=True) as eng:
        assert eng.max_context == 80  # the blocks hold 80 tokens: the largest context
        assert "80 tokens each at most" in eng.describe_cache()
        with pytest.raises(ContextLengthError) as err:
            eng.stream(Request(prompt_ids=list(range(3, 103)), params=greedy(4)))
        message = str(err.value)
        assert "100 tokens" in message and "80 tokens" in message and "kv_memory" in message
        assert ids_of(eng, Request(prompt_ids=list(range(3, 43)), params=greedy(4)))  # healthy


def test_small_requests_pass_a_big_one_that_still_gets_its_turn(loaded):
    per_token = loaded.model.kv_bytes_per_token()
    with Engine(loaded, max_batch=8, max_context=128, kv_block_size=8,
                kv_memory=16 * 8 * per_token, quiet=True) as eng:
        hog = Request(prompt_ids=list(range(3, 60)), params=greedy(60))  # 8 blocks, then 15
        big = Request(prompt_ids=list(range(5, 100)), params=greedy(4))  # 13 blocks: not beside it
        smalls = [Request(prompt_ids=[7 + i, 8, 9], params=greedy(4)) for i in range(30)]
        order: list[str] = []

        async def go(request: Request, name: str, started: asyncio.Event | None = None) -> None:
            async for ev in eng.generate(request):
                assert not isinstance(ev, ErrorEvent), ev.message
                if started is not None and isinstance(ev, Delta):
                    started.set()
            order.append(name)

        async def scenario() -> None:
            running = asyncio.Event()
            first = asyncio.ensure_future(go(hog, "hog", running))
            await running.wait()  # the hog holds 8 of the 16 blocks from now until it ends
            tasks = [asyncio.ensure_future(go(big, "big"))]
            tasks += [asyncio.ensure_future(go(s, f"small{i}")) for i, s in enumerate(smalls)]
            await asyncio.gather(first, *tasks)

        asyncio.run(scenario())
        assert len(order) == 32 and "big" in order  # everyone served: the big one not starved
        assert order.index("small0") < order.index("hog") < order.index("big")  # passed it
        assert eng.stats()["kv_blocks_used"] == 0


def test_a_request_whose_choices_could_never_fit_is_refused(loaded):
    per_token = loaded.model.kv_bytes_per_token()
    with Engine(loaded, max_batch=8, kv_block_size=8, kv_memory=10 * 8 * per_token,
                quiet=True) as eng:
        prompt = list(range(3, 70))  # 67 tokens: 9 blocks with its first token, 1 more a choice
        assert ids_of(eng, Request(prompt_ids=prompt, params=greedy(2)))
        many = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, n=3)
        with pytest.raises(InvalidRequestError, match="11 KV blocks .* 10"):
            eng.stream(Request(prompt_ids=prompt, params=many))
        assert ids_of(eng, Request(prompt_ids=prompt[:20], params=greedy(2)))  # still serving


def test_n_choices_share_the_prompt_blocks(loaded):
    with Engine(loaded, max_batch=8, kv_block_size=4, quiet=True) as eng:
        prompt = list(range(3, 25))  # 22 tokens: five full blocks and a partial one
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, n=4)
        out: dict[int, list[int]] = {}
        for ev in eng.stream(Request(prompt_ids=prompt, params=params)):
            if isinstance(ev, Delta):
                out.setdefault(ev.index, []).extend(ev.token_ids)
        assert len({tuple(v) for v in out.values()}) == 1  # greedy: the same answer four times
        assert eng.stats()["tokens_prefilled"] == len(prompt)  # prefilled once for all four


def test_an_idle_engine_with_a_large_budget_holds_little_memory(loaded):
    def rss() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))

    before = rss()
    with Engine(loaded, kv_memory=2 * 2**30, quiet=True) as eng:  # 2 GiB of blocks
        assert eng.stats()["kv_cache_bytes"] > 1.9 * 2**30
        idle = rss() - before
        assert idle < 64 * 2**20, idle  # committed as blocks are written: none yet
        ids_of(eng, Request(prompt_ids=list(range(3, 40)), params=greedy(8)))
        assert rss() - before < 128 * 2**20


def test_gather_from_a_start_reads_only_those_positions() -> None:
    """`gather(..., start)`: positions start..length-1 (a sliding window's keys), equal to the
    same slice of a gather from 0, whatever the block boundaries."""
    from nbserve.execution.kv_cache import PagedKVCache

    cache = PagedKVCache(1, 12, 4, 2, 8, torch.device("cpu"), torch.float32)
    cache.k[0].copy_(torch.randn_like(cache.k[0]))
    cache.v[0].copy_(torch.randn_like(cache.v[0]))
    tables = torch.tensor([[5, 2, 9, 0, 7], [1, 3, 4, 6, 8]])
    for length in (1, 7, 8, 13, 20):
        full_k, full_v = cache.gather(0, tables, length)
        for start in range(length):
            k, v = cache.gather(0, tables, length, start)
            assert torch.equal(k, full_k[:, :, start:]) and torch.equal(v, full_v[:, :, start:])


def test_a_closed_engine_gives_its_cache_back_while_still_referenced(loaded):
    """A notebook keeps objects alive (its output history, a variable kept over `update()`):
    closing an engine must free its KV cache and static decode buffers all the same."""
    import gc
    import weakref

    eng = Engine(loaded, kv_memory=16 * 2**20, static_decode=True, quiet=True)
    ids_of(eng, Request(prompt_ids=list(range(3, 20)), params=greedy(4)))
    cache, static = weakref.ref(eng.cache), weakref.ref(eng._step.static)
    eng.close()
    gc.collect()
    assert cache() is None and static() is None  # `eng` itself is still referenced here
    assert eng.stats()["kv_cache_bytes"] == 0 and eng.health()["status"] == "stopped"
    with pytest.raises(Exception, match="not running"):
        ids_of(eng, Request(prompt_ids=[3, 4], params=greedy(2)))


def test_free_pages_returns_the_memory_of_freed_blocks_and_keeps_the_rest() -> None:
    """`free_pages`: the pages wholly inside the given runs of blocks go back to the system in
    every layer (the process's resident set falls, and they read back as zeros); the blocks
    outside the runs keep their keys and values, also those that share a page with a run."""
    from nbserve.execution.kv_cache import PagedKVCache

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    # 2 layers, blocks of 3 x 4 x 40 float32 = 1920 bytes: a page spans parts of 3 blocks
    cache = PagedKVCache(2, 40000, 4, 3, 40, torch.device("cpu"), torch.float32)
    assert cache.lazy and cache.page_reach == 3 and cache.nbytes > 290 * 2**20
    before = rss()
    for t in cache.k + cache.v:
        t[:cache.n_blocks].fill_(1.0)
    assert rss() - before > 280 * 2**20
    written = rss()
    given = cache.free_pages([(10, 20), (100, 39000)])
    assert given > 280 * 2**20
    assert written - rss() > 280 * 2**20  # the resident set fell by what was given back
    for t in cache.k + cache.v:
        assert t[10:20].sum() < t[10:20].numel()  # the pages inside the run are zeros
        assert (t[103:38997] == 0).all()  # (a page spans parts of 3 blocks)
        assert (t[:10] == 1).all() and (t[20:100] == 1).all() and (t[39000:-1] == 1).all()
    assert cache.free_pages([]) == 0
