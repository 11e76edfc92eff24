"""POST /tokenize and /detokenize (vLLM's and llama.cpp's shapes) over a real server with the
tiny model: text and chat messages to the ids the engine serves, and back; bad input is a 400
naming the field."""

from __future__ import annotations

import json
from typing import Any

import httpx
from server_util import running_server

from nbserve.server import create_app
from nbserve.types import Request

HI = [{"role": "user", "content": "Hello there, how are you?"}]


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=30)


def test_text_becomes_the_engines_token_ids_and_back(server_url: str, tiny_engine: Any) -> None:
    text = "Once upon a time, café 😀"
    r = post(server_url, "/tokenize", {"prompt": text})
    assert r.status_code == 200, r.text
    body = r.json()
    ids = tiny_engine.tokenizer.encode(text, add_special_tokens=True)
    assert body["tokens"] == ids and body["count"] == len(ids)
    assert body["max_model_len"] == tiny_engine.max_context
    back = post(server_url, "/detokenize", {"tokens": ids}).json()
    assert back["prompt"] == back["content"] == tiny_engine.tokenizer.decode(ids)
    assert text in back["prompt"]


def test_chat_messages_are_rendered_as_for_serving(server_url: str, tiny_engine: Any) -> None:
    body = post(server_url, "/tokenize", {"messages": HI}).json()
    assert body["tokens"] == tiny_engine.prepare_prompt(Request(messages=HI))
    plain = post(server_url, "/tokenize", {"messages": HI, "add_generation_prompt": False}).json()
    assert plain["count"] < body["count"]


def test_llama_cpp_fields_and_pieces(server_url: str, tiny_engine: Any) -> None:
    body = post(server_url, "/tokenize", {"content": "hello world", "with_pieces": True,
                                          "add_special": False}).json()
    ids = tiny_engine.tokenizer.encode("hello world", add_special_tokens=False)
    assert [t["id"] for t in body["tokens"]] == ids
    assert "".join(t["piece"] for t in body["tokens"]) == "hello world"
    strs = post(server_url, "/tokenize", {"prompt": "hello", "return_token_strs": True}).json()
    assert len(strs["token_strs"]) == strs["count"]


def test_bad_input_is_a_400_naming_the_field(server_url: str) -> None:
    cases = [("/tokenize", {"prompt": "a", "messages": HI}, "prompt"),
             ("/tokenize", {}, "prompt"),
             ("/tokenize", {"prompt": "a", "add_specials": True}, "add_specials"),
             ("/detokenize", {"tokens": [10**9]}, "tokens"),
             ("/detokenize", {"tokens": "abc"}, "tokens")]
    for path, body, param in cases:
        r = post(server_url, path, body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, r.json()
    r = post(server_url, "/tokenize", {"prompt": "a", "model": "gpt-4o"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert post(server_url, "/tokenize", {"prompt": "still serving"}).status_code == 200


def test_a_14_mb_detokenize_body_is_a_413_with_an_openai_error(server_url: str) -> None:
    body = json.dumps({"tokens": [1] * 4_800_000}).encode()
    assert len(body) > 14_000_000
    r = httpx.post(server_url + "/detokenize", content=body,
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413, r.text[:200]
    assert r.json()["error"]["code"] == "request_too_large"
    assert post(server_url, "/detokenize", {"tokens": [1, 2]}).status_code == 200


def test_tokenize_calls_count_toward_the_rate_limit(tiny_engine: Any) -> None:
    """One bucket per client for every route: a chat call and a /tokenize call use up a
    2-per-minute budget, and then /tokenize, /detokenize and chat are all refused."""
    with running_server(create_app(tiny_engine, rate_limit_per_minute=2, ui=False)) as url:
        chat = {"messages": HI, "max_tokens": 1}
        assert post(url, "/v1/chat/completions", chat).status_code == 200
        assert post(url, "/tokenize", {"prompt": "hi"}).status_code == 200
        for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]}),
                           ("/v1/chat/completions", chat)):
            r = post(url, path, body)
            assert r.status_code == 429, (path, r.text)
            assert r.json()["error"]["code"] == "rate_limit_exceeded" and r.headers["retry-after"]
