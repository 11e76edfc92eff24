"""End to end with the real default model (SmolLM2-135M-Instruct) through the OpenAI SDK."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
from server_util import running_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def default_client(default_loaded: Any) -> Iterator[openai.OpenAI]:
    from nbserve.engine import Engine
    from nbserve.server import create_app

    engine = Engine(default_loaded, max_batch=4, max_context=1024, quiet=True)
    try:
        with running_server(create_app(engine, ui=False)) as url:
            yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                                timeout=120)
    finally:
        engine.close()


def test_short_chat_answer_in_english(default_client: openai.OpenAI) -> None:
    r = default_client.chat.completions.create(
        model="", messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24, temperature=0)
    text = r.choices[0].message.content
    assert "Paris" in text, text
    assert text.isascii() and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 24


def test_streamed_answer_has_no_replacement_characters(default_client: openai.OpenAI) -> None:
    deltas: list[str] = []
    stream: Any = default_client.chat.completions.create(
        model="", stream=True, max_tokens=48, temperature=0.7, seed=0,
        messages=[{"role": "user", "content": "Say hello in French, Japanese and with emoji."}])
    for chunk in stream:
        for ch in chunk.choices:
            deltas.append(ch.delta.content or "")
    assert "".join(deltas).strip()
    assert not any("\ufffd" in d for d in deltas), deltas
