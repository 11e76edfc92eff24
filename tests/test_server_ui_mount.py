"""create_app(ui=True): the Gradio chat is mounted at / and the API routes still win."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from server_util import engine_running, running_server

from nbserve.server import create_app


@pytest.fixture(scope="module")
def tiny_engine(tiny_llama_dir: Any) -> Iterator[Any]:
    with engine_running(tiny_llama_dir) as engine:
        yield engine



def test_ui_is_mounted_after_the_api(tiny_engine: Any) -> None:
    app = create_app(tiny_engine)
    with running_server(app) as url:
        page = httpx.get(url + "/")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        assert httpx.get(url + "/health").json()["ready"] is True
        models = httpx.get(url + "/v1/models").json()
        assert models["data"][0]["id"] == tiny_engine.model_name
        unknown = httpx.post(url + "/v1/audio/speech", json={"input": "x"})
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "unknown_url"
        r = httpx.post(url + "/v1/chat/completions",
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 200


def test_the_ui_queue_does_not_poll_every_millisecond(tiny_engine: Any) -> None:
    """gradio's queue loops run on the server's event loop even with nobody in the UI; at
    their default 1 ms they take the GIL a thousand times a second from the engine."""
    from nbserve.serving.ui import PROGRESS_POLL_S, QUEUE_POLL_S, _gradio_apps

    app = create_app(tiny_engine)
    with running_server(app) as url:
        [gradio_app] = _gradio_apps(app)
        queue = gradio_app.get_blocks()._queue
        assert queue.sleep_when_free >= QUEUE_POLL_S >= 0.01
        assert queue.progress_update_sleep_when_free >= PROGRESS_POLL_S
        info = httpx.get(url + "/gradio_api/info")  # the mounted UI still answers
        assert info.status_code == 200 and "/chat" in info.json()["named_endpoints"]
