"""Unit tests of the Engine (nbserve/engine/engine.py, step.py, config.py) around a scripted
fake StepModel (tests/fakes.py): greedy output follows the script, max_tokens, the context
limit, stop token ids, stop strings, n > 1, prefix reuse, batching, cancellation, a full
queue, a failing forward, request and option validation. Milliseconds a test."""

from __future__ import annotations

import asyncio
import queue
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
from fakes import (
    LETTERS,
    ScriptedModel,
    greedy,
    ids,
    loaded,
    sum_of_context,
    text,
)

from nbserve import Engine
from nbserve.engine.config import EngineConfig
from nbserve.types import (
    BusyError,
    ContextLengthError,
    Delta,
    EngineStoppedError,
    ErrorEvent,
    Event,
    Finished,
    InvalidRequestError,
    Request,
    SamplingParams,
    Started,
)

TIMEOUT = 5.0  # seconds to wait for an event before calling the engine stuck


@contextmanager
def engine_for(model: ScriptedModel | None = None, stop_token_ids: list[int] = (),
               **options: Any) -> Iterator[Engine]:
    options = {"max_batch": 4, "quiet": True, "threads": 1, "step_timeout": None, **options}
    eng = Engine(loaded(model, stop_token_ids), **options)
    try:
        yield eng
    finally:
        eng.close()


def req(prompt: str, rid: str | None = None, **params: Any) -> Request:
    params.setdefault("temperature", 0.0)
    r = Request(prompt=prompt, params=SamplingParams(**params))
    if rid is not None:
        r.request_id = rid
    return r


@dataclass
class Result:
    events: list[Event] = field(default_factory=list)

    @property
    def started(self) -> Started:
        (s,) = [e for e in self.events if isinstance(e, Started)]
        return s

    def text(self, index: int = 0) -> str:
        return "".join(e.text for e in self.events if isinstance(e, Delta) and e.index == index)

    def ids(self, index: int = 0) -> list[int]:
        return [t for e in self.events if isinstance(e, Delta) and e.index == index
                for t in e.token_ids]

    def finished(self, index: int = 0) -> Finished:
        (f,) = [e for e in self.events if isinstance(e, Finished) and e.index == index]
        return f

    @property
    def error(self) -> ErrorEvent | None:
        errors = [e for e in self.events if isinstance(e, ErrorEvent)]
        return errors[0] if errors else None


class Pending:
    """A submitted request whose events the test reads with a timeout (never hangs)."""

    def __init__(self, engine: Engine, request: Request):
        self.q: queue.Queue[Event] = queue.Queue()
        self.group = engine.submit(request, self.q.put)
        self.result = Result()

    def next(self) -> Event:
        ev = self.q.get(timeout=TIMEOUT)
        self.result.events.append(ev)
        return ev

    def wait(self) -> Result:
        remaining = self.group.params.n
        while remaining:
            ev = self.next()
            if isinstance(ev, ErrorEvent):
                break
            remaining -= isinstance(ev, Finished)
        return self.result


def run(engine: Engine, request: Request) -> Result:
    return Pending(engine, request).wait()


# ----------------------------------------------------------------------------- the script


def test_greedy_output_follows_the_script() -> None:
    model = ScriptedModel()
    with engine_for(model) as eng:
        res = run(eng, req("abc", max_tokens=5))
    assert res.text() == "defgh" and res.ids() == ids("defgh")
    fin = res.finished()
    assert fin.reason == "length"
    assert (fin.usage.prompt_tokens, fin.usage.completion_tokens) == (3, 5)
    assert (res.started.prompt_tokens, res.started.cached_tokens) == (3, 0)
    assert isinstance(res.events[0], Started) and res.events[-1] is fin
    # One prefill of the prompt, then one decode per token but the last (it needs no forward).
    prefill, *decodes = model.calls
    assert [(r.positions, r.ids) for r in prefill] == [([0, 1, 2], ids("abc"))]
    assert [[(r.positions, r.ids) for r in c] for c in decodes] == [
        [([3], ids("d"))], [([4], ids("e"))], [([5], ids("f"))], [([6], ids("g"))]]


def test_the_script_wraps_around_the_vocabulary() -> None:
    with engine_for() as eng:
        assert run(eng, req("xy", max_tokens=4)).text() == "zabc"


def test_a_script_over_the_whole_context_is_decoded_exactly() -> None:
    """The cache keeps what the engine wrote: a script reading every cached token agrees with
    decoding in plain Python."""
    with engine_for(ScriptedModel(sum_of_context)) as eng:
        res = run(eng, req("hello", max_tokens=12))
    assert res.ids() == greedy(sum_of_context, ids("hello"), 12)


def test_max_tokens_one_is_one_forward() -> None:
    model = ScriptedModel()
    with engine_for(model) as eng:
        res = run(eng, req("ab", max_tokens=1))
    assert res.text() == "c" and res.finished().reason == "length"
    assert len(model.calls) == 1


def test_generation_stops_at_the_context_limit() -> None:
    with engine_for(max_context=8) as eng:
        res = run(eng, req("abc", max_tokens=None))
        assert res.text() == "defgh" and res.finished().reason == "length"  # 3 + 5 = 8
        assert eng.max_context == 8


# ----------------------------------------------------------------------------- stopping


def test_a_stop_token_id_ends_the_choice_without_its_text() -> None:
    with engine_for() as eng:
        res = run(eng, req("abc", stop_token_ids=[LETTERS.index("g")]))
    assert res.text() == "def" and res.ids() == ids("def")
    fin = res.finished()
    assert (fin.reason, fin.stop_matched) == ("stop", LETTERS.index("g"))


def test_the_model_stop_ids_end_a_reply_unless_ignore_eos() -> None:
    eos = [LETTERS.index("f")]
    with engine_for(stop_token_ids=eos) as eng:
        res = run(eng, req("abc", max_tokens=10))
        assert res.text() == "de" and res.finished().reason == "stop"
        res = run(eng, req("abc", max_tokens=5, ignore_eos=True))
        assert res.text() == "defgh" and res.finished().reason == "length"


def test_a_stop_string_cuts_the_text_before_it_even_across_tokens() -> None:
    with engine_for() as eng:
        res = run(eng, req("a", stop=["de"], max_tokens=10))
    assert res.text() == "bc"
    fin = res.finished()
    assert (fin.reason, fin.stop_matched) == ("stop", "de")
    assert fin.usage.completion_tokens == 4  # b c d e were generated


def test_text_held_back_for_a_stop_string_that_never_completes_is_flushed() -> None:
    with engine_for() as eng:
        res = run(eng, req("a", stop=["dx"], max_tokens=3))
    assert res.text() == "bcd" and res.finished().reason == "length"


def test_the_stop_string_that_completes_first_wins() -> None:
    with engine_for() as eng:
        res = run(eng, req("a", stop=["cdefg", "ef"], max_tokens=10))
    assert res.text() == "bcd" and res.finished().stop_matched == "ef"


# ----------------------------------------------------------------------------- n > 1


def test_n_choices_share_one_prefill_and_decode_in_their_own_slots() -> None:
    model = ScriptedModel(sum_of_context)
    with engine_for(model, max_batch=4) as eng:
        res = run(eng, req("abcd", n=3, max_tokens=4))
        copies = list(eng.cache.copies)
    expected = text(greedy(sum_of_context, ids("abcd"), 4))
    assert [res.text(i) for i in range(3)] == [expected] * 3
    assert [res.finished(i).reason for i in range(3)] == ["length"] * 3
    assert max(f.usage.completion_tokens for f in res.events if isinstance(f, Finished)) == 12
    prefills = [c for c in model.calls if len(c[0].ids) > 1]
    assert len(prefills) == 1 and len(prefills[0]) == 1  # the prompt is prefilled once
    src = prefills[0][0].slot
    decodes = [c for c in model.calls if c is not prefills[0]]
    assert decodes and all(len({r.slot for r in c}) == 3 for c in decodes)
    # Each sibling's slot got a copy of the 4 prompt tokens from the first choice's slot.
    assert sorted(dst for _, dst, _ in copies) == sorted({r.slot for r in decodes[0]} - {src})
    assert all((s, n) == (src, 4) for s, _, n in copies)


def test_n_larger_than_max_batch_is_refused_by_name() -> None:
    with engine_for(max_batch=2) as eng, pytest.raises(InvalidRequestError) as err:
        eng.submit(req("ab", n=3), lambda ev: None)
    assert err.value.param == "n" and "max_batch=2" in str(err.value)


# ----------------------------------------------------------------------------- prefix reuse


def test_a_second_turn_prefills_only_what_is_new() -> None:
    model = ScriptedModel(sum_of_context)
    with engine_for(model, max_batch=1) as eng:
        first = run(eng, req("abcdefgh", max_tokens=2))
        # The slot holds the prompt and the first output token (the last one was never forwarded).
        turn2 = "abcdefgh" + first.text()[:1] + "xy"
        model.calls.clear()
        second = run(eng, req(turn2, max_tokens=3))
    assert (second.started.prompt_tokens, second.started.cached_tokens) == (11, 9)
    assert second.finished().usage.cached_tokens == 9
    assert [(r.positions, r.ids) for r in model.calls[0]] == [([9, 10], ids("xy"))]
    assert second.ids() == greedy(sum_of_context, ids(turn2), 3)


# ----------------------------------------------------------------------------- batching


def test_requests_arriving_together_are_batched_and_answer_as_alone() -> None:
    model = ScriptedModel(sum_of_context, hold=threading.Event())
    with engine_for(model, max_batch=4) as eng:
        first = Pending(eng, req("zz", max_tokens=6))
        assert model.entered.wait(TIMEOUT)  # the engine is parked in the first prefill
        others = [Pending(eng, req(p, max_tokens=4)) for p in ("abc", "cab", "bbb")]
        model.hold.set()
        results = [first.wait()] + [p.wait() for p in others]
    assert results[0].ids() == greedy(sum_of_context, ids("zz"), 6)
    for p, res in zip(("abc", "cab", "bbb"), results[1:]):
        assert res.ids() == greedy(sum_of_context, ids(p), 4)
    # The three equal-length prompts went through one forward, then all four decoded together.
    assert any(len(c) == 3 and all(len(r.ids) == 3 for r in c) for c in model.calls)
    assert any(len(c) == 4 for c in model.calls)


# ----------------------------------------------------------------------------- cancellation


def test_abort_ends_the_request_as_cancelled_and_frees_its_slot() -> None:
    with engine_for(max_batch=1) as eng:
        got: list[Event] = []
        done = threading.Event()

        def sink(ev: Event) -> None:  # the engine thread calls it
            got.append(ev)
            if isinstance(ev, Delta) and len(got) == 2:
                eng.abort("long")
            if isinstance(ev, (Finished, ErrorEvent)):
                done.set()

        eng.submit(req("a", "long", max_tokens=None), sink)
        assert done.wait(TIMEOUT)
        fin = got[-1]
        assert isinstance(fin, Finished) and fin.reason == "cancelled"
        assert len([e for e in got if isinstance(e, Delta)]) < 5  # far from the 63 of a full run
        assert eng.stats()["slots_used"] == 0 and eng.stats()["running"] == 0
        # The slot is free, and its tokens are kept for prefix reuse.
        cut = "a" + text([t for e in got if isinstance(e, Delta) for t in e.token_ids])
        nxt = run(eng, req(cut + "a", max_tokens=1))
        assert nxt.started.cached_tokens == len(cut) - 1  # all but the unforwarded last token


def test_closing_the_stream_cancels_the_request() -> None:
    with engine_for(max_batch=1) as eng:
        stream = eng.stream(req("a", max_tokens=None))
        assert isinstance(next(stream), Started)
        assert isinstance(next(stream), Delta)
        stream.close()
        after = run(eng, req("q", max_tokens=2))  # one slot: served only once "a" is gone
        assert after.text() == "rs"
        assert eng.stats()["requests_finished"] == {"cancelled": 1, "length": 1}


async def test_leaving_the_async_generator_cancels_the_request() -> None:
    with engine_for(max_batch=1) as eng:
        gen = eng.generate(req("a", max_tokens=None))
        assert isinstance(await asyncio.wait_for(anext(gen), TIMEOUT), Started)
        assert isinstance(await asyncio.wait_for(anext(gen), TIMEOUT), Delta)
        await gen.aclose()
        after = run(eng, req("q", max_tokens=1))
        assert after.text() == "r"
        assert eng.stats()["requests_finished"] == {"cancelled": 1, "length": 1}


# ----------------------------------------------------------------------------- refusals


def test_a_full_queue_refuses_with_busy_error() -> None:
    model = ScriptedModel(hold=threading.Event())
    with engine_for(model, max_batch=1, max_queue=1) as eng:
        running = Pending(eng, req("ab", "r1", max_tokens=2))
        assert model.entered.wait(TIMEOUT)  # r1 left the queue and holds the only slot
        waiting = Pending(eng, req("cd", "r2", max_tokens=2))
        with pytest.raises(BusyError, match="max_queue=1"):
            eng.submit(req("ef", "r3"), lambda ev: None)
        with pytest.raises(InvalidRequestError, match="in use") as err:
            eng.submit(req("gh", "r2"), lambda ev: None)  # an id still in flight
        assert err.value.param == "request_id"
        model.hold.set()
        assert running.wait().text() == "cd"
        assert waiting.wait().text() == "ef"
        assert eng.stats()["requests_rejected"] == 1
        assert run(eng, req("ef", "r3", max_tokens=1)).text() == "g"  # room again


def test_a_request_waiting_past_queue_timeout_fails_and_the_running_one_goes_on() -> None:
    model = ScriptedModel(hold=threading.Event())
    with engine_for(model, max_batch=1, queue_timeout=0.005) as eng:
        running = Pending(eng, req("ab", max_tokens=3))
        assert model.entered.wait(TIMEOUT)  # admitted: it no longer counts as waiting
        waiting = Pending(eng, req("cd", max_tokens=3))
        time.sleep(0.01)  # longer than queue_timeout
        model.hold.set()
        late = waiting.wait()
        assert late.error is not None and late.error.kind == "queue_timeout"
        assert "queue_timeout=0.005" in late.error.message
        assert not any(isinstance(e, Started) for e in late.events)
        assert running.wait().text() == "cde"
        assert eng.stats()["waiting"] == 0


@pytest.mark.parametrize(("request_", "param", "error"), [
    (Request(prompt_ids=[0, 26]), "prompt", InvalidRequestError),
    (Request(prompt_ids=[-1]), "prompt", InvalidRequestError),
    (Request(prompt=""), "prompt", InvalidRequestError),
    (Request(prompt="a" * 16), "prompt", ContextLengthError),
    (Request(messages=[{"role": "user", "content": "hi"}]), "messages", InvalidRequestError),
    (Request(), "messages", InvalidRequestError),  # no input at all
    (Request(prompt="ab", params=SamplingParams(temperature=-1)), "temperature",
     InvalidRequestError),
    (Request(prompt="ab", params=SamplingParams(stop_token_ids=[26])), "stop_token_ids",
     InvalidRequestError),
])
def test_a_bad_request_is_refused_before_it_is_queued(request_: Request, param: str,
                                                      error: type) -> None:
    with engine_for(max_context=16) as eng:
        with pytest.raises(error) as err:
            eng.submit(request_, lambda ev: None)
        assert err.value.param == param
        assert eng.stats()["waiting"] == 0
        assert run(eng, req("ab", max_tokens=1)).text() == "c"  # and the engine still serves


def test_a_failing_forward_fails_its_request_and_the_engine_serves_on() -> None:
    model = ScriptedModel(poison=LETTERS.index("e"))
    with engine_for(model, max_batch=1) as eng:
        res = run(eng, req("abc", max_tokens=5))  # the decode that feeds "e" raises
        assert res.error is not None and res.error.kind == "server_error"
        assert "poisoned token 4" in res.error.message
        assert res.text() == "de"
        # The slot was freed without keeping its tokens (a, b, c, d were in it).
        model.poison = None
        nxt = run(eng, req("abcdx", max_tokens=2))
        assert nxt.text() == "yz" and nxt.started.cached_tokens == 0
        assert eng.stats()["model_errors"] == 1


def test_closing_the_engine_ends_pending_requests_and_refuses_new_ones() -> None:
    model = ScriptedModel(hold=threading.Event())
    eng = Engine(loaded(model), max_batch=1, quiet=True, threads=1, step_timeout=None)
    closer = threading.Thread(target=eng.close)
    try:
        running = Pending(eng, req("ab", max_tokens=5))
        assert model.entered.wait(TIMEOUT)  # parked in its prefill
        waiting = Pending(eng, req("cd", max_tokens=2))
        closer.start()  # close() waits for the step in flight
        for _ in range(2000):
            if eng.health()["status"] == "stopped":
                break
            time.sleep(0.001)
    finally:
        model.hold.set()
        if closer.ident is not None:
            closer.join(TIMEOUT)
        eng.close()  # idempotent; closes here if the test failed before starting the closer
    running, waiting = running.wait(), waiting.wait()
    assert running.text() == "c"  # the step in flight completed, then the engine stopped
    for res in (running, waiting):
        assert res.error is not None and res.error.kind == "service_unavailable"
    with pytest.raises(EngineStoppedError):
        eng.submit(req("ef"), lambda ev: None)
    assert eng.health()["status"] == "stopped"


# ----------------------------------------------------------------------------- options


def test_an_unknown_option_is_a_type_error_that_names_it_and_a_close_match() -> None:
    before = {t.name for t in threading.enumerate()}
    with pytest.raises(TypeError) as err:
        Engine(loaded(), max_batchs=2)
    msg = str(err.value)
    assert "'max_batchs'" in msg and "did you mean 'max_batch'" in msg
    assert "prefill_chunk" in msg  # the known options are listed
    assert {t.name for t in threading.enumerate()} <= before  # no engine thread was started
    with pytest.raises(TypeError, match="'zzz'"):
        EngineConfig.from_options(zzz=1)


def test_options_come_from_keywords_a_config_or_both() -> None:
    base = EngineConfig(max_batch=3, prefill_chunk=7)
    assert EngineConfig.from_options(base, max_batch=5) == EngineConfig(max_batch=5,
                                                                        prefill_chunk=7)
    eng = Engine(loaded(), base, max_queue=9, quiet=True, threads=1, step_timeout=None)
    try:
        assert (eng.max_batch, eng.prefill_chunk, eng.max_queue) == (3, 7, 9)
        assert eng.stats()["slots_total"] == 3
    finally:
        eng.close()
    assert set(EngineConfig.options()) >= {"max_batch", "max_context", "max_queue", "name"}


@pytest.mark.parametrize(("options", "message"), [
    ({"max_batch": 0}, "max_batch must be an integer >= 1 (or None: 64 with a paged cache, "
                       "else 16), got 0"),
    ({"max_batch": True}, "max_batch must be an integer >= 1 (or None: 64 with a paged "
                          "cache, else 16), got True"),
    ({"kv_memory": 0}, "kv_memory must be a number of bytes (an integer), a fraction"),
    ({"kv_memory": 1.5}, "kv_memory must be a number of bytes (an integer), a fraction"),
    ({"kv_memory": "1GB"}, "kv_memory must be a number of bytes"),
    ({"kv_block_size": 0}, "kv_block_size must be an integer >= 1"),
    ({"kv_dtype": "int8"}, "kv_dtype must be one of float32, bfloat16, float16"),
    ({"max_queue": 2.0}, "max_queue must be an integer >= 1"),
    ({"prefill_chunk": -5}, "prefill_chunk must be an integer >= 1"),
    ({"max_context": 1}, "max_context must be an integer >= 2"),
    ({"max_backlog": 0}, "max_backlog must be an integer >= 1 (or None: no limit)"),
    ({"slow_client_timeout": -1}, "slow_client_timeout must be a number of seconds >= 0"),
    ({"slow_client_timeout": None}, "slow_client_timeout must be a number of seconds >= 0"),
    ({"slow_client_timeout": True}, "slow_client_timeout must be a number of seconds >= 0"),
    ({"slow_client_timeout": float("nan")}, "slow_client_timeout must be a number of seconds"),
    ({"threads": 0}, "threads must be an integer >= 1"),
    ({"queue_timeout": 0}, "queue_timeout must be a number of seconds > 0"),
    ({"queue_timeout": "1"}, "queue_timeout must be a number of seconds > 0"),
    ({"step_timeout": -1.0}, "step_timeout must be a number of seconds > 0"),
    ({"step_timeout": False}, "step_timeout must be a number of seconds > 0"),
    ({"name": "  "}, "name must be a non-empty string"),
])
def test_engine_config_names_the_bad_option(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        EngineConfig(**options)


def test_engine_config_none_means_default_or_off() -> None:
    cfg = EngineConfig(max_context=None, max_backlog=None, threads=None, queue_timeout=None,
                       step_timeout=None, name=None)
    assert cfg.context_for(100) == 100 and cfg.context_for(100_000) == 4096


def test_max_context_may_not_exceed_the_model() -> None:
    assert EngineConfig(max_context=50).context_for(64) == 50
    with pytest.raises(ValueError, match="between 2 and the model's 64, got 65"):
        Engine(loaded(ScriptedModel(max_context=64)), max_context=65, quiet=True)


def test_the_engine_serves_under_its_name_and_reports_its_setup() -> None:
    with engine_for(max_batch=2, max_context=32, name="my-model") as eng:
        assert eng.model_name == "my-model"
        st = eng.stats()
        assert (st["slots_total"], st["max_context"], st["slots_used"]) == (2, 32, 0)
        assert eng.health()["ready"] is True and eng.health()["model"] == "my-model"
    with engine_for() as eng:
        assert eng.model_name == "scripted"  # the LoadedModel's name by default
