"""Who may use the chat UI: the launch's access decision, and launch(share=True / ui_password=)
on real servers (the share service is unreachable here, so the tunnel fails or is faked)."""

from __future__ import annotations

import httpx
import pytest
from gradio_client import Client
from test_ui_limits import login_refused, ui_chat

from nbserve.serving.access import decide_access
from nbserve.serving.launch import launch


def offline_share(monkeypatch: pytest.MonkeyPatch) -> None:
    import gradio.networking

    monkeypatch.setattr(gradio.networking, "GRADIO_API_SERVER", "http://127.0.0.1:9/v3/tunnel")


# ----------------------------------------------------------------------------- the decision


def test_local_launch_without_keys_is_open():
    access = decide_access(share=False, api_keys=[], ui_password=None, ui=True)
    assert access.api_keys == [] and access.generated_key is None and not access.ui_login


def test_share_without_keys_generates_one_for_v1_and_the_ui():
    access = decide_access(share=True, api_keys=[], ui_password=None, ui=True)
    key = access.generated_key
    assert key and key.startswith("nb-") and access.api_keys == [key]
    assert access.ui_login and access.ui_password is None
    assert decide_access(share=True, api_keys=[], ui_password=None, ui=True).generated_key != key


def test_share_with_keys_uses_them_everywhere():
    access = decide_access(share=True, api_keys=["sk-1"], ui_password=None, ui=True)
    assert access.api_keys == ["sk-1"] and access.generated_key is None and access.ui_login


def test_ui_password_protects_the_ui_and_share_still_keys_v1():
    local = decide_access(share=False, api_keys=[], ui_password="open sesame", ui=True)
    assert local.ui_login and local.api_keys == [] and local.ui_password == "open sesame"
    shared = decide_access(share=True, api_keys=[], ui_password="open sesame", ui=True)
    assert shared.generated_key and shared.api_keys == [shared.generated_key]
    assert shared.ui_password == "open sesame"


@pytest.mark.parametrize("password, ui, needle", [
    ("", True, "ui_password must be a non-empty string"),
    ("   ", True, "ui_password must be a non-empty string"),
    (42, True, "ui_password must be a non-empty string"),
    ("pw", False, "ui_password protects the chat UI, but ui=False"),
])
def test_bad_ui_password_is_a_clear_error(password, ui, needle):
    with pytest.raises(ValueError, match=needle):
        decide_access(share=False, api_keys=[], ui_password=password, ui=ui)


# ----------------------------------------------------------------------------- real launches


def test_share_whose_tunnel_fails_still_asks_for_the_key(tiny_llama_dir, capsys, monkeypatch):
    offline_share(monkeypatch)
    srv = launch(str(tiny_llama_dir), share=True, max_batch=2, max_context=128)
    try:
        out = capsys.readouterr().out
        assert srv.share_url is None and "could not create a share link" in out
        (key,) = srv.api_keys
        assert out.count(key) == 1 and "chat UI" in out
        assert httpx.get(srv.api_base + "/models").status_code == 401
        assert httpx.get(srv.url + "/config").status_code == 401
        assert "login" in login_refused(srv.url).lower()
        client = Client(srv.url + "/", verbose=False, auth=("anyone", key))
        try:
            assert "tokens/s" in ui_chat(client, "hi")[1]
        finally:
            client.close()
    finally:
        srv.stop()


def test_shared_app_with_a_ui_password(tiny_llama_dir, capsys, monkeypatch):
    import gradio.networking

    monkeypatch.setattr(gradio.networking, "setup_tunnel",
                        lambda *a, **k: "https://abc123.gradio.live")
    srv = launch(str(tiny_llama_dir), share=True, ui_password="open sesame", max_batch=2,
                 max_context=128)
    try:
        out = capsys.readouterr().out
        assert "open sesame" not in out  # the user knows it: never printed
        (key,) = srv.api_keys
        # what the README says a share link exposes without the key
        for path in ("/v1/models", "/stats", "/metrics", "/config", "/gradio_api/info"):
            assert httpx.get(srv.url + path).status_code == 401, path
        for path in ("/health", "/docs", "/openapi.json"):
            assert httpx.get(srv.url + path).status_code == 200, path
        assert "login" in login_refused(srv.url).lower()
        assert "login" in login_refused(srv.url, ("me", "wrong")).lower()
        for password in ("open sesame", key):
            client = Client(srv.url + "/", verbose=False, auth=("me", password))
            try:
                assert "tokens/s" in ui_chat(client, "hi")[1]
            finally:
                client.close()
    finally:
        srv.stop()


def test_local_ui_password_leaves_v1_as_configured(tiny_llama_dir):
    srv = launch(str(tiny_llama_dir), ui_password="pw", max_batch=2, max_context=128)
    try:
        assert srv.api_keys == []
        assert httpx.get(srv.api_base + "/models").status_code == 200
        assert httpx.get(srv.url + "/config").status_code == 401
        client = Client(srv.url + "/", verbose=False, auth=("me", "pw"))
        try:
            assert "tokens/s" in ui_chat(client, "hi")[1]
        finally:
            client.close()
    finally:
        srv.stop()
