"""The pool: two CPU replicas of the tiny Llama give the single engine's answers, share the load,
keep a conversation on the replica that holds its prefix, survive a replica that dies or whose
model raises, and leave no thread behind; over HTTP it keeps the engine's promises (max_backlog,
per-replica metrics). Plain `asyncio.run`, so no plugin is needed."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_util import (
    app_running,
    non_reading_stream,
    read_sse_data,
    small_send_buffers,
    wait_until,
)

from nbserve.engine import Engine
from nbserve.loading.hf_dir import load_hf_dir
from nbserve.pool import Pool
from nbserve.pool.setup import choose_kv_size, resolve_devices
from nbserve.types import (
    Delta,
    EngineStoppedError,
    ErrorEvent,
    Finished,
    InvalidRequestError,
    Request,
    SamplingParams,
    Started,
)

PROMPTS = [f"Prompt number {i}: tell me about {w}" for i, w in enumerate(
    ["cats", "the sea", "Paris", "numbers", "rain", "bicycles", "stars", "tea",
     "maps", "jazz", "rivers", "clocks", "bread", "snow", "owls", "glass"])]


def greedy(max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir):
    return load_hf_dir(tiny_llama_dir)


@pytest.fixture(scope="module")
def reference(loaded) -> dict[str, list[int]]:
    """Greedy outputs of each prompt from a single engine (batching does not change them:
    test_engine checks that)."""
    with Engine(loaded, max_batch=16, max_context=256, quiet=True) as eng:
        streams = [eng.stream(Request(prompt=p, params=greedy(24))) for p in PROMPTS]
        return {p: ids_of(list(s)) for p, s in zip(PROMPTS, streams)}


def make_pool(loaded, **kw: Any) -> Pool:
    opts = {"devices": ["cpu", "cpu"], "max_batch": 4, "max_context": 256, "prefill_chunk": 32,
            "quiet": True}
    return Pool(loaded, **{**opts, **kw})


def ids_of(events: list) -> list[int]:
    return [t for ev in events if isinstance(ev, Delta) and ev.index == 0 for t in ev.token_ids]


async def collect(pool: Pool, request: Request, on_event=None) -> list:
    events = []
    async for ev in pool.generate(request):
        events.append(ev)
        if on_event is not None:
            on_event(request, ev)
    return events


def run_all(pool: Pool, requests: list[Request], on_event=None) -> list[list]:
    async def main():
        return await asyncio.gather(*[collect(pool, r, on_event) for r in requests])
    return asyncio.run(main())


def wait_for(cond, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


# ----------------------------------------------------------------------------- setup


def test_devices_and_kv_sizing_rules():
    if not _cuda():
        assert resolve_devices(2) == ["cpu", "cpu"] and resolve_devices("auto") == ["cpu"]
        with pytest.raises(ValueError, match="needs CUDA"):
            resolve_devices(["cuda:0"])
    assert resolve_devices(["cpu", "cpu"]) == ["cpu", "cpu"]
    assert resolve_devices("cpu,cpu") == ["cpu", "cpu"]
    assert resolve_devices("auto", device="cpu") == ["cpu"]
    with pytest.raises(ValueError, match="at least 1"):
        resolve_devices(0)
    with pytest.raises(ValueError, match="unknown device"):
        resolve_devices(["gpu7"])
    with pytest.raises(ValueError, match="not both|one of them"):
        resolve_devices(["cpu"], device="cpu")
    mib = 2**20
    # 1 MiB per token: auto keeps >= 8 slots by shortening the context (never below 256)
    assert choose_kv_size(mib, 10_000 * mib, 4096, None, None) == (8, 1250)
    with pytest.raises(ValueError, match="not enough free GPU memory"):
        choose_kv_size(mib, 100 * mib, 4096, None, None)
    assert choose_kv_size(mib, 1000 * mib, 4096, None, 100) == (10, 100)
    assert choose_kv_size(mib, 1000 * mib, 4096, 4, None) == (4, 250)
    assert choose_kv_size(1024, 2**40, 32768, None, None) == (256, 8192)
    with pytest.raises(ValueError, match="lower max_batch or max_context"):
        choose_kv_size(mib, 10 * mib, 4096, 4, 100)


def test_cuda_sizing_splits_free_memory_between_replicas_of_one_gpu(loaded, monkeypatch):
    import torch

    from nbserve.pool.setup import kv_bytes_per_token, plan_kv_caches

    free = 3 * 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 4 * free))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    per_token = kv_bytes_per_token(loaded.model)  # 2 layers x k,v x 2 heads x 16 x 4 bytes
    assert per_token == 2 * 2 * 2 * 16 * 4
    plans = plan_kv_caches({"cuda:0": loaded}, ["cuda:0", "cuda:0"], 0.5, None, None)
    assert [p.max_context for p in plans] == [512, 512]  # the tiny model's own limit
    budget = min(int(free * 0.5) // 2, 64 * 512 * per_token)  # capped at 64 x 512 tokens
    assert [p.kv_memory for p in plans] == [budget, budget]  # a paged cache's block budget
    assert plans[0].engine_options() == {"max_batch": None, "max_context": 512,
                                         "kv_memory": budget}
    assert "of 3.0 GiB free" in plans[0].describe(0, "cuda:0")
    small = plan_kv_caches({"cuda:0": loaded}, ["cuda:0"], None, None, None,
                           kv_memory=100 * per_token)
    assert small[0].kv_memory == 100 * per_token and small[0].max_context == 100


def test_a_loaded_model_is_copied_to_another_device_with_ties_kept(loaded):
    from nbserve.pool.setup import replicate

    assert replicate(loaded, "cpu") is loaded
    copy = replicate(loaded, "meta")
    assert copy.model.device.type == "meta" and loaded.model.device.type == "cpu"
    assert copy.model.lm_head.weight is copy.model.model.embed_tokens.weight
    assert copy.tokenizer is loaded.tokenizer


def test_backend_surface_and_shared_weights(loaded, tiny_llama_dir):
    with Pool(str(tiny_llama_dir), devices=2 if not _cuda() else ["cpu", "cpu"],
              max_batch=4, max_context=128, quiet=True) as pool:
        a, b = pool.engines
        assert a is not b and a.model is b.model  # one copy of the weights on one device
        assert a.cache is not b.cache
        assert pool.max_context == 128 and pool.tokenizer is a.tokenizer
        assert pool.template is a.template and pool.model_name == a.model_name
        assert pool.complete("Hello", temperature=0, max_tokens=5, ignore_eos=True)
        assert isinstance(pool.chat("Hi!", temperature=0, max_tokens=5), str)
        with pytest.raises(InvalidRequestError):
            pool.stream(Request(prompt="x", params=SamplingParams(max_tokens=0)))
        h = pool.health()
        assert h["ready"] and h["replicas"] == 2 and h["healthy_replicas"] == 2
        assert [r["healthy"] for r in h["replica_health"]] == [True, True]
    with pytest.raises(EngineStoppedError):
        pool.stream(Request(prompt="x"))
    with pytest.raises(RuntimeError, match="could not prepare a replica .* on cpu: .*not found"):
        Pool("/no/such/model/dir", devices=["cpu", "cpu"])


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


# ----------------------------------------------------------------------------- serving


def test_sixteen_concurrent_requests_use_both_replicas_and_match_one_engine(loaded, reference):
    with make_pool(loaded) as pool:
        requests = [Request(prompt=p, params=greedy(24)) for p in PROMPTS]
        results = run_all(pool, requests)
        for p, events in zip(PROMPTS, results):
            assert isinstance(events[0], Started) and isinstance(events[-1], Finished)
            assert ids_of(events) == reference[p]
        st = pool.stats()
        served = [r["requests_served"] for r in st["replicas"]]
        assert sum(served) == 16 and min(served) >= 4, served
        assert all(r["tokens_decoded"] > 0 for r in st["replicas"])
        assert st["tokens_decoded"] == sum(r["tokens_decoded"] for r in st["replicas"])
        assert st["slots_total"] == 8 and st["running"] == 0 and st["waiting"] == 0
        assert set(st["replicas"][0]) >= {"replica", "device", "healthy", "running", "waiting",
                                          "decode_tokens_per_s", "slots_used", "slots_total",
                                          "requests_served"}
        assert st["ttft_s"]["p50"] is not None


def test_second_chat_turn_goes_back_to_the_replica_of_the_first(loaded):
    convs = [[{"role": "system", "content": f"You are assistant {name}. " + "Be brief. " * 12},
              {"role": "user", "content": f"Hello {name}, what is two plus two?"}]
             for name in ("Ada", "Bob", "Cyd", "Dee")]
    with make_pool(loaded) as pool:
        first = [Request(messages=c, params=greedy(8)) for c in convs]
        answers = run_all(pool, first)  # concurrent: spread over both replicas
        homes = [r.metadata["replica"] for r in first]
        assert set(homes) == {0, 1}
        for turn in range(2):
            for conv, events in zip(convs, answers):
                reply = "".join(ev.text for ev in events if isinstance(ev, Delta))
                conv += [{"role": "assistant", "content": reply},
                         {"role": "user", "content": f"And turn {turn}?"}]
            nxt = [Request(messages=c, params=greedy(8)) for c in convs]
            answers = [run_all(pool, [r])[0] for r in nxt]  # one at a time: loads are equal
            assert [r.metadata["replica"] for r in nxt] == homes
            cached = [ev.usage.cached_tokens for a in answers for ev in a
                      if isinstance(ev, Finished)]
            assert all(c > 20 for c in cached), cached  # the prefix was reused there
        # an unrelated prompt is routed by load, alternating between idle replicas
        fresh = [Request(prompt=f"unrelated {i}", params=greedy(2)) for i in range(4)]
        for r in fresh:
            run_all(pool, [r])
        assert {r.metadata["replica"] for r in fresh} == {0, 1}


def test_cancel_and_n_choices_through_the_pool(loaded):
    with make_pool(loaded) as pool:
        async def cancel_after_two() -> int:
            agen = pool.generate(Request(prompt="cancel me", params=greedy(100)))
            seen = 0
            async for ev in agen:
                seen += isinstance(ev, Delta)
                if seen == 2:
                    break
            await agen.aclose()
            return seen

        async def two_choices() -> list:
            return await collect(pool, Request(prompt="two", params=SamplingParams(
                n=2, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)))

        async def main():
            return await asyncio.gather(cancel_after_two(), two_choices())

        seen, events = asyncio.run(main())
        assert seen == 2
        assert sorted(ev.index for ev in events if isinstance(ev, Finished)) == [0, 1]
        assert wait_for(lambda: pool.stats()["running"] == 0)
        st = pool.stats()
        assert [r["in_flight"] for r in st["replicas"]] == [0, 0]
        assert st["requests_finished"].get("cancelled") == 1 and st["slots_used"] == 0


def test_affinity_reads_the_replicas_cache_and_yields_to_an_overloaded_replica(loaded):
    with make_pool(loaded, kv_block_size=8) as pool:
        ids = list(range(10, 60))
        assert pool.replicas[1].prefix_match(ids) == pool.replicas[0].prefix_match(ids) == 0
        served = Request(prompt_ids=ids + [5, 6], params=greedy(2))
        list(pool.replicas[1].engine.stream(served))  # its blocks hold the prompt now
        assert pool.replicas[1].prefix_match(ids) == 50  # six full blocks of 8, two positions more
        assert pool.replicas[0].prefix_match(ids) == 0
        assert pool._route(ids, set())[0].index == 1
        pool.replicas[1].load = 2  # <= 0 + max_batch / 2: still preferred
        assert pool._route(ids, set())[0].index == 1
        pool.replicas[1].load = 3  # overloaded: the least loaded replica wins
        assert pool._route(ids, set())[0].index == 0
        pool.replicas[1].load = 0


# ----------------------------------------------------------------------------- faults


class FailingModel:
    """Wraps a model; every forward raises while `broken` (a broken GPU, say)."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.broken = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.broken:
            raise RuntimeError("injected fault")
        return self.inner.forward(*args, **kwargs)


def test_model_that_keeps_raising_is_marked_unhealthy_and_nothing_is_lost(loaded, reference):
    with make_pool(loaded) as pool:
        bad = pool.replicas[1]
        bad.engine.model = FailingModel(bad.engine.model)
        results = run_all(pool, [Request(prompt=p, params=greedy(24)) for p in PROMPTS])
        for p, events in zip(PROMPTS, results):
            assert not any(isinstance(ev, ErrorEvent) for ev in events), events[-1]
            assert ids_of(events) == reference[p]
            assert sum(isinstance(ev, Started) for ev in events) == 1
        h = pool.health()
        assert h["ready"] and h["status"] == "degraded"
        assert h["replica_health"][1]["healthy"] is False
        assert "in a row" in h["replica_health"][1]["reason"]
        st = pool.stats()
        assert st["replicas"][1]["model_errors"] >= 3 and st["replicas"][0]["requests_served"] == 16
        later = Request(prompt="after the fault", params=greedy(4))
        assert len(ids_of(run_all(pool, [later])[0])) == 4 and later.metadata["replica"] == 0


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_replica_killed_mid_load_leaves_every_other_request_completed(loaded, reference):
    with make_pool(loaded, max_batch=2) as pool:
        victim = pool.replicas[1].engine
        killed = threading.Event()

        def crash() -> bool:
            raise SystemExit  # ends the engine thread, silently, like a fatal error would

        def on_event(request: Request, ev: Any) -> None:
            if isinstance(ev, Delta) and request.metadata.get("replica") == 1 and \
                    not killed.is_set():
                killed.set()
                victim.step = crash

        requests = [Request(prompt=p, params=greedy(24)) for p in PROMPTS]
        results = run_all(pool, requests, on_event)
        assert killed.is_set()
        failed = []
        for p, r, events in zip(PROMPTS, requests, results):
            if isinstance(events[-1], ErrorEvent):
                failed.append(p)
                assert r.metadata["replica"] == 1 and ids_of(events)  # had streamed already
                assert "replica 1" in events[-1].message
            else:
                assert ids_of(events) == reference[p]
        assert len(failed) <= 2  # at most the victim's running requests
        assert wait_for(lambda: not pool.replicas[1].healthy)
        moved = [r for r, e in zip(requests, results) if r.metadata["replica"] == 0]
        assert len(moved) > 8  # the victim's waiting requests went to replica 0
        h = pool.health()
        assert h["ready"] and h["replica_health"][1]["healthy"] is False
        assert "died" in h["replica_health"][1]["reason"]
        later = Request(prompt="still serving", params=greedy(4))
        assert len(ids_of(run_all(pool, [later])[0])) == 4 and later.metadata["replica"] == 0
        assert pool.stats()["replicas"][0]["in_flight"] == 0


def test_a_replica_whose_model_recovers_comes_back_on_probation(loaded, reference):
    with make_pool(loaded, readmit_after=0.3) as pool:
        bad = pool.replicas[1]
        failing = FailingModel(bad.engine.model)
        bad.engine.model = failing
        run_all(pool, [Request(prompt=p, params=greedy(8)) for p in PROMPTS])
        # taken out (on a busy machine its 0.3 s cool-down may be over already)
        assert bad.down_since > 0 and bad.cooldown == pytest.approx(0.3)
        failing.broken = False  # repaired while out of rotation
        assert wait_for(lambda: bad.healthy, 5.0)
        requests = [Request(prompt=p, params=greedy(24)) for p in PROMPTS]
        results = run_all(pool, requests)
        assert {r.metadata["replica"] for r in requests} == {0, 1}  # back in rotation
        for p, events in zip(PROMPTS, results):
            assert ids_of(events) == reference[p]
        assert bad.cooldown is None and bad.errors_in_row == 0  # it served: probation over
        assert pool.health()["status"] == "ready"


def test_a_relapse_on_probation_doubles_the_cool_down(loaded):
    with make_pool(loaded, readmit_after=0.2) as pool:
        bad = pool.replicas[1]
        bad.engine.model = FailingModel(bad.engine.model)
        run_all(pool, [Request(prompt=p, params=greedy(4)) for p in PROMPTS])
        first_out = bad.down_since  # taken out (on a busy machine it may be back already)
        assert first_out > 0 and bad.cooldown == pytest.approx(0.2)
        assert wait_for(lambda: bad.healthy, 5.0)  # the engine runs: a chance, still broken
        assert bad.errors_in_row == pool.max_model_errors - 1  # on probation
        requests = [Request(prompt=p, params=greedy(4)) for p in PROMPTS]
        results = run_all(pool, requests)
        assert not any(isinstance(ev[-1], ErrorEvent) for ev in results)  # moved, not lost
        assert bad.down_since > first_out and bad.cooldown == pytest.approx(0.4)  # out again,
        # for longer


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_crashed_replica_restarts_and_rejoins(loaded, reference):
    with make_pool(loaded, readmit_after=0.2) as pool:
        victim = pool.replicas[1].engine
        victim.restart_delay = 0.05
        original = victim.step

        def crash_once() -> bool:
            victim.step = original
            raise SystemExit  # ends the engine thread once

        victim.step = crash_once
        run_all(pool, [Request(prompt=p, params=greedy(4)) for p in PROMPTS])
        assert wait_for(lambda: victim.restarts == 1, 5.0)
        assert wait_for(lambda: pool.replicas[1].healthy, 5.0)
        requests = [Request(prompt=p, params=greedy(24)) for p in PROMPTS]
        results = run_all(pool, requests)
        assert 1 in {r.metadata["replica"] for r in requests}
        for p, events in zip(PROMPTS, results):
            assert ids_of(events) == reference[p]


# A step this long is stuck. A tiny model's step takes milliseconds, but with 0.3 s these tests
# failed now and then on a loaded 2-core machine, where a healthy step can take that long.
STUCK_AFTER = 2.0


class HangingModel:
    """Wraps a model; a forward blocks while `gate` is clear."""

    def __init__(self, inner: Any):
        self.inner, self.gate, self.blocked = inner, threading.Event(), threading.Event()
        self.gate.set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self.gate.is_set():
            self.blocked.set()
            self.gate.wait(30)
        return self.inner.forward(*args, **kwargs)


def test_a_stuck_replica_leaves_the_rotation_and_returns_when_its_step_does(loaded, reference):
    with make_pool(loaded, step_timeout=STUCK_AFTER, readmit_after=0.2) as pool:
        stuck = pool.replicas[1]
        model = HangingModel(stuck.engine.model)
        stuck.engine.model = model
        model.gate.clear()
        requests = [Request(prompt=p, params=greedy(24)) for p in PROMPTS]
        results = run_all(pool, requests)  # the ones sent to replica 1 move to replica 0
        assert model.blocked.is_set()
        for p, r, events in zip(PROMPTS, requests, results):
            if not isinstance(events[-1], ErrorEvent):
                assert ids_of(events) == reference[p]
            else:  # only a request that had streamed on replica 1 may fail
                assert r.metadata["replica"] == 1 and "stuck" in events[-1].message
        assert sum(isinstance(e[-1], ErrorEvent) for e in results) <= 1
        assert not stuck.healthy and "stuck" in stuck.reason
        model.gate.set()  # the step returns
        assert wait_for(lambda: stuck.healthy, 10)
        later = [Request(prompt=p, params=greedy(8)) for p in PROMPTS]
        run_all(pool, later)
        assert 1 in {r.metadata["replica"] for r in later}


def test_all_replicas_down_refuses_and_close_leaves_no_thread(loaded):
    before = set(threading.enumerate())
    pool = make_pool(loaded)
    assert len(set(threading.enumerate()) - before) == 5  # 2 engines, their stall watches, monitor
    run_all(pool, [Request(prompt=p, params=greedy(4)) for p in PROMPTS[:4]])
    for rep in pool.replicas:
        rep.engine.close()  # stopped behind the pool's back
    assert wait_for(lambda: not pool.health()["ready"])
    assert pool.health()["status"] == "unavailable"
    with pytest.raises(EngineStoppedError, match="no healthy replica"):
        pool.stream(Request(prompt="x"))
    pool.close()
    pool.close()  # idempotent
    assert set(threading.enumerate()) == before


def test_a_replica_copy_keeps_fused_weights_as_views(loaded):
    from nbserve.pool.setup import replicate

    copy = replicate(loaded, "meta").model  # another device; meta: no memory, same layout
    att = copy.model.layers[0].self_attn
    assert att.qkv_weight.device.type == "meta"
    fused_bytes = att.qkv_weight.untyped_storage().nbytes()
    assert fused_bytes > att.q_proj.weight.numel() * 4
    # each projection is a view into the fused tensor (its storage), not a second copy
    assert att.q_proj.weight.untyped_storage().nbytes() == fused_bytes
    mlp = copy.model.layers[0].mlp
    assert mlp.up_proj.weight.untyped_storage().nbytes() == \
        mlp.gate_up_weight.untyped_storage().nbytes()


# ----------------------------------------------------------------------------- over HTTP

NO_EOS = {"2": -100, "0": -100}  # <|im_end|> and <|endoftext|> never sampled
MSG = [{"role": "user", "content": "Tell me a story."}]


def test_a_client_that_stops_reading_is_cancelled_past_max_backlog_in_a_pool(loaded):
    # slow_client_timeout=0: the count alone decides (the grace time: the sync test below)
    pool = make_pool(loaded, max_backlog=32, max_context=512, slow_client_timeout=0)
    with pool, small_send_buffers(pool) as url:
        # top_logprobs make each chunk ~1.5 KB: the buffers are full after a few dozen tokens
        sock = non_reading_stream(url, {"messages": MSG, "stream": True, "max_tokens": 480,
                                        "logprobs": True, "top_logprobs": 20,
                                        "logit_bias": NO_EOS})
        try:
            assert wait_until(lambda: pool.stats()["requests_finished"].get("error") == 1, 20)
            st = pool.stats()  # cancelled while its client still reads nothing
            assert st["running"] == 0 and st["slots_used"] == 0
            assert st["tokens_decoded"] < 400
            assert all(r["in_flight"] == 0 for r in st["replicas"])
            ok = httpx.post(url + "/v1/chat/completions", timeout=60, json={
                "messages": MSG, "max_tokens": 5, "logit_bias": NO_EOS})
            assert ok.status_code == 200  # the pool is fine
            data = read_sse_data(sock)  # the client wakes up: its stream ends with the reason
        finally:
            sock.close()
    assert data[-1] == "[DONE]"
    last = json.loads(data[-2])
    assert last["error"]["code"] == "client_too_slow"
    assert "max_backlog=32" in last["error"]["message"]


class SlowModel:
    """Wraps a model; every forward takes 10 ms longer."""

    def __init__(self, inner: Any):
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        time.sleep(0.01)
        return self.inner.forward(*args, **kwargs)


def test_the_sync_stream_of_a_pool_keeps_max_backlog(loaded):
    """A caller that reads nothing is cancelled once more than max_backlog events wait and the
    oldest has waited past slow_client_timeout (steps of 10 ms: 200 tokens take 2 s at least)."""
    with make_pool(loaded, max_backlog=4, max_context=512, slow_client_timeout=0.3) as pool:
        for rep in pool.replicas:
            rep.engine.model = SlowModel(rep.engine.model)
        events = pool.stream(Request(prompt="x", params=SamplingParams(
            temperature=0, max_tokens=200, ignore_eos=True)))
        assert isinstance(next(events), Started)  # then read nothing while it generates
        assert wait_for(lambda: pool.stats()["requests_finished"].get("error") == 1, 20)
        rest = list(events)
        assert isinstance(rest[-1], ErrorEvent) and rest[-1].kind == "client_too_slow"
        assert "slow_client_timeout=0.3 s" in rest[-1].message
        assert len(rest) < 200  # cancelled before the end of its answer


def test_metrics_have_a_series_per_replica(loaded):
    with make_pool(loaded) as pool, app_running(pool) as url:
        for _ in range(4):
            r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
                "messages": MSG, "max_tokens": 3, "logit_bias": NO_EOS})
            assert r.status_code == 200
        text = httpx.get(url + "/metrics").text
        stats = pool.stats()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("nbserve_running_sequences", "nbserve_queue_depth",
                 "nbserve_kv_cache_slots_used", "nbserve_kv_cache_slots_total",
                 "nbserve_kv_cache_usage_ratio", "nbserve_engine_decode_tokens",
                 "nbserve_engine_prefill_tokens", "nbserve_replica_healthy"):
        samples = [s for s in families[name].samples if not s.name.endswith("_created")]
        assert sorted(s.labels.get("replica") for s in samples) == ["0", "1"], (name, samples)
    decoded = {s.labels["replica"]: s.value for s in families["nbserve_engine_decode_tokens"]
               .samples if s.name.endswith("_total")}
    assert decoded == {str(r["replica"]): r["tokens_decoded"] for r in stats["replicas"]}
    assert sum(decoded.values()) == stats["tokens_decoded"] > 0
    healthy = {s.labels["replica"]: s.value for s in families["nbserve_replica_healthy"].samples}
    assert healthy == {"0": 1.0, "1": 1.0}
    slots = {s.labels["replica"]: s.value for s in families["nbserve_kv_cache_slots_total"]
             .samples}
    assert slots == {"0": 4.0, "1": 4.0}


def test_a_request_that_meets_a_stuck_replica_before_the_watcher_leaves_it_readmittable(loaded):
    """Between a stall and the watcher's next look, a request can still be routed to the stuck
    replica; its refusal must take the replica out for a cool-down, not close it for good."""
    with make_pool(loaded, step_timeout=STUCK_AFTER, readmit_after=0.2) as pool:
        pool.watch_interval = 3600  # the watcher will not look in this test
        stuck = pool.replicas[1]
        model = HangingModel(stuck.engine.model)
        stuck.engine.model = model
        model.gate.clear()
        pool.replicas[0].load = 10**6  # route the next request to replica 1
        first = Request(prompt=PROMPTS[0], params=greedy(8))
        run_all(pool, [first])  # stalls on 1, is failed by the stall watch, moves to 0
        assert model.blocked.is_set() and stuck.engine.stalled
        assert not stuck.healthy and "stuck" in stuck.reason
        model.gate.set()  # the step returns
        assert wait_for(lambda: not stuck.engine.stalled, 10)
        assert stuck.alive and stuck.engine.health()["ready"]  # not closed
        pool._readmit_due()
        assert wait_for(lambda: (pool._readmit_due(), stuck.healthy)[1], 10)
        pool.replicas[0].load -= 10**6


def test_a_quantized_model_without_its_float32_weights_still_copies_to_another_device(
        tiny_llama_dir, tmp_path):
    from gguf_util import hf_dir_to_gguf

    import nbserve
    from nbserve.models.decoder import kernels_available
    from nbserve.pool.setup import replicate

    if not kernels_available():
        pytest.skip("weights='blocks' needs nbserve's C kernels (a C compiler)")
    path = hf_dir_to_gguf(tiny_llama_dir, tmp_path / "m.gguf", "Q4_1",
                          tensor_types={"token_embd.weight": "Q8_0"})
    loaded = nbserve.load(str(path), weights="blocks", verbose=False)  # the file's own blocks
    assert loaded.model.dense_released  # its float32 matmul weights were dropped at load
    copy = replicate(loaded, "meta").model
    att = copy.model.layers[0].self_attn
    assert att.q_proj.weight.device.type == "meta" and att.q_proj.weight.shape[0] > 0
    assert not copy.dense_released  # copied from the rebuilt weights, not from placeholders
    assert loaded.model.dense_released  # dropped again after the copy
