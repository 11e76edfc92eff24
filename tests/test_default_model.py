"""The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers on the same
file."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def ours():
    import nbserve

    return nbserve.load("smollm2", device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def reference(reference_tokenizer, reference_model):
    return reference_tokenizer, reference_model


def test_rendered_prompt_and_tokens_equal_transformers(ours, reference):
    tok, _ = reference
    text = ours.template.render(MESSAGES, add_generation_prompt=True)
    assert text == tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert ours.tokenizer.encode(text) == tok(text, add_special_tokens=False)["input_ids"]


def _greedy_reference(hf, ids: list[int]) -> list[int]:
    """transformers' greedy loop with its own cache, 32 tokens, end-of-turn not special."""
    out_ids = []
    with torch.no_grad():
        out = hf(torch.tensor([ids]), use_cache=True)
        for _ in range(32):
            nxt = int(out.logits[0, -1].argmax())
            out_ids.append(nxt)
            out = hf(torch.tensor([[nxt]]), past_key_values=out.past_key_values, use_cache=True)
    return out_ids


def _engine_greedy(loaded, ids: list[int]) -> tuple[list[int], torch.dtype]:
    """32 greedy tokens through the engine, and its KV cache's dtype."""
    from nbserve.engine import Engine
    from nbserve.types import Request, SamplingParams

    with Engine(loaded, max_batch=2, max_context=256, quiet=True) as eng:
        got = []
        for ev in eng.stream(Request(prompt_ids=ids, params=SamplingParams(
                temperature=0, max_tokens=32, ignore_eos=True))):
            got += getattr(ev, "token_ids", [])
        return got, eng.cache.dtype


def test_logits_match_and_32_greedy_tokens_identical(ours, reference):
    tok, hf = reference
    text = ours.template.render(MESSAGES, add_generation_prompt=True)
    ids = ours.tokenizer.encode(text)
    x = torch.tensor([ids])
    with torch.no_grad():
        ref_logits = hf(x).logits
    model = ours.model
    cache = model.make_cache(1, 256)
    logits = model.forward(x, torch.arange(len(ids))[None], torch.tensor([0]), cache)
    torch.testing.assert_close(logits, ref_logits, atol=1e-3, rtol=0)

    got, kv_dtype = _engine_greedy(ours, ids)
    assert got == _greedy_reference(hf, ids) and kv_dtype == torch.float32
    answer = ours.tokenizer.decode(got[:got.index(2)] if 2 in got else got)
    assert answer == "The capital of France is Paris."


def test_the_default_load_caches_float16_and_keeps_transformers_answer(reference,
                                                                       default_loaded):
    """`nbserve.load("smollm2")` (the run's shared load) serves from the GGUF's blocks (dtype
    "quantized"), and its engine's KV cache is float16 by default (`default_kv_dtype`): the
    greedy tokens stay transformers'."""
    _, hf = reference
    loaded = default_loaded
    ids = loaded.tokenizer.encode(loaded.template.render(MESSAGES, add_generation_prompt=True))
    got, kv_dtype = _engine_greedy(loaded, ids)
    assert loaded.model.weight_format == "quantized" and kv_dtype == torch.float16
    assert got == _greedy_reference(hf, ids)


def test_a_float16_kv_cache_keeps_the_greedy_answers(ours):
    """16-bit keys/values, measured: float16 keeps these answers identical to the float32
    cache; bfloat16 (7 bits of mantissa) changes some (benchmarks/README.md)."""
    from nbserve.engine import Engine
    from nbserve.types import Request, SamplingParams

    chats = ["What is 12 times 7?", "Give me a tip for learning Python.",
             "Write a haiku about the sea.", "Who wrote Hamlet?"]

    def answers(kv_dtype: str | None) -> list[list[int]]:
        with Engine(ours, max_batch=4, max_context=512, quiet=True, kv_dtype=kv_dtype) as eng:
            # all four submitted at once (stream() submits): they decode as one batch
            streams = [eng.stream(Request(messages=[{"role": "user", "content": chat}],
                                          params=SamplingParams(temperature=0, max_tokens=48)))
                       for chat in chats]
            out = [[t for ev in stream for t in getattr(ev, "token_ids", [])]
                   for stream in streams]
            assert eng.cache.dtype == (torch.float16 if kv_dtype else torch.float32)
            return out

    assert answers("float16") == answers(None)
