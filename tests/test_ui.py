"""The Gradio chat: message building, the streaming chat function, Stop, errors, gradio_client."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from nbserve.serving.ui import make_chat_fn
from nbserve.serving.ui_answer import ERROR_PREFIX, to_messages
from nbserve.types import (
    BackendDefaults,
    BusyError,
    ContextLengthError,
    Delta,
    ErrorEvent,
    Finished,
    Request,
    Started,
    Usage,
)


class FakeBackend(BackendDefaults):
    """Streams "w0 w1 ..." one word per token; records requests, aborts and what is running."""

    model_name = "fake-model"
    max_context = 300

    def __init__(self, words: int = 5, delay: float = 0.0, fail: Exception | None = None,
                 error_after: int | None = None):
        self.words, self.delay, self.fail, self.error_after = words, delay, fail, error_after
        self.requests: list[Request] = []
        self.running = self.aborted = 0

    async def generate(self, request: Request):
        self.requests.append(request)
        if self.fail is not None:
            raise self.fail
        yield Started(request.request_id, 3, 0)
        self.running += 1
        done = False
        try:
            n = min(self.words, request.params.max_tokens or self.words)
            for i in range(n):
                if self.delay:
                    await asyncio.sleep(self.delay)
                if i == self.error_after:
                    yield ErrorEvent("the engine was stopped", "service_unavailable")
                    done = True
                    return
                yield Delta(0, f"w{i} ", [i])
            done = True
            yield Finished(0, "length", Usage(3, n))
        finally:
            self.running -= 1
            self.aborted += not done

    def stats(self) -> dict[str, Any]:
        return {"running": self.running, "max_context": self.max_context}

    def health(self) -> dict[str, Any]:
        return {"ready": True}

    def close(self) -> None:
        pass


async def collect(gen) -> list[tuple[Any, Any]]:
    return [item async for item in gen]


# ----------------------------------------------------------------------------- messages


def test_to_messages_builds_multi_turn_chat_with_system_prompt():
    history = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "text", "text": "hello!"}]},
        {"role": "user", "content": [{"type": "file", "file": {"path": "/x.png"}}]},
        {"role": "assistant", "content": ERROR_PREFIX + "The server is busy."},
        {"role": "user", "content": "and now?"},
        {"role": "assistant", "content": "partial\n\n" + ERROR_PREFIX + "the engine was stopped"},
    ]
    msgs = to_messages("last one", history, "  Be brief.  ")
    assert msgs == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello!"},
        {"role": "user", "content": "and now?"},
        {"role": "assistant", "content": "partial"},
        {"role": "user", "content": "last one"},
    ]
    assert to_messages("x", [], "   ") == [{"role": "user", "content": "x"}]


# ----------------------------------------------------------------------------- chat function


async def test_chat_streams_cumulative_text_then_speed_line():
    backend = FakeBackend(words=4)
    out = await collect(make_chat_fn(backend)("hi", [], "sys", 0.3, 0.8, 100))
    texts = [t for t, _ in out]
    assert texts == ["w0 ", "w0 w1 ", "w0 w1 w2 ", "w0 w1 w2 w3 ", "w0 w1 w2 w3 "]
    assert "4 tokens" in out[-1][1] and "tokens/s" in out[-1][1]
    assert out[0][1].startswith("Answering: 1 tokens")  # progress from the first token on
    params = backend.requests[0].params
    assert (params.temperature, params.top_p, params.max_tokens) == (0.3, 0.8, 100)
    assert backend.requests[0].messages[0] == {"role": "system", "content": "sys"}


def test_stop_turns_the_progress_line_into_a_stopped_answer():
    from nbserve.serving.ui import mark_stopped

    line = "Answering: 120 tokens in 3.0 s, **40.0 tokens/s**"
    assert mark_stopped(line) == "Last answer (stopped): 120 tokens in 3.0 s, **40.0 tokens/s**"
    assert "stopped before the first token" in mark_stopped("Last answer: 9 tokens in 1 s")
    assert "stopped before the first token" in mark_stopped("")


@pytest.mark.parametrize("exc, needle", [
    (ContextLengthError(9000, 512), "maximum context length is 512 tokens"),
    (BusyError(), "busy"),
])
async def test_refused_requests_become_readable_chat_messages(exc, needle):
    out = await collect(make_chat_fn(FakeBackend(fail=exc))("hi", []))
    assert len(out) == 1
    text, speed = out[0]
    assert text.startswith(ERROR_PREFIX) and needle in text
    assert "Traceback" not in text and "failed" in speed


async def test_error_event_mid_stream_keeps_the_partial_answer():
    out = await collect(make_chat_fn(FakeBackend(words=5, error_after=2))("hi", []))
    assert out[-1][0] == "w0 w1 \n\n" + ERROR_PREFIX + "the engine was stopped"


async def test_unexpected_exception_is_one_line_not_a_traceback():
    out = await collect(make_chat_fn(FakeBackend(fail=KeyError("boom")))("hi", []))
    assert out[-1][0].startswith(ERROR_PREFIX + "internal error (KeyError")


async def test_closing_the_chat_generator_aborts_the_backend_stream():
    backend = FakeBackend(words=1000, delay=0.001)
    gen = make_chat_fn(backend)("hi", [])
    for _ in range(3):
        await gen.__anext__()
    assert backend.running == 1
    await gen.aclose()  # what gradio does on Stop
    assert backend.running == 0 and backend.aborted == 1


async def test_stop_frees_the_engine_slot(tiny_llama_dir):
    from test_launch import rambling  # never samples end-of-text: still running when checked

    from nbserve.engine import Engine

    engine = Engine(rambling(tiny_llama_dir), max_batch=2)
    try:
        gen = make_chat_fn(engine)("tell me a story", [], "", 1.0, 1.0, 400)
        await gen.__anext__()
        assert engine.stats()["running"] == 1
        await gen.aclose()
        deadline = time.monotonic() + 5
        while engine.stats()["running"] and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert engine.stats()["running"] == 0
        assert engine.stats()["requests_finished"].get("cancelled") == 1
        # too long for the context: a readable message, and the engine keeps serving
        out = await collect(make_chat_fn(engine)("word " * 1500, []))
        assert "maximum context length" in out[-1][0]
        out = await collect(make_chat_fn(engine)("hi", [], "", 0.0, 1.0, 8))
        assert "tokens/s" in out[-1][1]
    finally:
        engine.close()


# ----------------------------------------------------------------------------- mounted


def test_ui_is_mounted_after_api_routes_and_answers_gradio_client(tiny_llama_dir):
    from gradio_client import Client
    from test_launch import rambling  # the tiny model, never ending an answer by itself

    from nbserve.serving.launch import launch

    srv = launch(rambling(tiny_llama_dir), max_batch=4)
    try:
        page = httpx.get(srv.url + "/")
        assert page.status_code == 200 and "<html" in page.text
        assert httpx.get(srv.url + "/config").json()["title"] == "nbserve · tiny-llama"
        assert httpx.get(srv.api_base + "/models").status_code == 200  # /v1 not shadowed
        client = Client(srv.url + "/", verbose=False)
        try:
            text, speed = client.predict("hi", "Be brief.", 0.0, 1.0, 12, api_name="/chat")
            assert isinstance(text, str) and text and "tokens/s" in speed
            # the client keeps the conversation: this turn sees the first one, and runs (with
            # the default settings: half the context) to max_tokens
            text, speed = client.predict("hi again", api_name="/chat")
            assert "tokens/s" in speed and "ended by length" in speed, text
            assert not text.startswith("_(Older turns")
            # now the history no longer fits with max_tokens: the oldest turns are left out
            text, speed = client.predict("and now?", api_name="/chat")
            assert text.startswith("_(Older turns were left out to fit the model's 512-token")
            assert "tokens/s" in speed
            # a message too long on its own: a readable message, not a stack trace
            text, speed = client.predict("word " * 1500, api_name="/chat")
            assert text.startswith(ERROR_PREFIX) and "maximum context length" in text
            assert "failed" in speed
            assert srv.engine.stats()["running"] == 0
        finally:
            client.close()
    finally:
        srv.stop()


def test_ui_behind_api_keys_needs_a_login(tiny_llama_dir):
    from gradio_client import Client
    from gradio_client.exceptions import AuthenticationError

    from nbserve.serving.launch import launch

    srv = launch(str(tiny_llama_dir), api_keys=["sk-test-1"], max_batch=2)
    try:
        assert httpx.get(srv.url + "/config").status_code == 401
        with pytest.raises((AuthenticationError, ValueError), match="Could not login"):
            Client(srv.url + "/", verbose=False, auth=("me", "wrong"))
        client = Client(srv.url + "/", verbose=False, auth=("anyone", "sk-test-1"))
        try:
            text, _ = client.predict("hi", "", 0.0, 1.0, 4, api_name="/chat")
            assert isinstance(text, str)
        finally:
            client.close()
        assert httpx.get(srv.api_base + "/models").status_code == 401
        ok = httpx.get(srv.api_base + "/models", headers={"Authorization": "Bearer sk-test-1"})
        assert ok.status_code == 200
    finally:
        srv.stop()
