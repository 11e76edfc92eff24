"""Long chats in the UI: the oldest whole turns are left out so that the prompt plus max_tokens
fits the model's context, with a short note in the chat that never reaches the model."""

from __future__ import annotations

from typing import Any

import pytest
from gradio_client import Client
from server_util import engine_running
from test_ui import FakeBackend, collect

from nbserve.serving.ui import make_chat_fn
from nbserve.serving.ui_answer import ERROR_PREFIX
from nbserve.types import Request

NOTE = "Older turns were left out"


class Recording:
    """A real backend that remembers the requests it was given (and counts their tokens)."""

    def __init__(self, backend: Any):
        self.backend, self.requests = backend, []

    def generate(self, request: Request):
        self.requests.append(request)
        return self.backend.generate(request)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)


class CountingFake(FakeBackend):
    """FakeBackend whose prompt counts one token per word (plus one per message)."""

    def count_prompt_tokens(self, request: Request) -> int:
        return sum(1 + len(m["content"].split()) for m in request.messages)


def turns(n: int, words: int = 10) -> list[dict[str, Any]]:
    history = []
    for i in range(n):
        history += [{"role": "user", "content": f"q{i} " + "u " * words},
                    {"role": "assistant", "content": f"a{i} " + "w " * words}]
    return history


@pytest.fixture(scope="module")
def small_engine(tiny_llama_dir: Any):
    with engine_running(tiny_llama_dir, max_batch=2, max_context=160) as engine:
        yield engine


# ----------------------------------------------------------------------------- the chat function


async def test_oldest_whole_turns_are_dropped_to_fit_prompt_plus_max_tokens():
    backend = CountingFake(words=2)
    backend.max_context = 100
    chat = make_chat_fn(backend)
    # system 3 + 6 turns * 24 + newest 2 = 149 tokens; with max_tokens 20 it must drop
    # 3 turns (149 - 72 = 77 <= 80), not fewer
    out = await collect(chat("newest", turns(6), "be brief", 0.0, 1.0, 20))
    sent = backend.requests[0].messages
    assert sent[0] == {"role": "system", "content": "be brief"}
    assert sent[-1] == {"role": "user", "content": "newest"}
    assert [m["content"].split()[0] for m in sent[1:-1]] == ["q3", "a3", "q4", "a4", "q5", "a5"]
    assert backend.count_prompt_tokens(backend.requests[0]) + 20 <= 100
    text = out[-1][0]
    assert NOTE in text and "100-token context" in text and text.endswith("w0 w1 ")
    assert all(NOTE in t for t, _ in out)  # visible from the first streamed token on


async def test_the_note_is_never_sent_back_to_the_model():
    backend = CountingFake(words=2)
    backend.max_context = 100
    chat = make_chat_fn(backend)
    history = turns(6)
    answer = (await collect(chat("newest", history, "", 0.0, 1.0, 20)))[-1][0]
    assert NOTE in answer
    history += [{"role": "user", "content": "newest"}, {"role": "assistant", "content": answer}]
    await collect(chat("and more", history, "", 0.0, 1.0, 20))
    sent = backend.requests[1].messages
    assert sent[-2] == {"role": "assistant", "content": "w0 w1 "}  # the answer, not the note
    assert all(NOTE not in m["content"] for m in sent)


async def test_a_chat_that_fits_is_sent_whole_without_a_note():
    backend = CountingFake(words=2)
    backend.max_context = 1000
    out = await collect(make_chat_fn(backend)("newest", turns(6), "sys", 0.0, 1.0, 20))
    assert len(backend.requests[0].messages) == 1 + 12 + 1
    assert NOTE not in out[-1][0]


async def test_a_conversation_over_the_character_limit_drops_old_turns_too():
    from nbserve.api.limits import Limits

    backend = CountingFake(words=2)
    chat = make_chat_fn(backend, limits=Limits(max_conversation_chars=100, max_messages=7))
    out = await collect(chat("newest", turns(6), "", 0.0, 1.0, 20))
    sent = backend.requests[0].messages  # 23 characters a message: two turns and the newest
    assert len(sent) == 5 and sum(len(m["content"]) for m in sent) <= 100
    assert sent[0]["role"] == "user" and sent[-1]["content"] == "newest"
    assert NOTE in out[-1][0] and "size limits" in out[-1][0]


# ----------------------------------------------------------------------------- a real model


async def test_real_engine_long_chat_keeps_answering(small_engine):
    backend = Recording(small_engine)
    chat = make_chat_fn(backend)
    history = turns(8, words=20)
    out = await collect(chat("newest question", history, "You are terse.", 0.0, 1.0, 40))
    text, speed = out[-1]
    assert not text.startswith(ERROR_PREFIX) and "tokens/s" in speed, text
    assert NOTE in text and "160-token context" in text
    request = backend.requests[-1]
    assert request.messages[0]["content"] == "You are terse."
    assert request.messages[-1]["content"] == "newest question"
    assert [m["role"] for m in request.messages[1:-1]] == ["user", "assistant"] * \
        ((len(request.messages) - 2) // 2)
    assert small_engine.count_prompt_tokens(request) + 40 <= small_engine.max_context


async def test_real_engine_newest_message_alone_too_long_is_the_context_error(small_engine):
    out = await collect(make_chat_fn(small_engine)("word " * 400, turns(2), "", 0.0, 1.0, 8))
    text, speed = out[-1]
    assert text.startswith(ERROR_PREFIX) and "maximum context length is 160 tokens" in text
    assert NOTE not in text and "failed" in speed


def test_count_prompt_tokens_matches_what_the_engine_prefills(small_engine):
    req = Request(messages=[{"role": "user", "content": "hello there"}])
    assert small_engine.count_prompt_tokens(req) == len(small_engine.prepare_prompt(req))
    long = Request(messages=[{"role": "user", "content": "word " * 400}])
    assert small_engine.count_prompt_tokens(long) > small_engine.max_context  # counts, no raise


# ----------------------------------------------------------------------------- gradio_client


def test_gradio_client_long_chat_goes_on_with_a_note(tiny_llama_dir):
    from test_launch import rambling  # answers always run to max_tokens

    from nbserve.serving.launch import launch

    srv = launch(rambling(tiny_llama_dir), max_batch=2, max_context=200)
    try:
        client = Client(srv.url + "/", verbose=False)
        try:
            noted = []
            for i in range(5):
                text, speed = client.predict(f"question {i}", "Be brief.", 0.0, 1.0, 60,
                                             api_name="/chat")
                assert not text.startswith(ERROR_PREFIX) and "tokens/s" in speed, (i, text)
                noted.append(NOTE in text)
            assert noted[0] is False and any(noted), noted
            text, speed = client.predict("word " * 400, "", 0.0, 1.0, 8, api_name="/chat")
            assert text.startswith(ERROR_PREFIX) and "maximum context length" in text
        finally:
            client.close()
    finally:
        srv.stop()


async def test_long_chat_through_a_pool_behind_launchs_swappable_backend(tiny_llama_dir):
    from nbserve.pool import Pool
    from nbserve.serving.backend_ref import SwappableBackend

    with Pool(str(tiny_llama_dir), devices=["cpu", "cpu"], max_batch=2, max_context=160,
              quiet=True) as pool:
        backend = SwappableBackend(pool)
        req = Request(messages=[{"role": "user", "content": "word " * 400}])
        assert backend.count_prompt_tokens(req) == pool.engines[0].count_prompt_tokens(req)
        out = await collect(make_chat_fn(backend)("newest", turns(8, words=20), "", 0.0, 1.0, 20))
        text, speed = out[-1]
        assert NOTE in text and "160-token context" in text and "tokens/s" in speed, text


async def test_a_backend_that_cannot_count_tokens_is_served_untrimmed():
    from nbserve.serving.backend_ref import SwappableBackend

    backend = FakeBackend()  # no count_prompt_tokens: nothing to fit by, so nothing left out
    out = await collect(make_chat_fn(SwappableBackend(backend))("newest", turns(40), "", 0.0,
                                                                1.0, 20))
    assert "tokens/s" in out[-1][1] and NOTE not in out[-1][0]
    assert len(backend.requests[0].messages) == 81
