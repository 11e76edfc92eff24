"""launch() returns before the model has loaded (issue 40, item 8): while it loads, /health says
"loading" and the API answers 503; srv.ready, srv.wait(); a failed load is surfaced.

The slow load is a model whose engine cannot be built until the test sets an event
(`slow_loads.gated`), so nothing here depends on timing.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from slow_loads import gated

from nbserve.serving.launch import launch

PROMPT = [{"role": "user", "content": "Say something."}]

pytestmark = pytest.mark.usefixtures("no_server_left")


def _client(srv) -> openai.OpenAI:
    """A client that does not wait for the model (srv.openai_client() does) nor retry."""
    return openai.OpenAI(base_url=srv.api_base, api_key="unused", max_retries=0, timeout=60)


def test_launch_returns_before_the_model_loads_and_the_api_answers_503_until_ready(
        tiny_llama_dir, capsys):
    gate = threading.Event()
    srv = launch(gated(tiny_llama_dir, gate, name="gated-llama"), wait=False, max_batch=2)
    try:
        assert not srv.ready and "loading" in repr(srv)
        assert "nbserve: loading gated-llama at http://127.0.0.1:" in capsys.readouterr().out

        health = httpx.get(srv.url + "/health", timeout=30)
        assert health.status_code == 503
        assert health.json()["status"] == "loading" and health.json()["ready"] is False

        with pytest.raises(openai.APIStatusError) as refused:
            _client(srv).chat.completions.create(model="gated-llama", messages=PROMPT,
                                                 max_tokens=4)
        assert refused.value.status_code == 503
        assert refused.value.code == "model_loading"
        assert "still loading" in refused.value.message
        assert refused.value.response.headers["retry-after"] == "2"
        for method, path, body in (("POST", "/v1/completions", {"model": "m", "prompt": "a"}),
                                   ("GET", "/v1/models", None),
                                   ("POST", "/tokenize", {"prompt": "hi"}),
                                   ("POST", "/detokenize", {"tokens": [1]})):
            answer = httpx.request(method, srv.url + path, json=body, timeout=30)
            assert answer.status_code == 503, path
            assert answer.json()["error"]["code"] == "model_loading", path
        answer = httpx.post(srv.url + "/v1/messages", timeout=30, json={
            "model": "gated-llama", "max_tokens": 4, "messages": PROMPT})  # Anthropic's shape
        assert answer.status_code == 503 and answer.json()["type"] == "error"
        assert answer.json()["error"]["type"] == "overloaded_error"
        assert "still loading" in answer.json()["error"]["message"]
        page = httpx.get(srv.url + "/", timeout=30)  # the chat UI's page says it loads
        assert page.status_code == 503 and "Loading gated-llama" in page.text
        assert httpx.get(srv.url + "/stats", timeout=30).json()["loading"] is True

        gate.set()
        assert srv.wait() is srv and srv.ready
        assert httpx.get(srv.url + "/health", timeout=30).status_code == 200
        reply = srv.openai_client(max_retries=0).chat.completions.create(
            model="gated-llama", messages=PROMPT, max_tokens=4, temperature=0)
        assert reply.choices[0].finish_reason == "length"
        assert "<gradio-app" in httpx.get(srv.url + "/", timeout=30).text  # the chat now
        assert "nbserve: gated-llama is ready at" in capsys.readouterr().out
    finally:
        gate.set()
        srv.stop()


def test_engine_and_openai_client_wait_for_the_model(tiny_llama_dir):
    """What a notebook does next (srv.engine.chat, srv.openai_client()) waits for the load."""
    gate = threading.Event()
    srv = launch(gated(tiny_llama_dir, gate), wait=False, max_batch=2, ui=False)
    try:
        with pytest.raises(TimeoutError, match="still loading"):
            srv.wait(timeout=0)
        opened = threading.Timer(0.2, gate.set)  # opened while the engine property waits
        opened.start()
        assert srv.engine.chat("Hi", max_tokens=3, temperature=0) is not None
        assert srv.ready
        opened.join()
    finally:
        gate.set()
        srv.stop()


def _broken_model_dir(tiny_llama_dir: Path, tmp_path: Path) -> Path:
    """The tiny model's files with a weights file that is not one."""
    broken = tmp_path / "broken-llama"
    broken.mkdir()
    for f in tiny_llama_dir.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            (broken / f.name).write_bytes(f.read_bytes())
    (broken / "model.safetensors").write_bytes(json.dumps({"not": "weights"}).encode())
    return broken


def test_a_failed_load_is_surfaced_by_wait_health_and_the_api(tiny_llama_dir, tmp_path,
                                                                 capsys):
    broken = _broken_model_dir(tiny_llama_dir, tmp_path)
    with pytest.raises(Exception) as direct:  # what a plain load of it raises
        launch(str(broken), wait=True, ui=False)
    srv = launch(str(broken), wait=False, ui=False, max_batch=2)
    try:
        with pytest.raises(type(direct.value)):
            srv.wait()
        assert not srv.ready
        health = httpx.get(srv.url + "/health", timeout=30)
        assert health.status_code == 503
        assert health.json()["status"] == "error"
        assert type(direct.value).__name__ in health.json()["detail"]
        with pytest.raises(openai.APIStatusError) as refused:
            _client(srv).chat.completions.create(model="m", messages=PROMPT, max_tokens=4)
        assert refused.value.status_code == 503 and refused.value.code == "model_load_failed"
        assert f"nbserve: loading {broken} failed: " in capsys.readouterr().out

        srv.update(str(tiny_llama_dir))  # serving another model recovers the server
        assert srv.ready and srv.wait() is srv
        assert httpx.get(srv.url + "/health", timeout=30).status_code == 200
        reply = _client(srv).chat.completions.create(model=srv.engine.model_name,
                                                     messages=PROMPT, max_tokens=3)
        assert reply.choices[0].message.content is not None
    finally:
        srv.stop()


def test_stop_while_loading_closes_what_the_load_builds(tiny_llama_dir):
    gate = threading.Event()
    # threads an earlier test left for the process (the grammar masks' worker) are not this one's
    before = {t for t in threading.enumerate() if t.name.startswith("nbserve")}
    srv = launch(gated(tiny_llama_dir, gate), wait=False, max_batch=2, ui=False)
    loader = next(t for t in threading.enumerate() if t.name == f"nbserve-load-{srv.port}")
    srv.stop()
    with pytest.raises(RuntimeError, match="stopped before its model"):
        srv.wait()
    gate.set()
    loader.join(60)
    assert not loader.is_alive()
    assert not [t.name for t in threading.enumerate()
                if t.name.startswith("nbserve") and t not in before]


def _held_ui(monkeypatch, fail: Exception | None = None) -> tuple[threading.Event,
                                                                   threading.Event]:
    """(building, release): the chat UI's build waits for `release` once it has begun (then
    raises `fail`, if given)."""
    from nbserve.serving import ui

    building, release = threading.Event(), threading.Event()
    mount = ui.mount_ui

    def held_mount(*args, **kwargs):
        building.set()
        assert release.wait(60)
        if fail is not None:
            raise fail
        return mount(*args, **kwargs)

    monkeypatch.setattr(ui, "mount_ui", held_mount)
    return building, release


def test_the_api_serves_while_the_chat_ui_is_built(tiny_llama_dir, monkeypatch):
    """The OpenAI API serves as soon as the model is loaded; the chat UI (gradio's import
    alone takes seconds) is built afterwards (issue 42: start to ready). Until it is, its page
    says it is starting and reloads itself, its other paths answer 503 (never a 404), and
    srv.wait() waits for it; then the chat serves at /. Before, the API answered 503 until
    the UI was built."""
    building, release = _held_ui(monkeypatch)
    srv = launch(tiny_llama_dir, wait=False, max_batch=2)
    try:
        assert building.wait(120)  # the model is loaded and served; the UI is being built
        assert srv.ready
        assert httpx.get(srv.url + "/health").status_code == 200
        assert httpx.get(srv.api_base + "/models").status_code == 200
        assert httpx.post(srv.api_base + "/completions",
                          json={"model": "", "prompt": "hi", "max_tokens": 1}).status_code == 200
        assert srv.openai_client(max_retries=0).models.list().data  # waits for the model only
        assert httpx.get(srv.url + "/stats").status_code == 200
        assert httpx.get(srv.api_base + "/nothing").status_code == 404  # the API's own 404
        page = httpx.get(srv.url + "/")
        assert page.status_code == 503 and "the chat UI is starting" in page.text
        assert 'http-equiv="refresh"' in page.text
        for path in ("/config", "/gradio_api/info"):  # the chat's other paths: not a 404
            other = httpx.get(srv.url + path)
            assert other.status_code == 503, path
            assert other.json()["error"]["code"] == "ui_not_ready", path
            assert other.headers["retry-after"] == "2"
        with pytest.raises(TimeoutError, match="chat UI"):
            srv.wait(timeout=0)
        release.set()
        assert srv.wait(60) is srv
        assert "<gradio-app" in httpx.get(srv.url + "/").text
        assert httpx.get(srv.api_base + "/models").status_code == 200
    finally:
        release.set()
        srv.stop()


def test_a_chat_ui_that_fails_to_start_leaves_the_api_serving(tiny_llama_dir, monkeypatch,
                                                              capsys):
    _, release = _held_ui(monkeypatch, fail=RuntimeError("no theme"))
    release.set()
    srv = launch(tiny_llama_dir, wait=False, max_batch=2)
    try:
        assert srv.wait(60) is srv and srv.ready  # a warning, not the load's error
        assert "the chat UI failed to start (RuntimeError: no theme)" in capsys.readouterr().out
        assert httpx.post(srv.api_base + "/completions",
                          json={"model": "", "prompt": "hi", "max_tokens": 1}).status_code == 200
        page = httpx.get(srv.url + "/")
        assert page.status_code == 503 and "failed to start: RuntimeError: no theme" in page.text
        assert 'http-equiv="refresh"' not in page.text
        other = httpx.get(srv.url + "/config")
        assert other.status_code == 503 and other.json()["error"]["code"] == "ui_not_ready"
    finally:
        srv.stop()


def test_a_keyed_server_asks_for_the_key_before_saying_it_is_loading(tiny_llama_dir, tmp_path):
    """While the model loads, or after its load failed, a keyed server's API answers a request
    without a valid key 401 (as once ready), not 503 with the load's state and error (a path,
    an exception) that only a key holder may read; with the key, 503 as before. /health stays
    open."""
    broken = _broken_model_dir(tiny_llama_dir, tmp_path)
    srv = launch(str(broken), wait=False, ui=False, max_batch=2, api_keys=["sk-right"])
    try:
        deadline = time.monotonic() + 60  # until the load has failed (/health: "error")
        while httpx.get(srv.url + "/health", timeout=30).json()["status"] != "error":
            assert time.monotonic() < deadline, "the broken model's load did not fail"
            time.sleep(0.05)
        for headers in ({}, {"Authorization": "Bearer sk-wrong"}):
            for method, path in (("POST", "/v1/chat/completions"), ("GET", "/v1/models")):
                r = httpx.request(method, srv.url + path, headers=headers, timeout=30,
                                  json={"model": "m", "messages": PROMPT})
                assert r.status_code == 401, (path, headers, r.text)
                assert r.json()["error"]["code"] in ("missing_api_key", "invalid_api_key")
                assert str(broken) not in r.text and "failed to load" not in r.text
        r = httpx.get(srv.url + "/v1/models", timeout=30,
                      headers={"Authorization": "Bearer sk-right"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_load_failed"
        assert httpx.get(srv.url + "/health", timeout=30).status_code == 503  # open: no key
    finally:
        srv.stop()
