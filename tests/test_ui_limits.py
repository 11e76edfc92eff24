"""The chat UI and its gradio API obey the server's Limits, rate limit and login, like /v1.

The chat function is checked directly; the shared rate-limit bucket and the logins through
gradio_client against real servers on real ports.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from gradio_client import Client
from gradio_client.exceptions import AppError, AuthenticationError
from server_util import engine_running, running_server
from test_ui import FakeBackend, collect

from nbserve.api.auth import RateLimiter
from nbserve.api.limits import Limits
from nbserve.server import create_app
from nbserve.serving.ui import make_chat_fn
from nbserve.serving.ui_answer import ERROR_PREFIX

CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tiny_engine(tiny_llama_dir: Any):
    with engine_running(tiny_llama_dir, max_batch=4) as engine:
        yield engine


def login_refused(url: str, auth: tuple[str, str] | None = None) -> str:
    """The error a gradio_client gets connecting to `url` (with `auth`), as text."""
    with pytest.raises((AuthenticationError, ValueError)) as info:  # gradio: 400 on bad login
        Client(url + "/", verbose=False, auth=auth).close()
    return str(info.value)


def ui_chat(client: Client, message: str, max_tokens: int = 4, temperature: float = 0.0
            ) -> tuple[str, str]:
    return client.predict(message, "", temperature, 1.0, max_tokens, api_name="/chat")


def v1_chat(url: str, key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(url + "/v1/chat/completions", headers=headers, timeout=60,
                      json={"messages": CHAT, "max_tokens": 2})


# ----------------------------------------------------------------------------- chat function


@pytest.mark.parametrize("kwargs, needle", [
    ({"temperature": 5.0}, "temperature must be between 0.0 and 2.0, got 5.0"),
    ({"temperature": -1.0}, "temperature must be between 0.0 and 2.0"),
    ({"max_tokens": 5000}, "max_tokens must be between 1 and 4096, got 5000"),
    ({"max_tokens": 0}, "max_tokens must be between 1 and 4096"),
    ({"max_tokens": float("nan")}, "max_tokens must be a number"),
    ({"top_p": 0.0}, "top_p must be in (0, 1]"),
    ({"message": "x" * 8001}, "The message is 8001 characters long; the limit is 8000"),
    ({"system_prompt": "s" * 8001}, "The system prompt is 8001 characters long"),
])
async def test_ui_refuses_what_v1_refuses_with_the_reason_in_the_chat(kwargs, needle):
    backend = FakeBackend()
    args = {"message": "hi", "history": [], "system_prompt": "", "temperature": 0.7,
            "top_p": 0.95, "max_tokens": 16, **kwargs}
    out = await collect(make_chat_fn(backend, limits=Limits())(**args))
    (text, speed), = out
    assert text.startswith(ERROR_PREFIX) and needle in text, text
    assert "failed" in speed
    assert backend.requests == []  # refused before the backend saw it


async def test_ui_uses_the_servers_limits_not_the_defaults():
    backend = FakeBackend()
    limits = Limits(max_message_chars=20, max_conversation_chars=30, max_temperature=1.0,
                    max_tokens=8)
    chat = make_chat_fn(backend, limits=limits)
    for args, needle in [
        (("a" * 21, [], "", 0.5, 1.0, 8), "The message is 21 characters long; the limit is 20"),
        (("a" * 20, [], "b" * 15, 0.5, 1.0, 8),
         "The conversation is 35 characters long; the limit is 30"),
        (("hi", [], "", 1.5, 1.0, 8), "temperature must be between 0.0 and 1.0"),
        (("hi", [], "", 0.5, 1.0, 9), "max_tokens must be between 1 and 8"),
    ]:
        (text, _), = await collect(chat(*args))
        assert text.startswith(ERROR_PREFIX) and needle in text, (args, text)
    out = await collect(chat("a" * 20, [], "b" * 10, 1.0, 1.0, 8))
    assert "tokens/s" in out[-1][1] and len(backend.requests) == 1


async def test_ui_rate_limit_refuses_in_the_chat():
    backend = FakeBackend(words=1)
    chat = make_chat_fn(backend, rate_limiter=RateLimiter(2))
    for _ in range(2):
        assert "tokens/s" in (await collect(chat("hi", [])))[-1][1]
    (text, speed), = await collect(chat("hi", []))
    assert text.startswith(ERROR_PREFIX + "Rate limit reached: at most 2 requests per minute")
    assert "failed" in speed and len(backend.requests) == 2


# ----------------------------------------------------------------------------- real servers


def test_ui_and_v1_share_one_rate_limit_bucket_per_key(tiny_engine):
    app = create_app(tiny_engine, api_keys=["sk-a", "sk-b"], rate_limit_per_minute=2)
    with running_server(app) as url:
        assert v1_chat(url, "sk-a").status_code == 200
        client = Client(url + "/", verbose=False, auth=("alice", "sk-a"))
        try:
            text, speed = ui_chat(client, "hello")
            assert "tokens/s" in speed, text
            text, speed = ui_chat(client, "again")  # the key's third request this minute
            assert text.startswith(ERROR_PREFIX + "Rate limit reached"), text
            assert "failed" in speed
        finally:
            client.close()
        limited = v1_chat(url, "sk-a")
        assert limited.status_code == 429 and limited.headers["Retry-After"]
        other = Client(url + "/", verbose=False, auth=("bob", "sk-b"))  # another key: own bucket
        try:
            assert "tokens/s" in ui_chat(other, "hi")[1]
        finally:
            other.close()
        assert v1_chat(url, "sk-b").status_code == 200


def test_ui_without_keys_shares_the_client_address_bucket(tiny_engine):
    with running_server(create_app(tiny_engine, rate_limit_per_minute=1)) as url:
        assert v1_chat(url).status_code == 200  # 127.0.0.1 used its request
        client = Client(url + "/", verbose=False)
        try:
            text, _ = ui_chat(client, "hi")
            assert text.startswith(ERROR_PREFIX + "Rate limit reached"), text
        finally:
            client.close()


def test_gradio_api_of_a_keyed_app_refuses_clients_without_a_login(tiny_engine):
    app = create_app(tiny_engine, api_keys=["sk-ui"],
                     limits=Limits(max_tokens=8, max_message_chars=50))
    with running_server(app) as url:
        assert "login" in login_refused(url).lower()
        assert "login" in login_refused(url, ("me", "sk-wrong")).lower()
        for path in ("/config", "/gradio_api/info", "/gradio_api/queue/join"):
            r = httpx.request("POST" if path.endswith("join") else "GET", url + path,
                              json={"data": ["hi"], "fn_index": 0, "session_hash": "x"})
            assert r.status_code == 401, (path, r.status_code, r.text[:200])
        client = Client(url + "/", verbose=False, auth=("me", "sk-ui"))
        try:
            assert "tokens/s" in ui_chat(client, "hi")[1]
            text, _ = ui_chat(client, "x" * 51)  # the app's Limits, via the API
            assert text.startswith(ERROR_PREFIX) and "51 characters long; the limit is 50" in text
            with pytest.raises(AppError, match="greater than maximum value 8"):
                ui_chat(client, "hi", max_tokens=9)  # gradio checks the slider's range too
        finally:
            client.close()
