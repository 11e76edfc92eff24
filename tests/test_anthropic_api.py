"""Anthropic's Messages API with the real `anthropic` SDK against a real server on a real port:
`messages.create`, `messages.stream` (`text_stream`, `get_final_message`) and the raw event
sequence, a tool-use round trip (a forced tool, then a `tool_result` turn), `count_tokens`,
the thinking switch, stop sequences, errors in Anthropic's shape (the SDK's exception types),
keys from `x-api-key`. Scripted models (their answers are known) for most; a tiny random model
for the grammar that enforces `tool_choice`; one answer of the default model (slow)."""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
from server_util import app_running, engine_running, wait_until
from test_answer_endings import VOCAB, ScriptedModel
from tiny_models import IM_END_ID, make_tiny_tokenizer

from nbserve.api.anthropic import MessagesRequest
from nbserve.api.anthropic_stream import MessageBuilder
from nbserve.api.errors import APIError
from nbserve.api.limits import Limits
from nbserve.api.trace import Trace
from nbserve.engine import Engine
from nbserve.models.adapters import RecomputeAdapter
from nbserve.models.adopt import adopt
from nbserve.text import Tokenizer
from nbserve.types import Delta, ErrorEvent, Event, Started

KEY = "sk-anthropic-test"
# Qwen3-like: the answer starts after <|im_start|>; thinking off renders NOTHINK
THINKER = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
           "{% if enable_thinking is defined and enable_thinking is false %}NOTHINK"
           "{% endif %}<|im_start|>{# <think> #}")
PLAIN = "{% for m in messages %}{{ m['content'] }}{% endfor %}<|im_start|>"
THOUGHT, ANSWER = "Six sevens: 42.", "It is 42."
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ASK = [{"role": "user", "content": "What is 6 times 7?"}]
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {
               "city": {"type": "string", "enum": ["Paris", "Oslo"]}},
               "required": ["city"], "additionalProperties": False}}


@contextlib.contextmanager
def scripted(template: str, answer: str, endless: bool = False) -> Iterator[Engine]:
    """An engine whose model writes `answer` after the prompt's last <|im_start|>, then ends
    (or, `endless`, repeats its last token until max_tokens)."""
    tokenizer = Tokenizer(make_tiny_tokenizer(), eos_token_ids=[IM_END_ID])
    ids = tokenizer.encode(answer)
    step = RecomputeAdapter(ScriptedModel(ids, end=ids[-1] if endless else IM_END_ID),
                            max_context=1024, vocab_size=VOCAB, warn=False)
    with Engine(adopt(step, tokenizer, chat_template=template, name="scripted",
                      verbose=False), max_batch=4, quiet=True) as engine:
        yield engine


def sdk(url: str, key: str = KEY) -> anthropic.Anthropic:
    """The SDK as a user points it at nbserve: the server's root, not /v1."""
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def thinker() -> Iterator[tuple[str, Engine]]:
    """A thinking model's server (keys required; a 64 KiB body limit)."""
    with scripted(THINKER, f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}") as engine, \
            app_running(engine, api_keys=[KEY], limits={"max_body_bytes": 65536}) as url:
        yield url, engine


@pytest.fixture(scope="module")
def client(thinker: tuple[str, Engine]) -> anthropic.Anthropic:
    return sdk(thinker[0])


@pytest.fixture(scope="module")
def caller() -> Iterator[anthropic.Anthropic]:
    """A model that calls get_weather for Paris (in Hermes' format), whatever it is asked."""
    with scripted(PLAIN, CALL) as engine, app_running(engine) as url:
        yield sdk(url, "-")


def _content(message: Any) -> list[dict[str, Any]]:
    return [b.model_dump(exclude_none=True) for b in message.content]


# ----------------------------------------------------------------------------- answers


def test_create_answers_with_a_thinking_and_a_text_block(client: anthropic.Anthropic) -> None:
    m = client.messages.create(model="", max_tokens=60, messages=ASK)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.model == "scripted" and m.stop_reason == "end_turn" and m.stop_sequence is None
    thinking, text = m.content
    assert thinking.type == "thinking" and thinking.thinking == THOUGHT
    assert isinstance(thinking.signature, str) and thinking.signature
    assert text.type == "text" and text.text == ANSWER
    counted = client.messages.count_tokens(model="", messages=ASK)
    u = m.usage
    assert u.input_tokens + u.cache_read_input_tokens == counted.input_tokens > 0
    assert u.output_tokens > 0 and u.cache_creation_input_tokens == 0


def test_the_stream_is_anthropics_event_sequence_and_folds_into_the_answer(
        client: anthropic.Anthropic) -> None:
    whole = client.messages.create(model="", max_tokens=60, messages=ASK)
    with client.messages.stream(model="", max_tokens=60, messages=ASK) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == ANSWER
    assert _content(final) == _content(whole) and final.stop_reason == "end_turn"
    assert final.usage.output_tokens == whole.usage.output_tokens
    events = list(client.messages.create(model="", max_tokens=60, messages=ASK,
                                         stream=True))
    kinds = [e.type if e.type != "content_block_delta" else e.delta.type for e in events]
    collapsed = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]
    assert collapsed == ["message_start", "content_block_start", "thinking_delta",
                         "signature_delta", "content_block_stop", "content_block_start",
                         "text_delta", "content_block_stop", "message_delta", "message_stop"]
    assert [e.index for e in events if e.type == "content_block_start"] == [0, 1]
    assert "".join(e.delta.thinking for e in events if kinds[events.index(e)] ==
                   "thinking_delta") == THOUGHT


def test_pings_are_named_sse_events(thinker: tuple[str, Engine]) -> None:
    r = httpx.post(thinker[0] + "/v1/messages", headers={"x-api-key": KEY}, timeout=60,
                   json={"model": "", "max_tokens": 60, "stream": True, "messages": ASK})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    names = [line.removeprefix("event: ") for line in r.text.splitlines()
             if line.startswith("event: ")]
    assert names[:2] == ["message_start", "ping"] and names[-1] == "message_stop"


def test_stop_sequences_and_max_tokens_give_their_stop_reasons(
        client: anthropic.Anthropic) -> None:
    m = client.messages.create(model="", max_tokens=60, messages=ASK,
                               stop_sequences=["never", "It is"])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "It is"
    assert [b.type for b in m.content] == ["thinking"]
    m = client.messages.create(model="", max_tokens=12, messages=ASK)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 12
    assert m.content[0].type == "thinking" and THOUGHT.startswith(m.content[0].thinking)


def test_thinking_reaches_the_templates_switch(client: anthropic.Anthropic) -> None:
    def count(**kw: Any) -> int:
        return client.messages.count_tokens(model="", messages=ASK, **kw).input_tokens

    plain = count()
    assert count(thinking={"type": "disabled"}) > plain  # NOTHINK rendered
    assert count(thinking={"type": "enabled", "budget_tokens": 1024}) == plain
    body = {"max_tokens": 2048, "messages": ASK}
    req = MessagesRequest.model_validate({**body, "thinking": {"type": "disabled"}})
    assert req.to_request(Limits(), "r").template_kwargs == {"enable_thinking": False}
    req = MessagesRequest.model_validate({**body, "thinking": {"type": "enabled",
                                                               "budget_tokens": 1024}})
    assert req.to_request(Limits(), "r").template_kwargs == {"enable_thinking": True}
    with pytest.raises(anthropic.BadRequestError) as exc:
        client.messages.create(model="", max_tokens=60, messages=ASK,
                               thinking={"type": "enabled", "budget_tokens": 60})
    assert "budget_tokens" in exc.value.body["error"]["message"]


# ----------------------------------------------------------------------------- tools


def test_a_forced_tool_then_its_result(caller: anthropic.Anthropic) -> None:
    forced = {"type": "tool", "name": "get_weather"}
    m = caller.messages.create(model="", max_tokens=80, messages=ASK, tools=[WEATHER],
                               tool_choice=forced)
    (call,) = m.content
    assert call.type == "tool_use" and call.name == "get_weather"
    assert call.input == {"city": "Paris"} and call.id.startswith("toolu_")
    assert m.stop_reason == "tool_use"
    with caller.messages.stream(model="", max_tokens=80, messages=ASK, tools=[WEATHER],
                                tool_choice=forced) as stream:
        parts = [e.delta.partial_json for e in stream
                 if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
        final = stream.get_final_message()
    assert len(parts) > 1 and json.loads("".join(parts)) == {"city": "Paris"}
    assert final.content[0].input == call.input and final.stop_reason == "tool_use"

    turn = [*ASK, {"role": "assistant", "content": _content(m)},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                          "content": [{"type": "text", "text": "Sunny"}]}]}]
    again = caller.messages.create(model="", max_tokens=80, messages=turn,
                                   tools=[WEATHER])
    assert again.stop_reason == "tool_use"  # the scripted model calls again, whatever it reads
    before = caller.messages.count_tokens(model="", messages=ASK, tools=[WEATHER])
    after = caller.messages.count_tokens(model="", messages=turn, tools=[WEATHER])
    assert after.input_tokens > before.input_tokens


def test_a_thought_then_a_forced_call() -> None:
    """A thinking model's thought is a thinking block, its call a tool_use block after it."""
    with scripted(THINKER, f"<think>\nAsk the tool.\n</think>\n\n{CALL}") as engine, \
            app_running(engine) as url:
        client = sdk(url, "-")
        kw: dict[str, Any] = {"model": "", "max_tokens": 100, "messages": ASK,
                              "tools": [WEATHER], "tool_choice": {"type": "any"}}
        m = client.messages.create(**kw)
        with client.messages.stream(**kw) as stream:
            final = stream.get_final_message()
    thinking, call = m.content
    assert thinking.type == "thinking" and thinking.thinking == "Ask the tool."
    assert call.type == "tool_use" and call.input == {"city": "Paris"}
    assert m.stop_reason == "tool_use" and _content(final)[0] == _content(m)[0]
    assert final.content[1].input == call.input


def test_every_field_the_sdk_sends_has_a_fate() -> None:
    """Each body field of the SDK's create() and count_tokens() params is a field of nbserve's
    schema (served, a no-op, or refused by name: never an unknown field)."""
    import typing

    from anthropic.types import message_count_tokens_params, message_create_params

    from nbserve.api.anthropic import CountTokensRequest

    headers = {"user_profile_id", "workspace_id"}  # the SDK sends these as headers
    for params, ours in ((message_create_params.MessageCreateParamsNonStreaming,
                          MessagesRequest),
                         (message_create_params.MessageCreateParamsStreaming, MessagesRequest),
                         (message_count_tokens_params.MessageCountTokensParams,
                          CountTokensRequest)):
        missing = set(typing.get_type_hints(params)) - headers - set(ours.model_fields)
        assert not missing, (params.__name__, missing)


def test_blocks_become_the_chat_messages_templates_read() -> None:
    body = {"max_tokens": 100, "system": [{"type": "text", "text": "Be brief."}], "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Call the tool.", "signature": "x"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "down", "is_error": True,
             "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "And now?"}]}],
        "tools": [WEATHER], "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "stop_sequences": ["END"], "temperature": 0.5, "top_k": 5, "top_p": 0.9,
        "metadata": {"user_id": "u1"}}
    req = MessagesRequest.model_validate(body).to_request(Limits(), "r1")
    system, user, assistant, tool, user2 = req.messages or []
    assert system == {"role": "system", "content": [{"type": "text", "text": "Be brief."}]}
    assert user == {"role": "user", "content": "Weather in Paris?"}
    assert assistant["reasoning_content"] == "Call the tool."
    assert assistant["content"] == [{"type": "text", "text": "Checking."}]
    assert assistant["tool_calls"] == [{"id": "toolu_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    assert tool == {"role": "tool", "content": "Error: down", "tool_call_id": "toolu_1"}
    assert user2["role"] == "user"
    assert req.tool_choice == "required" and req.parallel_tool_calls is False
    assert req.tools == [{"type": "function", "function": {
        "name": "get_weather", "parameters": WEATHER["input_schema"],
        "description": WEATHER["description"]}}]
    p = req.params
    assert (p.max_tokens, p.stop, p.temperature, p.top_k, p.top_p) == (100, ["END"], 0.5, 5, 0.9)
    assert req.metadata["user"] == "u1" and req.request_id == "r1"
    strict = {**WEATHER, "strict": True, "eager_input_streaming": True,
              "cache_control": {"type": "ephemeral"}}
    req = MessagesRequest.model_validate({**body, "tools": [strict]}).to_request(Limits(), "r")
    assert (req.tools or [])[0]["function"].get("strict") is True


@pytest.fixture(scope="module")
def random_model(tiny_llama_dir: Path) -> Iterator[anthropic.Anthropic]:
    with engine_running(tiny_llama_dir, max_context=512) as engine, \
            app_running(engine) as url:
        yield sdk(url, "-")


def test_tool_choice_is_enforced_by_the_grammar(random_model: anthropic.Anthropic) -> None:
    """A random model writes whatever; `any` (one call at most) and `tool` make it call."""
    for choice in ({"type": "any", "disable_parallel_tool_use": True},
                   {"type": "tool", "name": "get_weather"}):
        m = random_model.messages.create(model="", max_tokens=100, messages=ASK,
                                         tools=[WEATHER], tool_choice=choice,
                                         extra_body={"temperature": 0})
        calls = [b for b in m.content if b.type == "tool_use"]
        assert len(calls) == 1 and m.stop_reason == "tool_use", m
        assert calls[0].name == "get_weather" and calls[0].input["city"] in ("Paris", "Oslo")
    m = random_model.messages.create(model="", max_tokens=8, messages=ASK, tools=[WEATHER],
                                     tool_choice={"type": "none"}, extra_body={"temperature": 0})
    # `none`: text only (a random model may end its text early: no stop reason is promised)
    assert all(b.type == "text" for b in m.content) and m.stop_reason != "tool_use", m


def test_output_config_format_constrains_the_text(random_model: anthropic.Anthropic) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}},
              "required": ["answer"], "additionalProperties": False}
    m = random_model.messages.create(model="", max_tokens=60, messages=ASK,
                                     output_config={"format": {"type": "json_schema",
                                                               "schema": schema}},
                                     extra_body={"temperature": 0})
    (text,) = m.content
    assert text.type == "text" and m.stop_reason == "end_turn", m
    assert set(json.loads(text.text)) == {"answer"}
    assert isinstance(json.loads(text.text)["answer"], int)


# ----------------------------------------------------------------------------- errors


def _anthropic_error(exc: anthropic.APIStatusError, kind: str, *words: str) -> str:
    body = exc.body
    assert isinstance(body, dict) and body["type"] == "error", body
    assert body["error"]["type"] == kind and set(body["error"]) == {"type", "message"}, body
    message = body["error"]["message"]
    assert all(w in message for w in words), message
    return message


def test_bad_requests_are_400s_in_anthropics_shape(client: anthropic.Anthropic) -> None:
    def refused(**kw: Any) -> anthropic.BadRequestError:
        kw = {"model": "", "max_tokens": 10, "messages": ASK, **kw}
        with pytest.raises(anthropic.BadRequestError) as exc:
            client.messages.create(**kw)
        return exc.value

    # the SDK itself needs max_tokens: leave it out of the body (and give a timeout, which
    # the SDK otherwise computes from it)
    _anthropic_error(refused(max_tokens=anthropic.NOT_GIVEN), "invalid_request_error",
                     "max_tokens")
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "iVBORw0KGgo="}}
    _anthropic_error(refused(messages=[{"role": "user", "content": [image]}]),
                     "invalid_request_error", "messages[0].content[0].type", "text-only")
    _anthropic_error(refused(extra_body={"temprature": 0}), "invalid_request_error",
                     "temprature")
    _anthropic_error(refused(messages=[*ASK, {"role": "assistant", "content": "It is"}]),
                     "invalid_request_error", "messages[1].role", "user turn")
    _anthropic_error(refused(tools=[{"type": "web_search_20250305", "name": "web_search"}]),
                     "invalid_request_error", "tools[0].type", "server tools")
    _anthropic_error(refused(messages=[{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]),
        "invalid_request_error", "messages[0].content[0].type")
    _anthropic_error(refused(tool_choice={"type": "tool", "name": "nope"}, tools=[WEATHER]),
                     "invalid_request_error", "nope")
    _anthropic_error(refused(tools=[WEATHER, WEATHER]), "invalid_request_error", "tools[1]")
    _anthropic_error(refused(tools=[WEATHER], tool_choice={"type": "tool"}),
                     "invalid_request_error", "tool_choice.name")
    _anthropic_error(refused(messages=[{"role": "user", "content": [
        {"type": "text", "text": "hi", "tool_use_id": "t"}]}]), "invalid_request_error",
        "messages[0].content[0].tool_use_id", "text block")
    _anthropic_error(refused(tools=[{"name": "f"}]), "invalid_request_error",
                     "tools[0].input_schema")
    _anthropic_error(refused(messages=[{"role": "user", "content": []}]),
                     "invalid_request_error", "messages[0].content")
    # a size limit names the client's message (the system prompt is not one of them)
    _anthropic_error(refused(system="Be brief.", messages=[{"role": "user",
                                                            "content": "x" * 9000}]),
                     "invalid_request_error", "messages[0]", "9000")


def test_model_key_size_and_rate_errors_in_anthropics_shape(
        thinker: tuple[str, Engine], client: anthropic.Anthropic) -> None:
    url, engine = thinker
    with pytest.raises(anthropic.NotFoundError) as nf:
        client.messages.create(model="claude-opus-4", max_tokens=10, messages=ASK)
    _anthropic_error(nf.value, "not_found_error", "claude-opus-4", "scripted")
    with pytest.raises(anthropic.AuthenticationError) as auth:
        sdk(url, "sk-wrong").messages.create(model="", max_tokens=10, messages=ASK)
    _anthropic_error(auth.value, "authentication_error", "x-api-key")
    with pytest.raises(anthropic.AuthenticationError):
        sdk(url, "sk-wrong").messages.count_tokens(model="", messages=ASK)
    big = [{"role": "user", "content": "x" * 70000}]
    with pytest.raises(anthropic.APIStatusError) as large:
        client.messages.create(model="", max_tokens=10, messages=big)
    assert large.value.status_code == 413
    _anthropic_error(large.value, "request_too_large", "65536 bytes")
    r = httpx.post(url + "/v1/messages/batches", headers={"x-api-key": KEY}, json={})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    # an OpenAI route of the same server keeps the OpenAI shape
    r = httpx.post(url + "/v1/chat/completions", headers={"x-api-key": "sk-wrong"}, json={})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with app_running(engine, rate_limit_per_minute=1) as limited:
        unlimited = sdk(limited, "-")
        unlimited.messages.count_tokens(model="", messages=ASK)
        with pytest.raises(anthropic.RateLimitError) as rate:
            unlimited.messages.create(model="", max_tokens=10, messages=ASK)
        _anthropic_error(rate.value, "rate_limit_error", "Rate limit")
        assert rate.value.response.headers["retry-after"]


def test_the_model_list_reads_as_anthropics(client: anthropic.Anthropic) -> None:
    (model,) = client.models.list().data
    assert model.id == model.display_name == "scripted" and model.type == "model"
    assert model.created_at.year >= 2024


def test_the_routes_are_counted_by_route(thinker: tuple[str, Engine],
                                         client: anthropic.Anthropic) -> None:
    client.messages.count_tokens(model="", messages=ASK)
    metrics = httpx.get(thinker[0] + "/metrics", headers={"x-api-key": KEY}).text
    assert 'route="/v1/messages"' in metrics and 'route="/v1/messages/count_tokens"' in metrics


def test_a_client_that_leaves_cancels_its_request() -> None:
    """Streamed or not, the request of a client that leaves is cancelled and frees its slot."""
    with scripted(PLAIN, "la", endless=True) as engine, app_running(engine) as url:
        def cancelled() -> int:
            return int(engine.stats()["requests_finished"].get("cancelled", 0))

        long = {"model": "", "max_tokens": 900, "messages": ASK}
        with httpx.stream("POST", url + "/v1/messages", json={**long, "stream": True},
                          timeout=30) as resp:
            deltas = (line for line in resp.iter_lines() if "text_delta" in line)
            next(deltas), next(deltas)
            assert engine.stats()["running"] == 1
        assert wait_until(lambda: cancelled() == 1 and engine.stats()["running"] == 0, 5)
        body = json.dumps(long).encode()
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Type: "
                         b"application/json\r\n" +
                         f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            assert wait_until(lambda: engine.stats()["running"] == 1, 5)
        assert wait_until(lambda: cancelled() == 2 and engine.stats()["running"] == 0, 5)


async def _events(*events: Event) -> AsyncIterator[Event]:
    for ev in events:
        yield ev


async def test_an_engine_error_mid_stream_is_an_error_event() -> None:
    events = _events(Delta(0, "Hi", [5]), ErrorEvent("the engine stopped", "service_unavailable"))
    builder = MessageBuilder("msg_x", "m", Trace("x"), [], None, True, "x")
    out = [e async for e in builder.events(events, Started("x", 3, 0))]
    assert [name for name, _ in out] == ["message_start", "ping", "content_block_start",
                                         "content_block_delta", "error"]
    assert out[-1][1]["type"] == "error"
    assert out[-1][1]["error"] == {"type": "overloaded_error",
                                   "message": "the engine stopped. Retry in a few seconds."}
    builder = MessageBuilder("msg_x", "m", Trace("x"), [], None, True, "x")
    with pytest.raises(APIError) as exc:
        await builder.fold(builder.events(_events(ErrorEvent("boom")), Started("x", 3, 0)))
    assert exc.value.status == 500


# ----------------------------------------------------------------------------- the default model


@pytest.mark.slow
def test_the_default_model_answers_through_the_sdk(default_loaded: Any) -> None:
    with Engine(default_loaded, max_batch=2, quiet=True) as engine, \
            app_running(engine) as url:
        client = anthropic.Anthropic(base_url=url, api_key="-", max_retries=0)
        # (the SDK's newest versions no longer name the sampling fields: sent in extra_body)
        m = client.messages.create(model=engine.model_name, max_tokens=40,
                                   messages=[{"role": "user",
                                              "content": "What is the capital of France?"}],
                                   extra_body={"temperature": 0})
    assert m.stop_reason in ("end_turn", "max_tokens") and "Paris" in m.content[0].text
