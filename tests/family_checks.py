"""The checks every native family passes (tests/test_families.py, tests/test_moe.py): nbserve's
logits against transformers' own cached generation, a batch of 8 mixed-length requests against
each alone, and the engine's greedy answers batched against alone."""

from __future__ import annotations

import asyncio

import torch

from nbserve.engine import Engine
from nbserve.types import Delta, Request, SamplingParams

PROMPT_LEN, DECODE_STEPS = 24, 16  # the prompt passes the tests' windows (8) three times over
ENGINE_PROMPTS = ["Hello there", "The cat sat on the mat and then it slept for a while", "a",
                  "Numbers: 1 2 3 4 5 6 7 8 9 10 11 12", "Why is the sky blue?",
                  "def add(a, b):", "Bonjour, comment", "One more prompt of a middling length"]


def inputs(vocab: int, seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A PROMPT_LEN prompt (1, T) and DECODE_STEPS next tokens (1, 1), ids from 3 up."""
    gen = torch.Generator().manual_seed(seed)
    seq = torch.randint(3, vocab, (1, PROMPT_LEN), generator=gen)
    return seq, [torch.randint(3, vocab, (1, 1), generator=gen) for _ in range(DECODE_STEPS)]


def cached_reference(hf, seq: torch.Tensor, steps: list[torch.Tensor]) -> list[torch.Tensor]:
    """transformers' own cached generation: prefill logits, then one row per decode step."""
    with torch.no_grad():
        out = hf(seq, use_cache=True)
        refs, past = [out.logits[0]], out.cache
        for nxt in steps:
            out = hf(nxt, cache=past, use_cache=True)
            refs.append(out.logits[0])
            past = out.cache
    return refs


def check_steps(model, seq: torch.Tensor, steps: list[torch.Tensor],
                refs: list[torch.Tensor], where: str) -> None:
    """nbserve's prefill and decode steps (the lone-stream and the batched step) against
    `refs`, to 1e-4."""
    for lone in (True, False):
        cache = model.make_paged_cache(16, 8)
        table = torch.arange(16)[None]
        out = model.forward(seq, torch.arange(seq.shape[1])[None], table, cache)
        torch.testing.assert_close(out[0], refs[0], atol=1e-4, rtol=0)
        for i, nxt in enumerate(steps):
            pos = seq.shape[1] + i
            out = model.forward(nxt, torch.tensor([[pos]]), table, cache,
                                max_pos=pos if lone else None)
            at = f"{where} step {i} lone={lone}"
            torch.testing.assert_close(out[0], refs[i + 1], atol=1e-4, rtol=0,
                                       msg=lambda m, at=at: f"{at}: {m}")


def check_batch_equals_alone(model, where: str) -> None:
    """8 requests of mixed lengths prefilled alone, then 4 decode steps all together, equal
    to each request run alone."""
    gen = torch.Generator().manual_seed(2)
    lengths = [3, 30, 9, 17, 24, 5, 12, 40]
    prompts = [torch.randint(3, model.vocab_size, (1, n), generator=gen) for n in lengths]
    steps = torch.randint(3, model.vocab_size, (4, len(lengths), 1), generator=gen)
    blocks = 8  # blocks of 8 positions per sequence

    def run(rows: list[int]) -> list[torch.Tensor]:
        cache = model.make_paged_cache(blocks * len(rows), 8)
        tables = torch.arange(blocks * len(rows)).view(len(rows), blocks)
        for t, r in zip(tables, rows):
            model.forward(prompts[r], torch.arange(lengths[r])[None], t[None], cache)
        outs = []
        for s in range(steps.shape[0]):
            pos = torch.tensor([[lengths[r] + s] for r in rows])
            outs.append(model.forward(steps[s, rows], pos, tables, cache)[:, 0])
        return [torch.stack([o[i] for o in outs]) for i in range(len(rows))]

    together = run(list(range(len(lengths))))
    for r in range(len(lengths)):
        at = f"{where} row {r}"
        torch.testing.assert_close(together[r], run([r])[0], atol=1e-4, rtol=0,
                                   msg=lambda m, at=at: f"{at}: {m}")


def check_engine_batched_like_alone(loaded) -> None:
    """The engine's greedy answers to ENGINE_PROMPTS one at a time equal them all at once
    (chunked prefill of 8, prefixes reused the second time)."""
    params = dict(temperature=0.0, max_tokens=12, ignore_eos=True)

    async def collect(engine: Engine, prompt: str) -> list[int]:
        ids: list[int] = []
        async for ev in engine.generate(Request(prompt=prompt,
                                                params=SamplingParams(**params))):
            if isinstance(ev, Delta):
                ids += ev.token_ids
        return ids

    async def both(engine: Engine) -> tuple[list, list]:
        alone = [await collect(engine, p) for p in ENGINE_PROMPTS]
        together = await asyncio.gather(*[collect(engine, p) for p in ENGINE_PROMPTS])
        return alone, list(together)

    with Engine(loaded, max_batch=8, max_context=128, prefill_chunk=8, quiet=True) as engine:
        alone, together = asyncio.run(both(engine))
    assert alone == together
    assert all(len(a) == 12 for a in alone)
