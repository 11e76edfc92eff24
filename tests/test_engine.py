"""The engine: batching does not change results, cancellation frees slots, prefix reuse, sampling,
stop conditions, errors. Uses the tiny random Llama from conftest."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest
import torch
from tiny_models import utf8_cut

from nbserve.engine import Engine
from nbserve.loading.hf_dir import load_hf_dir
from nbserve.types import (
    BusyError,
    ContextLengthError,
    Delta,
    ErrorEvent,
    Finished,
    InvalidRequestError,
    Request,
    SamplingParams,
    Started,
)

PROMPTS = ["Hello there", "The cat sat on the mat and then",
           "a", "Numbers: 1 2 3 4 5 6 7 8 9 10 11 12 13 14", "Why is the sky blue?",
           "def add(a, b):", "Bonjour, comment", "One more prompt of a middling length here"]


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir):
    return load_hf_dir(tiny_llama_dir)


@pytest.fixture
def engine(loaded):
    eng = Engine(loaded, max_batch=8, max_context=256, prefill_chunk=16)
    yield eng
    eng.close()


def run(engine: Engine, request: Request) -> dict:
    """Collect a request's events through the sync iterator."""
    out: dict = {"text": {}, "ids": {}, "finish": {}, "events": []}
    for ev in engine.stream(request):
        out["events"].append(ev)
        if isinstance(ev, Delta):
            out["text"][ev.index] = out["text"].get(ev.index, "") + ev.text
            out["ids"].setdefault(ev.index, []).extend(ev.token_ids)
        elif isinstance(ev, Finished):
            out["finish"][ev.index] = ev.reason
            out["usage"] = ev.usage
        elif isinstance(ev, ErrorEvent):
            out["error"] = ev
    return out


async def collect(engine: Engine, request: Request) -> dict:
    ids: list[int] = []
    text = ""
    async for ev in engine.generate(request):
        if isinstance(ev, Delta):
            ids += ev.token_ids
            text += ev.text
    return {"ids": ids, "text": text}


def naive_greedy(loaded, prompt_ids: list[int], n: int) -> list[int]:
    """Reference: recompute the whole sequence each step, no engine, no batching."""
    model = loaded.model
    ids = list(prompt_ids)
    out = []
    for _ in range(n):
        cache = model.make_cache(1, 256)
        x = torch.tensor([ids])
        logits = model.forward(x, torch.arange(len(ids))[None], torch.tensor([0]), cache)
        tok = int(logits[0, -1].argmax())
        out.append(tok)
        ids.append(tok)
    return out


def greedy(max_tokens=24, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def test_batch_of_one_equals_naive_loop(engine, loaded):
    ids = loaded.tokenizer.encode(PROMPTS[1])
    res = run(engine, Request(prompt_ids=ids, params=greedy(16)))
    assert res["ids"][0] == naive_greedy(loaded, ids, 16)
    assert res["finish"][0] == "length"


async def test_eight_concurrent_equal_each_alone_greedy_and_seeded(engine):
    for params in (lambda: greedy(20), lambda: SamplingParams(temperature=1.0, seed=7,
                                                                max_tokens=20, ignore_eos=True)):
        alone = [await collect(engine, Request(prompt=p, params=params())) for p in PROMPTS]
        together = await asyncio.gather(*[collect(engine, Request(prompt=p, params=params()))
                                          for p in PROMPTS])
        assert [a["ids"] for a in alone] == [t["ids"] for t in together]
        assert all(len(a["ids"]) == 20 for a in alone)


async def test_cancel_mid_stream_frees_slot_and_others_finish(engine):
    async def cancelled():
        agen = engine.generate(Request(prompt="cancel me", params=greedy(200)))
        n = 0
        async for ev in agen:
            n += isinstance(ev, Delta)
            if n == 3:
                break
        await agen.aclose()

    others = [collect(engine, Request(prompt=p, params=greedy(30))) for p in PROMPTS[:3]]
    results = await asyncio.gather(cancelled(), *others)
    assert all(len(r["ids"]) == 30 for r in results[1:])
    for _ in range(50):
        if engine.stats()["running"] == 0:
            break
        await asyncio.sleep(0.02)
    st = engine.stats()
    assert st["running"] == 0 and st["slots_used"] == 0
    assert st["requests_finished"].get("cancelled") == 1


async def test_hundred_random_cancellations_leave_nothing_behind(engine):
    threads_before = threading.active_count()
    rng = random.Random(0)

    async def one(i: int):
        stop_after = rng.randint(0, 6)
        agen = engine.generate(Request(prompt=PROMPTS[i % 8], params=greedy(40)))
        seen = 0
        async for ev in agen:
            if isinstance(ev, Delta):
                seen += 1
            if seen >= stop_after:
                break
        await agen.aclose()

    async def cancel_task(i: int):  # cancelling the task is also a cancellation
        task = asyncio.create_task(collect(engine, Request(prompt=PROMPTS[i % 8],
                                                           params=greedy(40))))
        await asyncio.sleep(rng.random() * 0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    await asyncio.gather(*[one(i) if i % 2 else cancel_task(i) for i in range(100)])
    for _ in range(100):
        st = engine.stats()
        if st["running"] == 0 and st["waiting"] == 0:
            break
        await asyncio.sleep(0.02)
    assert st["running"] == 0 and st["waiting"] == 0 and st["slots_used"] == 0
    assert threading.active_count() == threads_before
    # still serves
    assert len((await collect(engine, Request(prompt="after", params=greedy(5))))["ids"]) == 5


def test_prefix_reuse_prefills_only_new_tokens_and_keeps_output(loaded):
    conv = [{"role": "user", "content": "Hi, who are you?"}]
    with Engine(loaded, max_batch=2, max_context=256) as eng:
        first = run(eng, Request(messages=conv, params=greedy(12)))
        conv2 = conv + [{"role": "assistant", "content": first["text"][0]},
                        {"role": "user", "content": "Tell me more."}]
        before = eng.stats()["tokens_prefilled"]
        second = run(eng, Request(messages=conv2, params=greedy(12)))
        started = second["events"][0]
        prefilled = eng.stats()["tokens_prefilled"] - before
        assert second["usage"].cached_tokens > 0
        assert prefilled == started.prompt_tokens - second["usage"].cached_tokens
        assert eng.stats()["tokens_reused"] == second["usage"].cached_tokens
    with Engine(loaded, max_batch=2, max_context=256) as fresh:
        cold = run(fresh, Request(messages=conv2, params=greedy(12)))
        assert cold["usage"].cached_tokens == 0
    assert cold["ids"] == second["ids"]


@pytest.mark.parametrize("block_size", [16, 32])
def test_prompts_sharing_a_short_system_prefix_reuse_all_of_it(loaded, block_size):
    """Two chats whose prompts share only a template's system prefix (about 26 tokens for
    SmolLM2's), which ends inside a KV block: the second reuses every shared token (the whole
    blocks shared, the rest copied from the first one's block), whatever the block size, and
    decodes what it would from scratch."""
    shared = loaded.tokenizer.encode(" ".join(["system"] * 30))[:26]
    first, second = shared + [5, 6, 7, 8], shared + [9, 10, 11]
    with Engine(loaded, max_batch=2, max_context=256, kv_block_size=block_size) as eng:
        run(eng, Request(prompt_ids=first, params=greedy(4)))
        again = run(eng, Request(prompt_ids=second, params=greedy(6)))
        assert eng.stats()["tokens_reused"] == 26
    assert again["usage"].cached_tokens == 26
    assert again["ids"][0] == naive_greedy(loaded, second, 6)


def test_the_next_turn_of_a_chat_reuses_the_whole_conversation(loaded):
    """A turn's prompt is the last one's prompt and answer and more: every position the last
    turn computed is reused (its partly filled last block copied), not only whole blocks."""
    prompt = loaded.tokenizer.encode(" ".join(["turn"] * 12))[:10]
    with Engine(loaded, max_batch=2, max_context=256) as eng:
        answer = run(eng, Request(prompt_ids=prompt, params=greedy(5)))["ids"][0]
        follow = prompt + answer + [7, 8, 9]
        nxt = run(eng, Request(prompt_ids=follow, params=greedy(6)))
    # all but the answer's last token, which was sampled and never fed back
    assert nxt["usage"].cached_tokens == len(prompt) + len(answer) - 1 == 14
    assert nxt["ids"][0] == naive_greedy(loaded, follow, 6)


def test_long_prompt_is_prefilled_in_chunks_while_others_decode(loaded):
    with Engine(loaded, max_batch=4, max_context=256, prefill_chunk=8) as eng:
        long_ids = loaded.tokenizer.encode(" ".join(["word"] * 150))[:150]
        ref = naive_greedy(loaded, long_ids, 5)
        res = run(eng, Request(prompt_ids=long_ids, params=greedy(5)))
        assert res["ids"][0] == ref
        assert eng.stats()["steps"] >= 150 // 8


def test_stop_string_spanning_tokens_is_not_emitted(engine, loaded):
    base = run(engine, Request(prompt="The cat", params=greedy(30)))
    ids = base["ids"][0]
    tok = loaded.tokenizer
    # a stop string made of the tail of token 5 and the head of token 6
    t5, t6 = tok.decode(ids[:6]), tok.decode(ids[:7])
    full = base["text"][0]
    assert len(t6) > len(t5) >= 2
    stop = t6[len(t5) - 1: len(t5) + 1]
    cut = full.index(stop)
    res = run(engine, Request(prompt="The cat", params=greedy(30, stop=[stop])))
    assert res["text"][0] == full[:cut]
    assert res["finish"][0] == "stop"
    assert res["events"][-1].stop_matched == stop


def test_deltas_concatenate_to_the_full_decode(engine, loaded):
    """...but for a character that max_tokens cut at the end: its bytes are dropped (the tiny
    byte-level BPE decodes the tokens' bytes as Python's "replace" does)."""
    tok, cuts = loaded.tokenizer, 0
    for seed in range(4):
        params = SamplingParams(temperature=1.5, seed=seed, max_tokens=40, ignore_eos=True)
        res = run(engine, Request(prompt="emoji 😀 and 中文", params=params))
        ids = res["ids"][0]
        raw = b"".join(tok.token_bytes(i) for i in ids)
        cut = utf8_cut(raw)
        cuts += bool(cut)
        assert res["text"][0] == (raw[:-cut].decode("utf-8", "replace") if cut
                                  else tok.decode(ids))
    assert cuts  # (seed 0 and 1 end inside a character)


def test_eos_stops_with_reason_stop(engine, loaded):
    eos = loaded.stop_token_ids[0]
    res = run(engine, Request(prompt="hi", params=SamplingParams(
        temperature=0, max_tokens=10, logit_bias={eos: 100.0})))
    assert res["finish"][0] == "stop" and res["text"].get(0, "") == ""
    assert res["usage"].completion_tokens == 1


def test_sampling_parameters_take_effect(engine):
    def ids(**kw):
        return run(engine, Request(prompt="Once upon", params=SamplingParams(
            max_tokens=12, ignore_eos=True, **kw)))["ids"][0]

    g = ids(temperature=0)
    assert ids(temperature=1.0, top_k=1, seed=3) == g  # top_k=1 is greedy
    assert ids(temperature=0.8, seed=5) == ids(temperature=0.8, seed=5)
    assert ids(temperature=1.0, seed=5) != ids(temperature=1.0, seed=6)
    assert set(ids(temperature=0, logit_bias={42: 100.0})) == {42}
    assert 42 not in ids(temperature=2.0, seed=1, logit_bias={42: -100.0})
    rep = ids(temperature=0, repetition_penalty=1e6)
    assert len(set(rep)) == len(rep)  # no token repeats under an enormous penalty
    assert ids(temperature=0, frequency_penalty=2.0) != g or len(set(g)) == len(g)
    assert ids(temperature=1.0, top_p=1e-6, seed=9) == g  # nucleus of one token
    assert ids(temperature=1.0, min_p=1.0, seed=9) == g


def test_n_choices_share_one_prefill(engine):
    before = engine.stats()["tokens_prefilled"]
    res = run(engine, Request(prompt="Once upon a time", params=SamplingParams(
        n=3, temperature=1.0, seed=11, max_tokens=10, ignore_eos=True)))
    prompt_tokens = res["events"][0].prompt_tokens
    assert engine.stats()["tokens_prefilled"] - before == prompt_tokens
    assert sorted(res["finish"]) == [0, 1, 2]
    assert len({tuple(v) for v in res["ids"].values()}) == 3
    assert res["usage"].completion_tokens == 30


def test_logprobs_match_log_softmax(engine, loaded):
    prompt_ids = loaded.tokenizer.encode("The cat")
    res = run(engine, Request(prompt_ids=prompt_ids, params=greedy(4, logprobs=True,
                                                                    top_logprobs=5)))
    lps = [lp for ev in res["events"] if isinstance(ev, Delta) for lp in ev.logprobs]
    seq = prompt_ids + res["ids"][0]
    model = loaded.model
    logits = model.forward(torch.tensor([seq]), torch.arange(len(seq))[None],
                           torch.tensor([0]), model.make_cache(1, 256))[0]
    ref = torch.log_softmax(logits, -1)
    for i, lp in enumerate(lps):
        row = ref[len(prompt_ids) - 1 + i]
        assert lp.token_id == res["ids"][0][i]
        assert abs(lp.logprob - float(row[lp.token_id])) < 1e-4
        top_ids = [t[0] for t in lp.top]
        assert top_ids == row.topk(5).indices.tolist()
        assert lp.token == loaded.tokenizer.decode([lp.token_id])


def test_context_full_finishes_with_length(loaded):
    with Engine(loaded, max_batch=2, max_context=32) as eng:
        res = run(eng, Request(prompt_ids=list(range(3, 23)), params=SamplingParams(
            temperature=0, max_tokens=None, ignore_eos=True)))
        assert res["finish"][0] == "length"
        assert len(res["ids"][0]) == 32 - 20


def test_errors_are_clear_and_raised_before_queueing(engine):
    with pytest.raises(ContextLengthError, match="256.*300|300.*256"):
        run(engine, Request(prompt_ids=[5] * 300, params=greedy(4)))
    for params, name in [(dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"),
                         (dict(max_tokens=0), "max_tokens"), (dict(n=0), "n"),
                         (dict(top_logprobs=21), "top_logprobs"),
                         (dict(logit_bias={10**9: 1.0}), "logit_bias"), (dict(n=9), "n")]:
        with pytest.raises(InvalidRequestError) as exc:
            run(engine, Request(prompt="x", params=SamplingParams(**params)))
        assert exc.value.param == name and name in str(exc.value)
    with pytest.raises(InvalidRequestError, match="exactly one"):
        run(engine, Request(prompt="x", messages=[{"role": "user", "content": "y"}]))
    assert engine.stats()["running"] == 0 and engine.stats()["waiting"] == 0


def test_full_queue_refuses_at_once(loaded):
    with Engine(loaded, max_batch=1, max_context=256, max_queue=1) as eng:
        long = [eng.stream(Request(prompt="p0", params=greedy(200)))]
        next(long[0])  # started: running
        long.append(eng.stream(Request(prompt="p1", params=greedy(200))))
        # the second waits: the queue (max_queue=1) is full
        t0 = time.perf_counter()
        with pytest.raises(BusyError):
            eng.stream(Request(prompt="third", params=greedy(5)))
        assert time.perf_counter() - t0 < 1.0
        for g in long:
            g.close()


class FlakyModel:
    """Wraps a StepModel; raises on the forward calls listed in `fail_on`."""

    def __init__(self, inner, fail_on: set[int]):
        self.inner, self.fail_on, self.calls = inner, fail_on, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward(self, *args, **kwargs):
        self.calls += 1
        if self.calls in self.fail_on:
            raise RuntimeError("injected fault")
        return self.inner.forward(*args, **kwargs)


def test_model_exception_fails_that_step_and_engine_keeps_serving(loaded):
    import dataclasses

    flaky = dataclasses.replace(loaded, model=FlakyModel(loaded.model, {3}))
    threads = threading.active_count()
    with Engine(flaky, max_batch=4, max_context=256) as eng:
        res = run(eng, Request(prompt="boom", params=greedy(10)))
        assert "injected fault" in res["error"].message
        assert eng.stats()["running"] == 0 and eng.stats()["slots_used"] == 0
        ok = run(eng, Request(prompt="fine", params=greedy(10)))
        assert len(ok["ids"][0]) == 10 and "error" not in ok
        assert eng.stats()["model_errors"] == 1
    assert threading.active_count() == threads


def test_sync_helpers_and_stats(engine):
    text = engine.complete("Hello", temperature=0, max_tokens=8, ignore_eos=True)
    assert isinstance(text, str) and text
    reply = engine.chat("Hi!", temperature=0, max_tokens=8)
    assert isinstance(reply, str)
    st = engine.stats()
    for key in ("running", "waiting", "slots_used", "tokens_prefilled", "tokens_decoded",
                "tokens_reused", "ttft_s", "itl_s", "step_time_s"):
        assert key in st
    assert st["ttft_s"]["p50"] > 0 and st["tokens_decoded"] > 0


def test_started_event_comes_first_and_finished_carries_per_request_timing(engine):
    events = run(engine, Request(prompt="x", params=greedy(3)))["events"]
    assert isinstance(events[0], Started) and events[0].cached_tokens == 0
    fin = events[-1]
    assert isinstance(fin, Finished)
    assert 0 < fin.ttft_s < 10 and 0 < fin.itl_s < fin.ttft_s + 10


class NoPaddingModel:
    """A StepModel that does not declare `accepts_padded_rows`: it must never get prefill rows
    of different real lengths in one forward (it raises if it gets several prefill rows)."""

    def __init__(self, inner):
        self.inner = inner
        for name in ("max_context", "vocab_size", "device", "dtype"):
            setattr(self, name, getattr(inner, name))

    def make_cache(self, max_batch, max_context):
        return self.inner.make_cache(max_batch, max_context)

    def forward(self, ids, positions, slots, cache, logit_index=None):
        if ids.shape[0] > 1 and ids.shape[1] > 1:
            raise RuntimeError("got padded prefill rows")
        return self.inner.forward(ids, positions, slots, cache, logit_index)


def test_models_without_padding_support_get_prefills_one_by_one(loaded):
    import dataclasses

    plain = dataclasses.replace(loaded, model=NoPaddingModel(loaded.model))
    with Engine(plain, max_batch=4, max_context=256, quiet=True) as eng:
        with eng._lock:  # hold the engine thread so that all four arrive in one step
            streams = [eng.stream(Request(prompt_ids=list(range(10, 10 + n)), params=greedy(4)))
                       for n in (10, 11, 12, 11)]  # near-equal lengths: worth batching
        results = [list(s) for s in streams]
    assert all(not any(isinstance(ev, ErrorEvent) for ev in r) for r in results)
