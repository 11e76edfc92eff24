"""Load, faults and hostile input over real HTTP: queue limits and timeouts, model exceptions,
a dying engine thread, KV-slot exhaustion, a malicious chat template, clients that stop reading,
and graceful shutdown (stop() and SIGTERM)."""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_util import app_running, non_reading_stream, read_all, small_send_buffers, wait_until

from nbserve.engine import Engine
from nbserve.loading.hf_dir import load_hf_dir

ROOT = Path(__file__).resolve().parents[1]
MSG = [{"role": "user", "content": "Tell me a story."}]
OTHER_PROMPT = "Name three rivers of Europe and the seas they reach."
NO_EOS = {"2": -100, "0": -100}  # <|im_end|> and <|endoftext|> never sampled


# ----------------------------------------------------------------------------- helpers


class FaultyModel:
    """Wraps a StepModel: each forward sleeps `delay` s, blocks while `hang()` is in force
    (until `release()`), and raises `fail_with` once when it is set (and `fail_if(ids)` holds)."""

    def __init__(self, inner: Any, delay: float = 0.0):
        self.inner, self.delay = inner, delay
        self.gate = threading.Event()
        self.gate.set()
        self.blocked = threading.Event()  # a forward is waiting at the gate
        self.fail_with: BaseException | None = None
        self.fail_if: Any = None

    def hang(self) -> None:
        self.gate.clear()

    def release(self) -> None:
        self.gate.set()

    def forward(self, ids: Any, *args: Any, **kwargs: Any) -> Any:
        if not self.gate.is_set():
            self.blocked.set()
            self.gate.wait(30)
        if self.delay:
            time.sleep(self.delay)
        exc = self.fail_with
        if exc is not None and (self.fail_if is None or self.fail_if(ids)):
            self.fail_with = None
            raise exc
        return self.inner.forward(ids, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class Kill(BaseException):
    """Escapes every `except Exception`: kills the engine thread like a fatal error would."""


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir: Path) -> Any:
    return load_hf_dir(tiny_llama_dir)


def faulty_engine(loaded: Any, delay: float = 0.0, **options: Any) -> tuple[Engine, FaultyModel]:
    model = FaultyModel(loaded.model, delay)
    options.setdefault("max_batch", 4)
    options.setdefault("max_context", 512)
    return Engine(dataclasses.replace(loaded, model=model), quiet=True, **options), model


def chat(url: str, stream: bool = False, timeout: float = 60, **fields: Any) -> httpx.Response:
    body = {"messages": MSG, "max_tokens": 8, "stream": stream, **fields}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=timeout)


def sse_payloads(resp: httpx.Response) -> list[Any]:
    """The `data:` payloads of an SSE body: dicts, and "[DONE]" as a string."""
    out: list[Any] = []
    for line in resp.text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def assert_error(resp: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code, err
    return err


def engine_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("nbserve-engine")}


# ----------------------------------------------------------------------------- backpressure


def test_full_queue_answers_429_at_once_and_queue_timeout_is_a_clear_503(loaded: Any) -> None:
    engine, _ = faulty_engine(loaded, delay=0.01, max_batch=1, max_queue=2, queue_timeout=0.6)
    with engine, app_running(engine) as url, ThreadPoolExecutor(4) as pool:
        long = pool.submit(chat, url, True, max_tokens=150, logit_bias=NO_EOS)
        assert wait_until(lambda: engine.stats()["running"] == 1, 10)
        t0 = time.monotonic()
        waiting = [pool.submit(chat, url, stream) for stream in (False, True)]
        assert wait_until(lambda: engine.stats()["waiting"] == 2, 5)
        busy = chat(url)  # the queue (max_queue=2) is full: refused at once
        assert time.monotonic() - t0 < 0.6
        assert_error(busy, 429, "server_busy")
        assert int(busy.headers["retry-after"]) >= 1
        for fut in waiting:  # neither got a slot within queue_timeout: a 503 saying so
            err = assert_error(fut.result(), 503, "queue_timeout")
            assert "waited" in err["message"] and "queue_timeout=0.6" in err["message"]
            assert fut.result().headers["retry-after"]
        assert 0.6 <= time.monotonic() - t0 < 5
        first = sse_payloads(long.result())
        assert first[-1] == "[DONE]" and first[-2]["choices"][0]["finish_reason"] == "length"
        assert engine.stats()["waiting"] == 0
        assert httpx.get(url + "/health").json()["ready"] is True


def test_queue_timeout_is_an_engine_option(loaded: Any) -> None:
    with pytest.raises(ValueError, match="queue_timeout"):
        Engine(loaded, queue_timeout=0, quiet=True)
    with pytest.raises(ValueError, match="max_backlog"):
        Engine(loaded, max_backlog=0, quiet=True)


def test_a_client_that_stops_reading_is_cancelled_past_max_backlog(loaded: Any) -> None:
    """Once more than max_backlog events wait unread and the oldest has waited longer than
    slow_client_timeout, the request is cancelled; steps of 10 ms keep it generating well past
    that (480 tokens: 4.8 s at least)."""
    engine, _ = faulty_engine(loaded, delay=0.01, max_backlog=32, slow_client_timeout=0.5)
    with engine, small_send_buffers(engine) as url:
        # top_logprobs make each chunk ~1.5 KB: the buffers are full after a few dozen tokens
        sock = non_reading_stream(url, {"messages": MSG, "stream": True, "max_tokens": 480,
                                         "logprobs": True, "top_logprobs": 20,
                                         "logit_bias": NO_EOS})
        try:
            assert wait_until(lambda: engine.stats()["requests_finished"].get("error") == 1, 20)
            st = engine.stats()  # cancelled while its client still reads nothing
            assert st["running"] == 0 and st["slots_used"] == 0
            assert st["tokens_decoded"] < 400
            ok = chat(url, max_tokens=5, logit_bias=NO_EOS)  # the server is fine
            assert ok.status_code == 200
            text = read_all(sock)  # the client wakes up: its stream ends with the reason
        finally:
            sock.close()
        data = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
        assert data[-1] == "[DONE]"  # (the body is chunked: the lines between are sizes)
        last = json.loads(data[-2])
        assert last["error"]["code"] == "client_too_slow"
        assert "max_backlog=32" in last["error"]["message"]
        assert "slow_client_timeout=0.5 s" in last["error"]["message"]


def test_a_stream_read_by_a_stalled_event_loop_is_not_cancelled(loaded: Any) -> None:
    """A slow machine is not a slow client: the server's event loop stalls (a callback blocks
    it until the stream's unread events are five times max_backlog, well within the default
    slow_client_timeout), then reads on; the stream gets its whole answer, no error. (A count
    alone cancelled it at the ninth unread event.)"""
    engine, model = faulty_engine(loaded, max_backlog=8)
    body = {"messages": MSG, "stream": True, "max_tokens": 300, "logit_bias": NO_EOS,
            "stream_options": {"include_usage": True}}
    piled: list[int] = []
    with engine, app_running(engine) as url, \
            httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        model.hang()  # the answer cannot end before the stall begins
        (group,) = engine._groups.values()
        box = group.sink.__self__  # the Mailbox its consumer on the server's loop reads

        def stall() -> None:  # on the server's loop: nothing there runs until it returns
            model.release()
            wait_until(lambda: len(box.events) > 5 * 8, 10)
            piled.append(len(box.events))

        box.loop.call_soon_threadsafe(stall)
        payloads = [first[len("data: "):]] + [line[len("data: "):] for line in lines
                                              if line.startswith("data: ")]
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert [c["error"] for c in chunks if "error" in c] == []
    assert piled and piled[0] > 5 * 8  # the backlog went far past max_backlog meanwhile
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 300
    assert engine.stats()["requests_finished"].get("error") is None


def _stream_tokens(url: str, max_tokens: int) -> int:
    """Read one chat stream to its end; the completion tokens its usage reports."""
    body = {"messages": MSG, "max_tokens": max_tokens, "stream": True, "logit_bias": NO_EOS,
            "stream_options": {"include_usage": True}}
    tokens = 0
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[len("data: "):])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    return tokens


def _undelivered(engine: Engine) -> list[int]:
    """Events the engine holds for each async caller that has not taken them yet (the
    server's consumer of a stream is stuck in `send` once its client stops reading)."""
    return [len(g.sink.__self__.events) for g in list(engine._groups.values())
            if hasattr(g.sink, "__self__")]


@pytest.mark.slow
def test_a_slow_reader_does_not_hold_up_the_other_streams(tiny_llama_dir: Path) -> None:
    """A 5th stream that reads nothing (500 tokens) starts first; once its socket and transport
    buffers are full (~50 tokens: a 2000-character model name makes each chunk ~2.3 KB) its
    events pile up unsent. Meanwhile 4 streams that read run 150 tokens each to the end, while
    the blocked one keeps generating in the same batch: nothing waits for it. (How fast the 4
    run with and without it is a benchmark's question, not a test's.)"""
    engine, model = faulty_engine(load_hf_dir(tiny_llama_dir), max_batch=8, name="m" * 2000)
    slow_body = {"prompt": "a", "max_tokens": 500, "stream": True, "logit_bias": NO_EOS}
    with engine, small_send_buffers(engine, 4096) as url, ThreadPoolExecutor(4) as pool:
        sock = non_reading_stream(url, slow_body, "/v1/completions")
        try:
            assert wait_until(lambda: max(_undelivered(engine), default=0) >= 8, 10)
            # a backlog that keeps growing is a stuck consumer; one that a loaded machine's
            # lagging consumer still drains into the transport's buffer would not (a CI run
            # took its figure too early that way and saw 76 of the 150 tokens delivered)
            first = max(_undelivered(engine), default=0)
            assert wait_until(lambda: max(_undelivered(engine), default=0) >= first + 16, 10)
            stuck = max(_undelivered(engine))
            # the 4 join the batch together: held at the model while they queue, so a loaded
            # machine's staggered arrivals cannot leave the blocked one time to finish its 500
            # tokens first (a CI run saw it done, and nothing left to prove, on a fast machine)
            model.hang()
            assert model.blocked.wait(10)
            readers = [pool.submit(_stream_tokens, url, 150) for _ in range(4)]
            assert wait_until(lambda: engine.stats()["waiting"] == 4, 20)
            model.release()
            assert [r.result(timeout=120) for r in readers] == [150] * 4
            # still generating, and still not delivered: blocked all along, and never waited for
            assert engine.stats()["running"] == 1
            assert max(_undelivered(engine)) > stuck + 100
        finally:
            model.release()
            sock.close()
        assert wait_until(lambda: engine.stats()["running"] == 0, 20)


# ----------------------------------------------------------------------------- faults


def test_a_model_exception_fails_only_the_requests_of_that_step(loaded: Any) -> None:
    engine, model = faulty_engine(loaded, delay=0.005)
    with engine, app_running(engine) as url, ThreadPoolExecutor(4) as pool:
        running = [pool.submit(chat, url, stream, max_tokens=120, logit_bias=NO_EOS)
                   for stream in (False, True)]
        assert wait_until(lambda: engine.stats()["tokens_decoded"] >= 4, 10)
        # the next prefill: the new request only. Its prompt differs from the running ones', or
        # prefix reuse to the token would leave it one token to prefill, as a decode row has
        model.fail_if = lambda ids: ids.shape[1] > 1
        model.fail_with = RuntimeError("injected fault")
        failed = chat(url, max_tokens=120, messages=[{"role": "user", "content": OTHER_PROMPT}])
        err = assert_error(failed, 500, "internal_error")
        assert "injected fault" in err["message"]
        assert failed.headers["x-request-id"] in err["message"]
        plain, streamed = (f.result() for f in running)
        assert plain.status_code == 200
        assert plain.json()["usage"]["completion_tokens"] == 120
        payloads = sse_payloads(streamed)
        assert payloads[-1] == "[DONE]" and payloads[-2]["choices"][0]["finish_reason"] == "length"
        assert engine.stats()["model_errors"] == 1
        assert chat(url).status_code == 200
        assert httpx.get(url + "/health").json()["ready"] is True


def _kill_by_model(engine: Engine, model: FaultyModel) -> None:
    model.fail_with = Kill()
    model.release()


def _kill_by_async_exception(engine: Engine, model: FaultyModel) -> None:
    """Raise SystemExit inside the engine thread from outside, as a debugger or a fatal
    signal handler could; it lands when the blocked forward returns to Python code."""
    ident = ctypes.c_ulong(engine._thread.ident)
    assert ctypes.pythonapi.PyThreadState_SetAsyncExc(ident, ctypes.py_object(SystemExit)) == 1
    model.release()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("kill", [_kill_by_model, _kill_by_async_exception],
                         ids=["model raises BaseException", "async exception in the thread"])
def test_a_dead_engine_thread_is_reported_and_restarts(loaded: Any, kill: Any) -> None:
    before = engine_threads()
    engine, model = faulty_engine(loaded, max_batch=1)
    engine.restart_delay = 0.8
    with engine, app_running(engine) as url, ThreadPoolExecutor(4) as pool:
        assert chat(url).status_code == 200
        model.hang()
        in_flight = pool.submit(chat, url, True, max_tokens=50)
        assert model.blocked.wait(10)
        queued = pool.submit(chat, url, False, max_tokens=50)
        assert wait_until(lambda: engine.stats()["waiting"] == 1, 5)
        kill(engine, model)
        assert wait_until(lambda: httpx.get(url + "/health").status_code == 503, 5)
        health = httpx.get(url + "/health").json()
        assert health["ready"] is False and health["status"] == "restarting"
        refused = assert_error(chat(url), 503, "engine_unavailable")
        assert "restarting" in refused["message"]
        payloads = sse_payloads(in_flight.result())  # started: an error event, then [DONE]
        assert payloads[-1] == "[DONE]" and "restarted" in payloads[-2]["error"]["message"]
        assert_error(queued.result(), 503, "engine_unavailable")  # not started: a 503
        assert wait_until(lambda: httpx.get(url + "/health").status_code == 200, 10)
        assert httpx.get(url + "/health").json()["restarts"] == 1
        ok = chat(url, max_tokens=6, logit_bias=NO_EOS)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 6
        st = engine.stats()
        assert st["running"] == 0 and st["waiting"] == 0 and st["slots_used"] == 0
        assert len(engine_threads() - before) == 1  # the new engine thread; no timer left
    assert wait_until(lambda: engine_threads() <= before, 5)


def test_a_stuck_forward_fails_what_is_in_flight_and_the_engine_recovers(loaded: Any) -> None:
    engine, model = faulty_engine(loaded, max_batch=1, step_timeout=0.5)
    with engine, app_running(engine) as url, ThreadPoolExecutor(4) as pool:
        assert chat(url).status_code == 200
        model.hang()  # the next forward never returns (until released)
        in_flight = pool.submit(chat, url, True, max_tokens=50)
        assert model.blocked.wait(10)
        queued = pool.submit(chat, url, False, max_tokens=50)
        assert wait_until(lambda: httpx.get(url + "/health").status_code == 503, 10)
        assert httpx.get(url + "/health").json()["status"] == "stalled"
        payloads = sse_payloads(in_flight.result(timeout=10))  # not left hanging
        assert payloads[-1] == "[DONE]" and "stuck" in payloads[-2]["error"]["message"]
        assert_error(queued.result(timeout=10), 503, "engine_unavailable")
        refused = assert_error(chat(url), 503, "engine_unavailable")
        assert "step_timeout=0.5" in refused["message"]
        model.release()  # the stuck forward returns: the engine serves again
        assert wait_until(lambda: httpx.get(url + "/health").status_code == 200, 10)
        ok = chat(url, max_tokens=6, logit_bias=NO_EOS)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 6
        st = engine.stats()
        assert st["running"] == 0 and st["waiting"] == 0 and st["slots_used"] == 0


def test_step_timeout_is_checked(loaded: Any) -> None:
    for bad in (0, -1, "10"):
        with pytest.raises(ValueError, match="step_timeout must be a number of seconds > 0"):
            faulty_engine(loaded, step_timeout=bad)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_engine_thread_without_restart_stays_unavailable(loaded: Any) -> None:
    engine, model = faulty_engine(loaded, max_batch=1, restart_on_failure=False)
    with engine, app_running(engine) as url, ThreadPoolExecutor(2) as pool:
        model.hang()
        in_flight = pool.submit(chat, url, False, max_tokens=50)
        assert model.blocked.wait(10)
        _kill_by_model(engine, model)
        assert_error(in_flight.result(), 503, "engine_unavailable")
        time.sleep(0.3)
        assert httpx.get(url + "/health").status_code == 503
        err = assert_error(chat(url), 503, "engine_unavailable")
        assert "create a new Engine" in err["message"]
        assert not engine._thread.is_alive()


def test_kv_slot_exhaustion_queues_requests_instead_of_failing_them(loaded: Any) -> None:
    engine, _ = faulty_engine(loaded, max_batch=2)
    with engine, app_running(engine) as url, ThreadPoolExecutor(10) as pool:
        answers = list(pool.map(lambda i: chat(url, i % 2 == 1, max_tokens=24,
                                               logit_bias=NO_EOS), range(10)))
        for i, resp in enumerate(answers):
            assert resp.status_code == 200, resp.text
            if i % 2:
                payloads = sse_payloads(resp)
                assert payloads[-2]["choices"][0]["finish_reason"] == "length"
            else:
                assert resp.json()["usage"]["completion_tokens"] == 24
        st = engine.stats()
        assert st["requests_finished"] == {"length": 10} and st["requests_rejected"] == 0


# ----------------------------------------------------------------------------- hostile input

MALICIOUS_TEMPLATES = {
    "cycler globals os.popen": "{{ cycler.__init__.__globals__.os.popen('touch MARKER').read() }}",
    "str mro subclasses": "{{ ''.__class__.__mro__[1].__subclasses__() }}"
                          "{{ open('MARKER', 'w') }}",
}


@pytest.mark.parametrize("template", list(MALICIOUS_TEMPLATES.values()),
                         ids=list(MALICIOUS_TEMPLATES))
def test_a_malicious_chat_template_gets_a_400_and_runs_nothing(tiny_llama_dir: Path,
                                                               tmp_path: Path,
                                                               template: str) -> None:
    model_dir = tmp_path / "evil-model"
    shutil.copytree(tiny_llama_dir, model_dir)
    marker = tmp_path / "pwned"
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = template.replace("MARKER", str(marker))
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    engine = Engine(load_hf_dir(model_dir), max_batch=2, max_context=256, quiet=True)
    with engine, app_running(engine) as url:
        err = assert_error(chat(url), 400)
        assert err["param"] == "messages" and "sandbox" in err["message"]
        assert not marker.exists()
        raw = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert raw.status_code == 200  # no template involved: still serves
        assert httpx.get(url + "/health").json()["ready"] is True
    assert not marker.exists()


def test_unicode_line_separators_cannot_split_an_sse_line(loaded: Any) -> None:
    """U+2028, U+2029 and U+0085 end a line for str.splitlines (httpx's iter_lines): the
    server escapes them inside each `data:` line, so every line stays one JSON document."""
    engine = Engine(loaded, max_batch=2, max_context=256, quiet=True)
    body = {"prompt": "a\u2028b\u2029c\x85d", "echo": True, "stream": True, "max_tokens": 3}
    with engine, app_running(engine) as url, \
            httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as resp:
        lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    assert chunks[0]["choices"][0]["text"] == body["prompt"]


# ----------------------------------------------------------------------------- shutdown


def _thread_names() -> set[str]:
    return {t.name for t in threading.enumerate()}


def test_stop_refuses_new_work_finishes_short_requests_and_cancels_long_ones(loaded: Any,
                                                                            capsys: Any) -> None:
    from nbserve.serving.launch import launch

    before = _thread_names()
    srv = launch(dataclasses.replace(loaded, model=FaultyModel(loaded.model, 0.02)), ui=False,
                 max_batch=4, max_context=512)
    url = srv.url
    with ThreadPoolExecutor(4) as pool:
        long_stream = pool.submit(chat, url, True, max_tokens=400, logit_bias=NO_EOS)
        long_plain = pool.submit(chat, url, False, max_tokens=400, logit_bias=NO_EOS)
        short = pool.submit(chat, url, False, max_tokens=30, logit_bias=NO_EOS)
        assert wait_until(lambda: srv.engine.stats()["running"] == 3, 10)
        t0 = time.monotonic()
        stopping = pool.submit(srv.stop, 1.5)
        assert wait_until(lambda: not srv.app.state.accepting, 2)
        refused = assert_error(chat(url), 503, "shutting_down")
        assert "shutting down" in refused["message"]
        assert httpx.get(url + "/health").status_code == 503
        stopping.result(timeout=15)
        elapsed = time.monotonic() - t0
        assert 1.5 <= elapsed < 6, elapsed
        # finished within the grace period: a normal answer
        assert short.result().json()["choices"][0]["finish_reason"] == "length"
        assert short.result().json()["usage"]["completion_tokens"] == 30
        # cancelled: the text so far, a finish_reason, and a stream that ends properly
        plain = long_plain.result().json()
        assert long_plain.result().status_code == 200
        assert plain["choices"][0]["finish_reason"] == "stop"
        assert 0 < plain["usage"]["completion_tokens"] < 400
        assert plain["choices"][0]["message"]["content"]
        payloads = sse_payloads(long_stream.result())
        assert payloads[-1] == "[DONE]"
        assert payloads[-2]["choices"][0]["finish_reason"] == "stop"
        assert "cancelled 2 request(s)" in capsys.readouterr().out
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health", timeout=2)
    assert wait_until(lambda: _thread_names() <= before, 5), _thread_names() - before


SERVE_SCRIPT = """
import dataclasses, sys, threading, time
sys.path.insert(0, {tests!r})
from test_reliability import FaultyModel
from nbserve.loading.hf_dir import load_hf_dir
import nbserve

loaded = load_hf_dir({model_dir!r})
loaded = dataclasses.replace(loaded, model=FaultyModel(loaded.model, 0.02))
nbserve.serve(loaded, port=0, ui=False, max_batch=2, max_context=512, stop_timeout=1.0)
print("THREADS", sorted(t.name for t in threading.enumerate()), flush=True)
"""


@pytest.mark.slow
def test_sigterm_to_serve_drains_cancels_and_exits_0(tiny_llama_dir: Path) -> None:
    script = SERVE_SCRIPT.format(tests=str(ROOT / "tests"), model_dir=str(tiny_llama_dir))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = None
        for line in proc.stdout:  # type: ignore[union-attr]
            if " at http://" in line:
                url = line.split(" at ")[1].split()[0]
                break
        assert url, "serve() never printed its URL"
        with ThreadPoolExecutor(2) as pool:
            stream = pool.submit(chat, url, True, max_tokens=400, logit_bias=NO_EOS)
            assert wait_until(lambda: httpx.get(url + "/stats").json()["running"] == 1, 10)
            proc.send_signal(signal.SIGTERM)
            assert wait_until(lambda: httpx.get(url + "/health").status_code == 503, 2)
            assert_error(chat(url), 503, "shutting_down")
            payloads = sse_payloads(stream.result())
        assert payloads[-1] == "[DONE]" and payloads[-2]["choices"][0]["finish_reason"] == "stop"
        assert proc.wait(timeout=20) == 0
        out = proc.stdout.read()  # type: ignore[union-attr]
        assert "cancelled 1 request(s)" in out
        threads = next(line for line in out.splitlines() if line.startswith("THREADS"))
        left = set(json.loads(threads[len("THREADS "):].replace("'", '"')))
        assert left <= {"MainThread", "tqdm_monitor"}, out  # (tqdm's: the loader's bar)
    finally:
        proc.kill()
        proc.wait()
