"""/v1/completions with a list of prompts, over a real server with the official openai SDK:
every prompt is answered whatever the number of free slots (streaming and not), a prompt refused
before the response starts is the HTTP error, and a client that stops reading is still cancelled
by max_backlog."""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
from server_util import app_running, non_reading_stream, read_all, small_send_buffers, wait_until

from nbserve.engine import Engine
from nbserve.loading.hf_dir import load_hf_dir

NO_EOS = {"2": -100, "0": -100}  # the random model never ends early: full-length answers
PROMPTS = ["Hello there", "The quick brown fox", "def add(a, b):"]


class SlowSteps:
    """A StepModel whose every forward takes `delay` s longer, so that a request holds its
    slot for a while."""

    def __init__(self, inner: Any, delay: float):
        self.inner, self.delay = inner, delay

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        time.sleep(self.delay)
        return self.inner.forward(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir: Path) -> Any:
    return load_hf_dir(tiny_llama_dir)


def engine_of(loaded: Any, delay: float = 0.0, **options: Any) -> Engine:
    options.setdefault("max_context", 512)
    if delay:
        loaded = dataclasses.replace(loaded, model=SlowSteps(loaded.model, delay))
    return Engine(loaded, quiet=True, **options)


@pytest.fixture
def sdk() -> Iterator[Any]:
    """sdk(url) -> an openai.OpenAI client for that server (no retries)."""
    clients: list[openai.OpenAI] = []

    def make(url: str) -> openai.OpenAI:
        clients.append(openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                                     timeout=120))
        return clients[-1]

    yield make
    for c in clients:
        c.close()


def streamed(client: openai.OpenAI, **kw: Any) -> tuple[dict[int, str], dict[int, str]]:
    """A streamed completion's text and finish reason per choice index."""
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    for chunk in client.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    return texts, finish


def test_more_prompts_than_free_slots_are_all_answered(loaded: Any, sdk: Any) -> None:
    """3 prompts of 40 tokens on 2 slots with max_backlog=16: the third waits for a slot while
    the client reads the first two (it used to end in 408 client_too_slow). Steps of 10 ms
    give the reader some slack on a loaded machine (16 events are 160 ms here)."""
    engine = engine_of(loaded, delay=0.01, max_batch=2, max_backlog=16)
    with engine, app_running(engine) as url:
        client = sdk(url)
        kw: dict[str, Any] = {"model": "", "max_tokens": 40, "temperature": 0,
                              "logit_bias": NO_EOS}
        alone = [client.completions.create(prompt=p, **kw).choices[0].text for p in PROMPTS]
        r = client.completions.create(prompt=PROMPTS, **kw)
        assert [c.index for c in r.choices] == [0, 1, 2]
        assert [c.text for c in r.choices] == alone
        assert [c.finish_reason for c in r.choices] == ["length"] * 3
        assert r.usage.completion_tokens == 120
        texts, finish = streamed(client, prompt=PROMPTS, **kw)
        assert texts == dict(enumerate(alone)) and finish == dict.fromkeys(range(3), "length")
        # n=2: each prompt takes both slots, so the prompts run one after the other
        r = client.completions.create(prompt=PROMPTS, n=2, **kw)
        assert [c.index for c in r.choices] == list(range(6))  # prompt index * n + choice
        assert [c.text for c in r.choices] == [t for t in alone for _ in range(2)]
        texts, finish = streamed(client, prompt=PROMPTS, n=2, **kw)
        assert texts == {k * 2 + j: alone[k] for k in range(3) for j in range(2)}
        assert len(finish) == 6
        st = engine.stats()
        assert st["running"] == st["waiting"] == st["slots_used"] == 0


def test_a_prompt_refused_at_submission_is_the_http_error(loaded: Any, sdk: Any) -> None:
    engine = engine_of(loaded, max_batch=2, max_context=64)
    with engine, app_running(engine) as url:
        client = sdk(url)
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as err:
                client.completions.create(model="", prompt=["Hi", "Hello", "word " * 100],
                                          max_tokens=4, stream=stream)
            assert err.value.code == "context_length_exceeded"
        assert wait_until(lambda: engine.stats()["running"] == 0, 5)  # the others were closed


def _occupy(client: openai.OpenAI, max_tokens: int) -> tuple[threading.Thread, threading.Event]:
    """A chat stream that holds the engine's slot until the returned event is set."""
    stop = threading.Event()

    def run() -> None:
        stream = client.chat.completions.create(
            model="", messages=[{"role": "user", "content": "Tell me a story."}], stream=True,
            max_tokens=max_tokens, logit_bias=NO_EOS)
        with stream:
            for _ in stream:
                if stop.is_set():
                    break

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, stop


def test_a_full_queue_refuses_the_list_with_429(loaded: Any, sdk: Any) -> None:
    """1 slot, busy; room for 1 waiting request: prompt 0 queues, prompt 1 is refused, and the
    whole list is a 429 (prompt 0 is withdrawn)."""
    engine = engine_of(loaded, delay=0.05, max_batch=1, max_queue=1)
    with engine, app_running(engine) as url:
        client = sdk(url)
        thread, stop = _occupy(client, 400)
        try:
            assert wait_until(lambda: engine.stats()["running"] == 1, 10)
            for stream in (False, True):
                with pytest.raises(openai.RateLimitError) as err:
                    client.completions.create(model="", prompt=["Hi", "Hello"], max_tokens=4,
                                              stream=stream)
                assert err.value.code == "server_busy"
                assert err.value.response.headers["retry-after"]
                assert wait_until(lambda: engine.stats()["waiting"] == 0, 5)
        finally:
            stop.set()
            thread.join(30)


def test_queue_timeouts_before_and_after_the_stream_started(loaded: Any, sdk: Any) -> None:
    """Before anything was sent, a queue timeout is the HTTP 503; once a streamed list has
    started (prompt 0 runs), prompt 1's queue timeout ends the stream with an error event."""
    engine = engine_of(loaded, delay=0.05, max_batch=1, queue_timeout=0.5)
    with engine, app_running(engine) as url:
        client = sdk(url)
        thread, stop = _occupy(client, 400)
        try:
            assert wait_until(lambda: engine.stats()["running"] == 1, 10)
            for stream in (False, True):
                with pytest.raises(openai.InternalServerError) as err:
                    client.completions.create(model="", prompt=["Hi", "Hello"], max_tokens=4,
                                              stream=stream)
                assert err.value.status_code == 503 and err.value.code == "queue_timeout"
        finally:
            stop.set()
            thread.join(30)
        assert wait_until(lambda: engine.stats()["running"] == 0, 10)
        texts: dict[int, str] = {}
        stream = client.completions.create(model="", prompt=["Hi", "Hello"], max_tokens=60,
                                           logit_bias=NO_EOS, stream=True)
        with pytest.raises(openai.APIError) as err:
            for chunk in stream:
                for ch in chunk.choices:
                    texts[ch.index] = texts.get(ch.index, "") + ch.text
        assert texts.get(0) and 1 not in texts
        assert err.value.body["code"] == "queue_timeout"


def test_a_client_that_stops_reading_a_prompt_list_is_cancelled(loaded: Any) -> None:
    """The merge of the prompts' streams holds at most one event per prompt: the rest waits in
    the engine, whose max_backlog cancels both prompts of a client that reads nothing once
    their oldest unread events have waited past slow_client_timeout."""
    # a 500-character model name and logprobs make each chunk ~1 KB: the socket buffers are
    # full after a few dozen tokens; steps of 10 ms keep both generating well past the grace
    engine = engine_of(loaded, delay=0.01, max_batch=4, max_backlog=32, name="m" * 500,
                       slow_client_timeout=0.5)
    with engine, small_send_buffers(engine) as url:
        body = {"prompt": PROMPTS[:2], "stream": True, "max_tokens": 480, "logprobs": 5,
                "logit_bias": NO_EOS}
        sock = non_reading_stream(url, body, "/v1/completions")
        try:
            assert wait_until(lambda: engine.stats()["requests_finished"].get("error") == 2, 20)
            st = engine.stats()  # cancelled while its client still reads nothing
            assert st["running"] == 0 and st["slots_used"] == 0
            assert st["tokens_decoded"] < 2 * 400
            text = read_all(sock)
        finally:
            sock.close()
    data = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    assert json.loads(data[-2])["error"]["code"] == "client_too_slow"


# ----------------------------------------------------------------------------- default model

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", autouse=True)
def default_app(request: pytest.FixtureRequest) -> Iterator[Future[Any] | None]:
    """`python app.py --port 0` on the default model (16 slots), started with the module when a
    selected test of it asks for `default_app_url`: the server loads (seconds, in its own
    process) while the tiny-model tests above run; stopped with the module."""
    if not any("default_app_url" in item.fixturenames for item in request.session.items
               if getattr(item, "module", None) is request.module):
        yield None
        return
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import soak

    with ThreadPoolExecutor(1) as pool:
        started = pool.submit(soak.start_server, "smollm2", True, [])
        try:
            yield started
        finally:
            if started.exception(timeout=600) is None:
                soak.stop_server(started.result()[0])


@pytest.fixture
def default_app_url(default_app: Future[Any] | None) -> str:
    """The base URL of `default_app`, once it serves (its start's error, if it failed)."""
    assert default_app is not None
    return default_app.result(timeout=600)[1]


@pytest.mark.slow
def test_twenty_prompts_against_the_default_app_py(default_app_url: str) -> None:
    """`python app.py --port 0` (16 slots): a list of 20 prompts gets 20 choices, streamed
    and not."""
    client = openai.OpenAI(base_url=default_app_url + "/v1", api_key="unused", max_retries=0,
                           timeout=600)
    prompts = [f"The number {i} is" for i in range(20)]
    r = client.completions.create(model="", prompt=prompts, max_tokens=24, temperature=0)
    assert [c.index for c in r.choices] == list(range(20))
    assert all(c.text and c.finish_reason in ("stop", "length") for c in r.choices)
    texts, finish = streamed(client, model="", prompt=prompts, max_tokens=24, temperature=0)
    assert sorted(finish) == sorted(texts) == list(range(20))
    assert all(texts.values())
