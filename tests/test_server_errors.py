"""Bad input, auth, limits, overload and engine failures: status, OpenAI error shape, and the
server still ready afterwards."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import pytest
from server_util import app_running, engine_running, make_engine, running_server

from nbserve.server import create_app

MSG = [{"role": "user", "content": "hi"}]
NO_EOS = {"2": -100}


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": MSG, "max_tokens": 2, **fields}


# (name, method, path, body: dict | bytes | None, expected status, expected param or code)
CASES: list[tuple[str, str, str, Any, int, str | None]] = [
    ("malformed json", "POST", "/v1/chat/completions", b'{"messages": [', 400, "invalid_json"),
    ("body not an object", "POST", "/v1/chat/completions", b"[1, 2]", 400, "invalid_json"),
    ("missing messages", "POST", "/v1/chat/completions", {"model": ""}, 400, "messages"),
    ("messages not a list", "POST", "/v1/chat/completions", {"messages": "hi"}, 400,
     "messages"),
    ("empty messages", "POST", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("role wizard", "POST", "/v1/chat/completions",
     {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    ("content wrong type", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ("image part", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400,
     "messages[0].content[0].type"),
    ("temperature string", "POST", "/v1/chat/completions", chat(temperature="hot"), 400,
     "temperature"),
    ("n bool", "POST", "/v1/chat/completions", chat(n=True), 400, "n"),
    ("n=0", "POST", "/v1/chat/completions", chat(n=0), 400, "n"),
    ("n=9", "POST", "/v1/chat/completions", chat(n=9), 400, "n"),
    ("temperature 3", "POST", "/v1/chat/completions", chat(temperature=3), 400, "temperature"),
    ("top_p 0", "POST", "/v1/chat/completions", chat(top_p=0), 400, "top_p"),
    ("top_k 500", "POST", "/v1/chat/completions", chat(top_k=500), 400, "top_k"),
    ("max_tokens 0", "POST", "/v1/chat/completions", chat(max_tokens=0), 400, "max_tokens"),
    ("max_tokens 5000", "POST", "/v1/chat/completions", chat(max_tokens=5000), 400,
     "max_tokens"),
    ("top_logprobs 21", "POST", "/v1/chat/completions", chat(logprobs=True, top_logprobs=21),
     400, "top_logprobs"),
    ("top_logprobs without logprobs", "POST", "/v1/chat/completions", chat(top_logprobs=2), 400,
     "top_logprobs"),
    ("logit_bias bad key", "POST", "/v1/chat/completions", chat(logit_bias={"abc": 1}), 400,
     "logit_bias"),
    ("logit_bias token out of vocab", "POST", "/v1/chat/completions",
     chat(logit_bias={"99999999": 1}), 400, "logit_bias"),
    ("200,000-char prompt", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "a" * 200_000}]}, 400, "messages[0].content"),
    ("8,001-char message", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "a" * 8_001}]}, 400, "messages[0].content"),
    ("32,001-char conversation", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "a" * 8_000}] * 4
      + [{"role": "user", "content": "a"}]}, 400, "messages"),
    ("501 messages", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "a"}] * 501}, 400, "messages"),
    ("prompt over the context", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hello world " * 300}]}, 400,
     "context_length_exceeded"),
    ("unknown model", "POST", "/v1/chat/completions", chat(model="gpt-4o"), 404,
     "model_not_found"),
    ("unknown model id", "GET", "/v1/models/gpt-4o", None, 404, "model_not_found"),
    ("unknown route", "POST", "/v1/audio/speech", {"input": "x"}, 404, "unknown_url"),
    ("echo of a negative token id", "POST", "/v1/completions", {"prompt": [-1], "echo": True},
     400, "prompt"),
    ("echo of a token id past the vocabulary", "POST", "/v1/completions",
     {"prompt": [[1, 10**9]], "echo": True}, 400, "prompt"),
    ("unknown route outside /v1", "GET", "/nope", None, 404, "unknown_url"),
    ("wrong method", "GET", "/v1/chat/completions", None, 405, "method_not_allowed"),
    ("response_format json_schema without its object", "POST", "/v1/chat/completions",
     chat(response_format={"type": "json_schema"}), 400, "response_format.json_schema"),
    ("response_format schema keyword that cannot be enforced", "POST", "/v1/chat/completions",
     chat(response_format={"type": "json_schema", "json_schema": {
         "name": "x", "schema": {"type": "object", "not": {"required": ["a"]}}}}), 400,
     "response_format.json_schema.schema"),
    ("tool_choice names a function not in tools", "POST", "/v1/chat/completions",
     chat(tools=[{"type": "function", "function": {"name": "f"}}],
          tool_choice={"type": "function", "function": {"name": "g"}}), 400, "tool_choice"),
    ("tool_choice required without tools", "POST", "/v1/chat/completions",
     chat(tool_choice="required"), 400, "tool_choice"),
    ("structured_outputs with two constraints", "POST", "/v1/completions",
     {"prompt": "a", "structured_outputs": {"regex": "a+", "choice": ["a"]}}, 400,
     "structured_outputs"),
    ("structured_outputs grammar that does not parse", "POST", "/v1/completions",
     {"prompt": "a", "structured_outputs": {"grammar": "start: ("}}, 400,
     "structured_outputs.grammar"),
    ("audio modality", "POST", "/v1/chat/completions", chat(modalities=["text", "audio"]), 400,
     "modalities"),
    ("completions missing prompt", "POST", "/v1/completions", {"max_tokens": 2}, 400, "prompt"),
    ("completions suffix", "POST", "/v1/completions", {"prompt": "a", "suffix": "b"}, 400,
     "suffix"),
    ("completions logprobs 6", "POST", "/v1/completions", {"prompt": "a", "logprobs": 6}, 400,
     "logprobs"),
    ("completions empty list", "POST", "/v1/completions", {"prompt": []}, 400, "prompt"),
    ("completions token out of vocab", "POST", "/v1/completions", {"prompt": [10**7]}, 400,
     "prompt"),
]


def assert_error_shape(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str)
    return err


@pytest.mark.parametrize("name,method,path,body,status,where", CASES, ids=[c[0] for c in CASES])
def test_bad_input(server_url: str, name: str, method: str, path: str, body: Any, status: int,
                   where: str | None) -> None:
    kw: dict[str, Any] = {}
    if isinstance(body, bytes):
        kw = {"content": body, "headers": {"content-type": "application/json"}}
    elif body is not None:
        kw = {"json": body}
    resp = httpx.request(method, server_url + path, timeout=30, **kw)
    err = assert_error_shape(resp, status)
    if where is not None:
        assert where in (err["param"], err["code"]), err
    health = httpx.get(server_url + "/health")
    assert health.status_code == 200 and health.json()["ready"] is True


def test_context_error_gives_both_numbers(server_url: str) -> None:
    resp = httpx.post(server_url + "/v1/chat/completions",
                      json={"messages": [{"role": "user", "content": "hello world " * 300}]})
    msg = assert_error_shape(resp, 400)["message"]
    assert "256" in msg and "tokens" in msg


def test_body_over_limit_is_413(server_url: str) -> None:
    big = json.dumps({"messages": [{"role": "user", "content": "a" * (2 * 1024 * 1024)}]})
    resp = httpx.post(server_url + "/v1/chat/completions", content=big,
                      headers={"content-type": "application/json"})
    assert assert_error_shape(resp, 413)["code"] == "request_too_large"

    def chunks():  # no Content-Length: chunked upload
        for _ in range(5):
            yield b"x" * 1024 * 1024

    resp = httpx.post(server_url + "/v1/chat/completions", content=chunks())
    assert_error_shape(resp, 413)
    assert httpx.get(server_url + "/health").json()["ready"] is True


def test_api_keys(tiny_engine: Any) -> None:
    app = create_app(tiny_engine, api_keys=["key-one", "key-two"], ui=False)
    with running_server(app) as url:
        body = {"messages": MSG, "max_tokens": 2}
        err = assert_error_shape(httpx.post(url + "/v1/chat/completions", json=body), 401)
        assert err["code"] == "missing_api_key"
        wrong = httpx.post(url + "/v1/chat/completions", json=body,
                           headers={"Authorization": "Bearer nope"})
        assert assert_error_shape(wrong, 401)["code"] == "invalid_api_key"
        assert wrong.headers["www-authenticate"] == "Bearer"
        basic = httpx.post(url + "/v1/chat/completions", json=body,
                           headers={"Authorization": "Basic key-one"})
        assert_error_shape(basic, 401)
        for key in ("key-one", "key-two"):
            ok = httpx.post(url + "/v1/chat/completions", json=body,
                            headers={"Authorization": f"Bearer {key}"})
            assert ok.status_code == 200
        assert httpx.get(url + "/v1/models").status_code == 401
        assert httpx.get(url + "/metrics").status_code == 401
        assert httpx.get(url + "/stats").status_code == 401
        assert httpx.get(url + "/health").status_code == 200  # probes need no key
        client = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
        client = openai.OpenAI(base_url=url + "/v1", api_key="key-two", max_retries=0)
        assert client.models.list().data


def test_rate_limit_per_key(tiny_engine: Any) -> None:
    app = create_app(tiny_engine, api_keys=["a", "b"], rate_limit_per_minute=2, ui=False)
    with running_server(app) as url:
        def post(key: str) -> httpx.Response:
            return httpx.post(url + "/v1/chat/completions", json={"messages": MSG,
                              "max_tokens": 1}, headers={"Authorization": f"Bearer {key}"})

        assert [post("a").status_code for _ in range(2)] == [200, 200]
        limited = post("a")
        err = assert_error_shape(limited, 429)
        assert err["code"] == "rate_limit_exceeded"
        assert int(limited.headers["retry-after"]) >= 1
        assert post("b").status_code == 200  # another key has its own budget


def test_queue_full_is_429(tiny_llama_dir: Any) -> None:
    long = {"prompt": "Once upon a time", "max_tokens": 120, "logit_bias": NO_EOS}

    async def burst(url: str, n: int) -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            return await asyncio.gather(*(http.post("/v1/completions", json=long)
                                          for _ in range(n)))

    # one slot, one queue place: of 4 requests sent at once, at most 2 are taken
    with engine_running(tiny_llama_dir, max_batch=1, max_queue=1) as engine, \
            app_running(engine) as url:
        answers = asyncio.run(burst(url, 4))
        statuses = sorted(r.status_code for r in answers)
        assert statuses.count(429) >= 2 and set(statuses) == {200, 429}, statuses
        busy = next(r for r in answers if r.status_code == 429)
        err = assert_error_shape(busy, 429)
        assert err["type"] == "rate_limit_error" and err["code"] == "server_busy"
        assert int(busy.headers["retry-after"]) >= 1
        assert httpx.get(url + "/health").json()["ready"] is True


def test_engine_stopping_mid_stream_ends_with_an_error_event(tiny_llama_dir: Any) -> None:
    engine = make_engine(tiny_llama_dir)
    app = create_app(engine, ui=False)
    body = {"messages": MSG, "max_tokens": 200, "stream": True, "logit_bias": NO_EOS}
    with running_server(app) as url:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body) as resp:
            lines = (line for line in resp.iter_lines() if line)
            payloads = [next(lines), next(lines)]  # the stream has started
            engine.close()
            payloads += list(lines)
        assert payloads[-1] == "data: [DONE]"
        err = json.loads(payloads[-2][len("data: "):])
        assert set(err) == {"error"} and err["error"]["type"] == "service_unavailable"
        # after the engine stopped: 503 for new work, /health not ready
        after = httpx.post(url + "/v1/chat/completions", json={"messages": MSG})
        assert assert_error_shape(after, 503)["type"] == "service_unavailable"
        assert after.headers["retry-after"]
        assert httpx.get(url + "/health").status_code == 503


def test_model_failure_is_500_with_request_id(tiny_llama_dir: Any) -> None:
    engine = make_engine(tiny_llama_dir)
    real_forward = engine.model.forward

    def broken(*args: Any, **kw: Any) -> Any:
        raise RuntimeError("injected fault")

    try:
        with running_server(create_app(engine, ui=False)) as url:
            engine.model.forward = broken
            resp = httpx.post(url + "/v1/chat/completions", json={"messages": MSG})
            err = assert_error_shape(resp, 500)
            assert err["type"] == "server_error"
            assert resp.headers["x-request-id"] in err["message"]
            stream = httpx.post(url + "/v1/chat/completions", json={"messages": MSG,
                                                                     "stream": True})
            assert stream.status_code == 200
            assert stream.text.endswith("data: [DONE]\n\n") and '"error"' in stream.text
            engine.model.forward = real_forward
            ok = httpx.post(url + "/v1/chat/completions", json={"messages": MSG,
                                                                 "max_tokens": 2})
            assert ok.status_code == 200
            assert httpx.get(url + "/health").json()["ready"] is True
    finally:
        engine.close()
