"""The OpenAI API over a real uvicorn server with the tiny model: the official SDK for the
contract, raw httpx for the exact SSE framing."""

from __future__ import annotations

import json
import logging
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_util import app_running, make_engine, running_server, wait_until
from tiny_models import QWEN25_TEMPLATE, make_tiny_hf_dir

HI = [{"role": "user", "content": "What is the capital of France?"}]
NO_EOS = {"2": -100}  # the random model may end early; these tests want full-length answers


@pytest.fixture(scope="module")
def client(server_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server_url + "/v1", api_key="unused", max_retries=0)


def sse_events(raw: bytes) -> list[str]:
    """Split an SSE body into its `data:` payloads, checking the framing on the way."""
    text = raw.decode()
    assert text.endswith("\n\n")
    events = text[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events), events
    return [e[len("data: "):] for e in events]


def test_models(client: openai.OpenAI, tiny_engine: Any) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [tiny_engine.model_name]
    assert client.models.retrieve(tiny_engine.model_name).id == tiny_engine.model_name
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_chat_non_streaming(client: openai.OpenAI, tiny_engine: Any) -> None:
    r = client.chat.completions.create(model=tiny_engine.model_name, messages=HI, max_tokens=8,
                                       temperature=0, logit_bias=NO_EOS)
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens > 10
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8
    assert isinstance(r.usage.prompt_tokens_details.cached_tokens, int)
    again = client.chat.completions.create(model="", messages=HI, max_tokens=8, temperature=0,
                                           logit_bias=NO_EOS)
    assert again.choices[0].message.content == choice.message.content  # "" = the served model
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # the prefix cache was used


def test_chat_stream_equals_non_streaming(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"model": "", "messages": HI, "max_tokens": 12, "temperature": 0,
                          "logit_bias": NO_EOS}
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices
                and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_content_parts_equal_string_content(client: openai.OpenAI) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": HI[0]["content"]}]}]
    a = client.chat.completions.create(model="", messages=HI, max_tokens=6, temperature=0)
    b = client.chat.completions.create(model="", messages=parts, max_tokens=6, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == b.usage.prompt_tokens


def test_n_choices(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="", messages=HI, max_tokens=5, n=2, seed=1,
                                       logit_bias=NO_EOS, max_completion_tokens=6)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == 12  # max_completion_tokens wins over max_tokens
    stream = client.chat.completions.create(model="", messages=HI, max_tokens=5, n=2,
                                            logit_bias=NO_EOS, stream=True)
    seen: dict[int, str | None] = {}
    for c in stream:
        for ch in c.choices:
            if ch.finish_reason:
                seen[ch.index] = ch.finish_reason
    assert seen == {0: "length", 1: "length"}


def test_chat_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="", messages=HI, max_tokens=5, temperature=0,
                                       logprobs=True, top_logprobs=3, logit_bias=NO_EOS)
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for item in content:
        assert item.logprob <= 0 and isinstance(item.bytes, list)
        assert len(item.top_logprobs) == 3
        assert item.top_logprobs[0].logprob >= item.top_logprobs[-1].logprob
        # greedy: the chosen token is the most likely one
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob, abs=1e-4)


def test_stop_and_logit_bias(client: openai.OpenAI) -> None:
    free = client.completions.create(model="", prompt="Hello", max_tokens=10, temperature=0,
                                     logit_bias=NO_EOS, logprobs=1)
    tokens = free.choices[0].logprobs.tokens
    stop = next(t for t in tokens[2:] if t.strip())
    cut = client.completions.create(model="", prompt="Hello", max_tokens=10, temperature=0,
                                    logit_bias=NO_EOS, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert free.choices[0].text.startswith(cut.choices[0].text)
    assert stop not in cut.choices[0].text
    token_id = 100
    forced = client.completions.create(model="", prompt="Hello", max_tokens=4, temperature=0,
                                       logit_bias={str(token_id): 100}, logprobs=0)
    assert len(set(forced.choices[0].logprobs.tokens)) == 1


def test_completions(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"model": "", "prompt": "The quick brown fox", "max_tokens": 8,
                          "temperature": 0, "logit_bias": NO_EOS}
    whole = client.completions.create(**kw)
    assert whole.object == "text_completion" and whole.choices[0].finish_reason == "length"
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True)
                       if c.choices)
    assert streamed == whole.choices[0].text
    echo = client.completions.create(**kw, echo=True)
    assert echo.choices[0].text == "The quick brown fox" + whole.choices[0].text
    default = client.completions.create(model="", prompt="Hi", logit_bias=NO_EOS)
    assert default.usage.completion_tokens == 16  # OpenAI's default max_tokens


def test_completions_list_of_prompts(client: openai.OpenAI) -> None:
    prompts = ["Hello there", "The quick brown fox"]
    r = client.completions.create(model="", prompt=prompts, max_tokens=4, n=2, temperature=0,
                                  logit_bias=NO_EOS)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    singles = [client.completions.create(model="", prompt=p, max_tokens=4, temperature=0,
                                         logit_bias=NO_EOS).choices[0].text for p in prompts]
    assert [c.text for c in r.choices] == [singles[0]] * 2 + [singles[1]] * 2
    assert r.usage.completion_tokens == 16
    ids = client.completions.create(model="", prompt=[1, 50, 60], max_tokens=3,
                                    logit_bias=NO_EOS)
    assert ids.usage.prompt_tokens == 3


def test_completion_logprobs_legacy_format(client: openai.OpenAI) -> None:
    r = client.completions.create(model="", prompt="Hello", max_tokens=5, temperature=0,
                                  logprobs=2, logit_bias=NO_EOS)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert len(lp.text_offset) == 5 and lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset)
    assert all(2 <= len(t) <= 3 for t in lp.top_logprobs)


def test_sse_framing(server_url: str) -> None:
    body = {"messages": HI, "max_tokens": 4, "stream": True, "temperature": 0,
            "stream_options": {"include_usage": True}, "logit_bias": NO_EOS}
    with httpx.stream("POST", server_url + "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        assert resp.headers["cache-control"] == "no-cache"
        assert resp.headers["x-accel-buffering"] == "no"
        assert resp.headers["x-request-id"]
        raw = resp.read()
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    finish = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finish) == 1 and finish[0]["choices"][0]["delta"] == {}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0} or \
        chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0
    # without include_usage: no usage chunk and no usage key
    body.pop("stream_options")
    raw = httpx.post(server_url + "/v1/chat/completions", json=body).content
    chunks = [json.loads(e) for e in sse_events(raw)[:-1]]
    assert all(c["choices"] and "usage" not in c for c in chunks)


def test_tools_reach_the_chat_template(tmp_path_factory: pytest.TempPathFactory) -> None:
    model_dir = make_tiny_hf_dir(tmp_path_factory.mktemp("m") / "tiny-qwen-tools", arch="llama",
                                 chat_template=QWEN25_TEMPLATE)
    from nbserve.server import create_app

    engine = make_engine(model_dir, max_context=512)
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    try:
        with running_server(create_app(engine, ui=False)) as url:
            c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)

            def prompt_tokens(messages: list[dict[str, Any]], **kw: Any) -> int:
                r = c.chat.completions.create(model="", messages=messages, max_tokens=1, **kw)
                return r.usage.prompt_tokens

            plain = prompt_tokens(HI)
            with_tools = prompt_tokens(HI, tools=tools)
            assert with_tools > plain + 20  # the tool schema is in the prompt
            assert prompt_tokens(HI, tools=tools, tool_choice="none") == plain
            assert prompt_tokens(HI, tools=tools, tool_choice="auto") == with_tools
            # a finished tool round trip renders (arguments arrive as a JSON string)
            history = HI + [
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
            assert prompt_tokens(history, tools=tools) > with_tools
    finally:
        engine.close()


def test_health_stats_metrics(server_url: str, client: openai.OpenAI) -> None:
    client.chat.completions.create(model="", messages=HI, max_tokens=3)
    health = httpx.get(server_url + "/health")
    assert health.status_code == 200
    h = health.json()
    assert h["status"] == "ready" and h["ready"] is True
    assert {"model", "replicas", "running", "waiting"} <= set(h)
    stats = httpx.get(server_url + "/stats").json()
    assert stats["running"] == 0 and "slots_total" in stats and stats["kv_blocks_total"] > 0
    assert stats["server"]["requests"] >= 1 and stats["server"]["ttft_s"]["p50"] is not None
    metrics = httpx.get(server_url + "/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(metrics.text)}
    for name in ("nbserve_requests", "nbserve_prompt_tokens", "nbserve_completion_tokens",
                 "nbserve_time_to_first_token_seconds", "nbserve_inter_token_latency_seconds",
                 "nbserve_queue_depth", "nbserve_running_sequences",
                 "nbserve_kv_cache_slots_used", "nbserve_kv_cache_usage_ratio",
                 "nbserve_kv_blocks_total", "nbserve_kv_blocks_cached", "nbserve_kv_blocks_touched",
                 "nbserve_prefix_cache_queries", "nbserve_prefix_cache_hits"):
        assert name in families, name
    chat_ok = [s for s in families["nbserve_requests"].samples
               if s.labels.get("route") == "/v1/chat/completions"
               and s.labels.get("status") == "200" and s.name.endswith("_total")]
    assert chat_ok and chat_ok[0].value >= 1


def test_two_apps_in_one_process(tiny_engine: Any) -> None:
    from nbserve.server import create_app

    a, b = create_app(tiny_engine, ui=False), create_app(tiny_engine, ui=False)
    assert a.state.metrics.registry is not b.state.metrics.registry
    with running_server(a) as url_a, running_server(b) as url_b:
        httpx.get(url_a + "/v1/models")
        text_b = httpx.get(url_b + "/metrics").text
        assert 'route="/v1/models"' not in text_b


def test_cors_is_off_by_default_and_configurable(tiny_engine: Any, server_url: str) -> None:
    from nbserve.server import create_app

    preflight = {"Origin": "http://example.com", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    plain = httpx.options(server_url + "/v1/chat/completions", headers=preflight)
    assert "access-control-allow-origin" not in plain.headers
    app = create_app(tiny_engine, cors_origins=["http://example.com"], ui=False)
    with running_server(app) as url:
        ok = httpx.options(url + "/v1/chat/completions", headers=preflight)
        assert ok.status_code == 200
        assert ok.headers["access-control-allow-origin"] == "http://example.com"
        other = httpx.options(url + "/v1/chat/completions",
                              headers={**preflight, "Origin": "http://evil.example"})
        assert "access-control-allow-origin" not in other.headers
        got = httpx.get(url + "/v1/models", headers={"Origin": "http://example.com"})
        assert got.headers["access-control-allow-origin"] == "http://example.com"


@pytest.mark.parametrize("log_messages", [False, True])
def test_one_log_line_per_request(tiny_engine: Any, caplog: pytest.LogCaptureFixture,
                                  log_messages: bool) -> None:
    secret = "my secret question about zebras"
    with app_running(tiny_engine, log_messages=log_messages) as url, \
            caplog.at_level(logging.INFO, logger="nbserve.server"):
        r = httpx.post(url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": secret}], "max_tokens": 3,
            "logit_bias": NO_EOS})
        rid = r.headers["x-request-id"]
        assert wait_until(lambda: any(rid in rec.getMessage() for rec in caplog.records), 2)
    lines = [rec.getMessage() for rec in caplog.records if rid in rec.getMessage()]
    assert len(lines) == 1
    line = lines[0]
    for field in ("prompt=", "completion=3", "cached=", "ttft=", "tok/s=", "finish=length"):
        assert field in line, line
    assert (secret in line) is log_messages


def test_openapi_document_resolves(server_url: str) -> None:
    doc = httpx.get(server_url + "/openapi.json").json()
    body = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    assert body["content"]["application/json"]["schema"]["$ref"].endswith(
        "/ChatCompletionRequest")
    refs: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            refs.update(v for k, v in node.items() if k == "$ref")
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(doc)
    names = set(doc["components"]["schemas"])
    assert {r.rsplit("/", 1)[-1] for r in refs} <= names
    assert "/v1/{rest}" not in doc["paths"]
