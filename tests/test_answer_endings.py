"""How an answer ends, over a real server with the official openai SDK: text held back for a
possible stop string is not lost when end-of-text ends the answer, and an answer that max_tokens
cuts inside a character ends without a U+FFFD the model did not mean.

A scripted model (its greedy output is whatever the test says) serves the exact token sequences;
the real default model shows the cut character on a real answer (slow)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import torch
from server_util import app_running, running_server
from tiny_models import IM_END_ID, IM_START_ID, make_tiny_tokenizer, utf8_cut
from torch import nn

from nbserve.engine import Engine
from nbserve.models.adapters import RecomputeAdapter
from nbserve.models.adopt import adopt
from nbserve.text import Tokenizer
from nbserve.types import Delta, Finished, Request, SamplingParams

VOCAB = 640  # the tiny tokenizer's
# chat: the messages' text, then <|im_start|>, after which the scripted answer begins
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}<|im_start|>"
USER = [{"role": "user", "content": "Go."}]


class ScriptedModel(nn.Module):
    """forward(idx) -> logits whose argmax, after the last `marker` token of a sequence, spells
    `script`, then `end` forever."""

    def __init__(self, script: list[int], marker: int = IM_START_ID, end: int = IM_END_ID):
        super().__init__()
        self.script, self.marker, self.end = list(script), marker, end
        self.anchor = nn.Parameter(torch.zeros(1))  # gives the adapter a device and dtype

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(*idx.shape, VOCAB)
        for r, row in enumerate(idx.tolist()):
            after = None  # tokens since the marker
            for p, tok in enumerate(row):
                after = 0 if tok == self.marker else None if after is None else after + 1
                k = -1 if after is None else after
                logits[r, p, self.script[k] if 0 <= k < len(self.script) else self.end] = 100.0
        return logits


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(make_tiny_tokenizer(), eos_token_ids=[IM_END_ID])


@pytest.fixture
def serve(tokenizer: Tokenizer) -> Iterator[Any]:
    """serve(text or token ids, end=<|im_end|>) -> (engine, openai client) for a server whose
    model answers exactly that, then `end` forever (end-of-text by default)."""
    with contextlib.ExitStack() as stack:

        def start(answer: str | list[int], end: int = IM_END_ID
                  ) -> tuple[Engine, openai.OpenAI]:
            ids = tokenizer.encode(answer) if isinstance(answer, str) else answer
            step = RecomputeAdapter(ScriptedModel(ids, end=end), max_context=128,
                                    vocab_size=VOCAB, warn=False)
            engine = stack.enter_context(Engine(
                adopt(step, tokenizer, chat_template=TEMPLATE, name="scripted", verbose=False),
                max_batch=2, quiet=True))
            url = stack.enter_context(app_running(engine))
            client = stack.enter_context(openai.OpenAI(base_url=url + "/v1", api_key="unused",
                                                       max_retries=0))
            return engine, client

        yield start


def chat_text(client: openai.OpenAI, stream: bool, **kw: Any) -> tuple[str, str]:
    """(content, finish_reason) of a chat answer, streamed or not."""
    if not stream:
        r = client.chat.completions.create(model="", messages=USER, **kw)
        return r.choices[0].message.content, r.choices[0].finish_reason
    text, finish = "", None
    for chunk in client.chat.completions.create(model="", messages=USER, stream=True, **kw):
        for ch in chunk.choices:
            text += ch.delta.content or ""
            finish = ch.finish_reason or finish
    return text, finish


def completion_text(client: openai.OpenAI, stream: bool, **kw: Any) -> tuple[str, str]:
    """(text, finish_reason) of a completion of "Go.<|im_start|>", streamed or not."""
    if not stream:
        r = client.completions.create(model="", prompt="Go.<|im_start|>", **kw)
        return r.choices[0].text, r.choices[0].finish_reason
    text, finish = "", None
    for chunk in client.completions.create(model="", prompt="Go.<|im_start|>", stream=True, **kw):
        for ch in chunk.choices:
            text += ch.text
            finish = ch.finish_reason or finish
    return text, finish


# ----------------------------------------------------------------------------- stop strings


@pytest.mark.parametrize("ask", [chat_text, completion_text])
@pytest.mark.parametrize("stream", [False, True])
def test_end_of_text_keeps_the_text_held_for_a_stop_string(serve: Any, ask: Any,
                                                          stream: bool) -> None:
    """"Hello U" then end-of-text, with stop=["User:"]: "U" was held back in case "User:"
    followed; the answer ends without it, so "U" is part of the answer."""
    _, client = serve("Hello U")
    assert ask(client, stream, stop=["User:"], max_tokens=20, temperature=0) == \
        ("Hello U", "stop")


@pytest.mark.parametrize("ask", [chat_text, completion_text])
@pytest.mark.parametrize("stream", [False, True])
def test_end_of_text_keeps_a_replacement_character_the_model_wrote(serve: Any, ask: Any,
                                                                   stream: bool) -> None:
    """The detokenizer holds a text ending in U+FFFD back until the next token; when that
    token is end-of-text, a U+FFFD the model spelled (EF BF BD) is still the answer's end."""
    _, client = serve("ok \ufffd")
    assert ask(client, stream, max_tokens=20, temperature=0) == ("ok \ufffd", "stop")


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_still_ends_the_answer_before_it(serve: Any, stream: bool) -> None:
    _, client = serve("Hello User: more")
    assert completion_text(client, stream, stop=["User:"], max_tokens=20, temperature=0) == \
        ("Hello ", "stop")


def test_a_stop_token_keeps_the_text_held_for_a_stop_string(serve: Any,
                                                            tokenizer: Tokenizer) -> None:
    """The same through the engine's API with a request's own stop_token_ids."""
    script = tokenizer.encode("Hello U") + tokenizer.encode("!")
    engine, _ = serve(script)
    assert engine.complete("Go.<|im_start|>", temperature=0, max_tokens=20, stop=["User:"],
                           stop_token_ids=tokenizer.encode("!")) == "Hello U"


# ----------------------------------------------------------------------------- a cut character


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_inside_a_character_drops_its_bytes(serve: Any, tokenizer: Tokenizer,
                                                       stream: bool) -> None:
    """"ok 🎉" is 5 tokens, the emoji's 4 bytes spread over the last 3: max_tokens=4 cuts it.
    The answer is "ok ", and the logprobs still show the bytes the model wrote."""
    ids = tokenizer.encode("ok 🎉")
    assert len(ids) == 5 and utf8_cut(b"".join(tokenizer.token_bytes(i) for i in ids[:4]))
    _, client = serve(ids)
    kw: dict[str, Any] = {"max_tokens": 4, "temperature": 0}
    assert chat_text(client, stream, **kw) == ("ok ", "length")
    assert completion_text(client, stream, **kw) == ("ok ", "length")
    r = client.chat.completions.create(model="", messages=USER, logprobs=True, **kw)
    raw = b"".join(bytes(lp.bytes) for lp in r.choices[0].logprobs.content)
    assert raw == "ok 🎉".encode()[:-1]


def test_a_token_whose_text_is_dropped_still_reaches_the_caller(serve: Any,
                                                              tokenizer: Tokenizer) -> None:
    """The last token of an answer cut inside a character has no text left, but it was
    generated: its id is in the events (and counted), so token-level callers see all of them.
    "ok🎉": the emoji's bytes are the last two tokens alone, so at max_tokens=4 they are cut."""
    ids = tokenizer.encode("ok🎉")
    assert not tokenizer.decode(ids[2:4]).strip("\ufffd")
    engine, _ = serve(ids)
    events = list(engine.stream(Request(prompt="Go.<|im_start|>", params=SamplingParams(
        temperature=0, max_tokens=4))))
    got = [t for ev in events if isinstance(ev, Delta) for t in ev.token_ids]
    finished = [ev for ev in events if isinstance(ev, Finished)]
    assert got == ids[:4]
    assert finished[0].reason == "length" and finished[0].usage.completion_tokens == 4
    assert "".join(ev.text for ev in events if isinstance(ev, Delta)) == "ok"


# ----------------------------------------------------------------------------- default model

CUT_CHAT = [{"role": "user", "content": "Write 你好 and 🎉 ten times."}]  # emoji lines, mostly


@pytest.fixture(scope="module")
def default_client(default_loaded: Any) -> Iterator[openai.OpenAI]:
    from nbserve.server import create_app

    with Engine(default_loaded, max_batch=2, max_context=512,
                quiet=True) as engine, running_server(create_app(engine, ui=False)) as url, \
            openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                          timeout=120) as client:
        yield client


def _answer_bytes(client: openai.OpenAI, stream: bool, max_tokens: int) -> tuple[str, bytes]:
    """(content, the bytes of its tokens from logprobs) of a greedy answer to CUT_CHAT."""
    kw: dict[str, Any] = {"model": "", "messages": CUT_CHAT, "max_tokens": max_tokens,
                          "temperature": 0, "logprobs": True}
    if not stream:
        choice = client.chat.completions.create(**kw).choices[0]
        assert choice.finish_reason == "length"
        return choice.message.content, b"".join(bytes(lp.bytes) for lp in
                                                choice.logprobs.content)
    text, raw = "", b""
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            text += ch.delta.content or ""
            raw += b"".join(bytes(lp.bytes) for lp in (ch.logprobs.content if ch.logprobs
                                                       else None) or ())
    return text, raw


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_default_model_answer_cut_inside_a_character(default_client: openai.OpenAI,
                                                     stream: bool) -> None:
    """The real model's emoji are several tokens each: the last max_tokens up to 24 that ends
    inside one gives an answer whose logprobs bytes end incomplete, and a content without
    U+FFFD that is the text of its complete bytes."""
    lps = default_client.chat.completions.create(
        model="", messages=CUT_CHAT, max_tokens=24, temperature=0,
        logprobs=True).choices[0].logprobs.content
    cut_at = max(n for n in range(1, len(lps) + 1)
                 if utf8_cut(b"".join(bytes(lp.bytes) for lp in lps[:n])))
    text, raw = _answer_bytes(default_client, stream, cut_at)
    cut = utf8_cut(raw)
    assert cut  # this answer really ends inside a character
    assert text and "\ufffd" not in text
    assert text == raw[:-cut].decode()


def test_a_cancelled_answer_keeps_the_text_held_for_a_stop_string(serve: Any,
                                                                  tokenizer: Tokenizer) -> None:
    """A shutdown cancels running answers with the text they have: "Hello " then "U" forever
    with stop=["User:"] always holds its last "U" back; the cancelled answer still has it."""
    u = tokenizer.encode("U")
    assert len(u) == 1
    engine, _ = serve("Hello ", end=u[0])
    events = engine.stream(Request(prompt="Go.<|im_start|>", params=SamplingParams(
        temperature=0, max_tokens=100, stop=["User:"])))
    text, ids, finish = "", [], None
    for ev in events:
        if isinstance(ev, Delta):
            text, ids = text + ev.text, ids + ev.token_ids
            if ids.count(u[0]) == 5:
                engine.cancel_all()
        elif isinstance(ev, Finished):
            finish = ev.reason
    assert finish == "cancelled"
    assert text == "Hello " + "U" * ids.count(u[0])
