"""launch(): real servers on real ports, in this process; stop, relaunch, update, share, errors."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from nbserve.serving.launch import Server, launch, running_servers

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [{"role": "user", "content": "Say something."}]


# ----------------------------------------------------------------------------- helpers


class RamblingModel:
    """Wraps a StepModel: sleeps `delay` s per forward and never emits token 2 (<|im_end|>),
    so answers run to max_tokens slowly enough to stop, update or watch them mid-way."""

    def __init__(self, inner: Any, delay: float = 0.0, banned: tuple[int, ...] = (0, 2)):
        self.inner, self.delay, self.banned = inner, delay, list(banned)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.delay:
            time.sleep(self.delay)
        logits = self.inner.forward(*args, **kwargs)
        banned = torch.tensor(self.banned, device=logits.device)
        return logits.index_fill(-1, banned, float("-inf"))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def rambling(model_dir: Path, delay: float = 0.0, name: str | None = None):
    """A LoadedModel of `model_dir` wrapped in `RamblingModel`."""
    from nbserve.loading.hf_dir import load_hf_dir

    loaded = load_hf_dir(model_dir)
    return dataclasses.replace(loaded, model=RamblingModel(loaded.model, delay),
                               name=name or loaded.name)


def thread_names() -> set[str]:
    return {t.name for t in threading.enumerate() if t.is_alive()}


def wait_for(cond, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def greedy(srv: Server, max_tokens: int = 12, **kw: Any) -> str:
    client = srv.openai_client(max_retries=0, timeout=60)
    out = client.chat.completions.create(model=srv.engine.model_name, messages=PROMPT,
                                         temperature=0, max_tokens=max_tokens, **kw)
    return out.choices[0].message.content


@pytest.fixture(scope="module")
def second_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with other random weights (seed 1): answers differ from tiny_llama_dir."""
    from tiny_models import make_tiny_hf_dir

    return make_tiny_hf_dir(tmp_path_factory.mktemp("models") / "tiny-llama-b", seed=1)


pytestmark = pytest.mark.usefixtures("no_server_left")


# ----------------------------------------------------------------------------- lifecycle


def test_launch_stop_launch_leaves_no_thread_and_frees_the_port(tiny_llama_dir, capsys):
    before = thread_names()
    srv = launch(str(tiny_llama_dir), max_batch=2)
    port = srv.port
    assert srv.url == f"http://127.0.0.1:{port}" and srv.api_base == srv.url + "/v1"
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert srv.url in line and srv.api_base in line and "tiny-llama" in line
    assert isinstance(greedy(srv), str)
    engine = srv.engine
    t0 = time.monotonic()
    srv.stop()
    assert time.monotonic() - t0 < 3
    srv.stop()  # idempotent
    assert not srv.running and not engine._thread.is_alive()
    wait_for(lambda: thread_names() <= before, 5, f"threads {thread_names() - before} to end")
    with pytest.raises(httpx.ConnectError):
        httpx.get(srv.url + "/health", timeout=2)

    again = launch(str(tiny_llama_dir), port=port, max_batch=2)  # the port is free again
    assert again.port == port and httpx.get(again.url + "/health").json()["ready"]
    old_engine = weakref.ref(again.engine)
    third = launch(str(tiny_llama_dir), port=port, max_batch=2)  # same cell run twice
    assert "stopping the previous server on port" in capsys.readouterr().out
    assert not again.running and third.running
    assert old_engine() is None  # its memory was freed, though `again` is still referenced
    assert "Stopped" in repr(again.engine)
    assert httpx.get(third.url + "/health").json()["ready"]
    third.stop()
    wait_for(lambda: thread_names() <= before, 5, f"threads {thread_names() - before} to end")


def test_stop_cancels_a_request_still_streaming(tiny_llama_dir):
    srv = launch(rambling(tiny_llama_dir, delay=0.02), max_batch=2)
    engine = srv.engine
    client = srv.openai_client(max_retries=0, timeout=30)
    got: list[Any] = []

    def consume() -> None:
        try:
            stream = client.chat.completions.create(
                model=engine.model_name, messages=PROMPT, stream=True, max_tokens=400)
            got.extend(stream)
        except Exception as exc:  # noqa: BLE001 -- the connection ends mid-stream
            got.append(exc)

    reader = threading.Thread(target=consume)
    reader.start()
    try:
        wait_for(lambda: engine.stats()["running"] == 1, 20, "the request to run")
        t0 = time.monotonic()
        srv.stop(timeout=0.5)  # drain for 0.5 s, then cancel
        assert time.monotonic() - t0 < 4
        reader.join(10)
        assert not reader.is_alive()
        assert engine.stats()["running"] == 0 and engine.stats()["tokens_decoded"] < 399
    finally:
        srv.stop()
        reader.join(10)


def test_two_servers_on_two_ports_at_once(tiny_llama_dir, second_model_dir, capsys):
    a = launch(str(tiny_llama_dir), max_batch=2)
    b = launch(str(second_model_dir), max_batch=2)
    try:
        assert a.port != b.port and set(running_servers()) == {a, b}
        assert f"other servers of this process still run on port(s) {a.port}" in \
            capsys.readouterr().out
        ids = [httpx.get(s.api_base + "/models").json()["data"][0]["id"] for s in (a, b)]
        assert ids == ["tiny-llama", "tiny-llama-b"]
        assert greedy(a) != greedy(b)
        a.stop()
        assert b.running and httpx.get(b.url + "/health").json()["ready"]
    finally:
        a.stop()
        b.stop()


def test_relaunching_the_same_model_without_a_port_replaces_the_earlier_server(
        tiny_llama_dir, second_model_dir, capsys, monkeypatch):
    """Re-running `srv = nbserve.launch(path)` must not leave a second copy of the model."""
    first = launch(str(tiny_llama_dir), max_batch=2)
    engine = weakref.ref(first.engine)
    other = launch(str(second_model_dir), max_batch=2)  # another model: both run
    capsys.readouterr()
    monkeypatch.chdir(tiny_llama_dir.parent)
    again = launch(f"./{tiny_llama_dir.name}/", max_batch=2)  # the same directory, spelt otherwise
    printed = capsys.readouterr().out.splitlines()
    assert not first.running and again.running and other.running
    assert engine() is None  # the first copy's weights are freed
    stopping = [ln for ln in printed if "stopping" in ln]
    assert stopping == [(f"nbserve: stopping the previous server of tiny-llama on port "
                         f"{first.port} (pass port= to keep both)")]
    with socket.socket() as s:
        s.bind(("127.0.0.1", first.port))  # its port is free
    explicit = launch(str(tiny_llama_dir), port=first.port, max_batch=2)  # asked for a port
    assert again.running and explicit.running
    assert "stopping" not in capsys.readouterr().out
    assert set(running_servers()) == {other, again, explicit}
    for srv in (other, again, explicit):
        srv.stop()


def test_relaunching_the_same_model_object_replaces_the_earlier_server(tiny_llama_dir, capsys):
    from nbserve.engine import Engine
    from nbserve.loading.hf_dir import load_hf_dir

    loaded = load_hf_dir(tiny_llama_dir)
    first = launch(loaded, max_batch=2)
    second = launch(loaded, max_batch=2)
    assert not first.running and second.running
    assert "stopping the previous server of tiny-llama" in capsys.readouterr().out
    second.stop()
    engine = Engine(loaded, max_batch=2)  # an engine served as is: not closed by the stop
    try:
        first, second = launch(engine), launch(engine)
        assert not first.running and second.running and engine.complete("a", max_tokens=2)
        second.stop()
    finally:
        engine.close()


def test_existing_engine_is_served_as_is_and_stays_open(tiny_llama_dir):
    from nbserve.engine import Engine
    from nbserve.loading.hf_dir import load_hf_dir

    engine = Engine(load_hf_dir(tiny_llama_dir), max_batch=2)
    try:
        srv = launch(engine)
        assert srv.engine is engine
        via_http = greedy(srv, 8)
        srv.stop()
        assert engine.chat(PROMPT, temperature=0, max_tokens=8) == via_http
        with pytest.raises(ValueError, match="only apply when nbserve builds the engine"):
            launch(engine, max_batch=4)
    finally:
        engine.close()


def test_repr_and_notebook_display(tiny_llama_dir):
    srv = launch(str(tiny_llama_dir), max_batch=2)
    try:
        assert repr(srv) == (f"Server('tiny-llama', url='{srv.url}', api_base='{srv.api_base}', "
                             "running)")
        page = srv._repr_html_()
        assert f'href="{srv.url}"' in page and srv.api_base in page
        assert f'<iframe src="{srv.url}"' in page
    finally:
        srv.stop()
    assert "stopped" in repr(srv) and "stopped" in srv._repr_html_()


def test_ui_false_serves_only_the_api(tiny_llama_dir):
    srv = launch(str(tiny_llama_dir), ui=False, max_batch=2)
    try:
        assert httpx.get(srv.url + "/").status_code == 404
        assert isinstance(greedy(srv, 4), str)
        assert "<iframe" not in srv._repr_html_()
    finally:
        srv.stop()


# ----------------------------------------------------------------------------- update


def test_update_under_load_finishes_old_requests_on_old_weights(tiny_llama_dir, second_model_dir):
    from nbserve.engine import Engine

    n_tokens = 40
    refs = {}
    for key, path in (("a", tiny_llama_dir), ("b", second_model_dir)):
        with Engine(rambling(path), max_batch=8) as eng:
            refs[key] = eng.chat(PROMPT, temperature=0, max_tokens=n_tokens)
    assert refs["a"] != refs["b"]

    srv = launch(rambling(tiny_llama_dir, delay=0.01, name="model-a"), max_batch=8)
    try:
        old = srv.engine
        client = srv.openai_client(max_retries=0, timeout=60)

        def ask(model: str) -> tuple[str, str]:
            parts, reason = [], None
            stream = client.chat.completions.create(model=model, messages=PROMPT, stream=True,
                                                    temperature=0, max_tokens=n_tokens)
            for chunk in stream:
                if chunk.choices:
                    parts.append(chunk.choices[0].delta.content or "")
                    reason = chunk.choices[0].finish_reason or reason
            return "".join(parts), reason

        with ThreadPoolExecutor(6) as pool:
            in_flight = [pool.submit(ask, "model-a") for _ in range(6)]
            wait_for(lambda: old.stats()["running"] == 6, 20, "6 requests running")
            srv.update(rambling(second_model_dir, name="model-b"))
            assert srv.engine is not old and srv.engine.model_name == "model-b"
            after = [pool.submit(ask, "model-b") for _ in range(3)]
            results = [f.result(timeout=60) for f in in_flight + after]
        assert results[:6] == [(refs["a"], "length")] * 6  # finished on the old weights
        assert results[6:] == [(refs["b"], "length")] * 3  # new requests: new weights
        wait_for(lambda: not old._thread.is_alive(), 10, "the old engine to be closed")
        assert httpx.get(srv.api_base + "/models").json()["data"][0]["id"] == "model-b"
        srv.update()  # no argument: rebuild from the model last given
        assert srv.engine.model_name == "model-b" and greedy(srv, n_tokens) == refs["b"]
    finally:
        srv.stop()
    with pytest.raises(RuntimeError, match="stopped"):
        srv.update(str(tiny_llama_dir))


# ----------------------------------------------------------------------------- share links


def test_share_offline_warns_quickly_and_serves_locally(tiny_llama_dir, capsys, monkeypatch):
    import gradio.networking

    monkeypatch.setattr(gradio.networking, "GRADIO_API_SERVER", "http://127.0.0.1:9/v3/tunnel")
    t0 = time.monotonic()
    srv = launch(str(tiny_llama_dir), share=True, max_batch=2)
    try:
        assert time.monotonic() - t0 < 8
        out = capsys.readouterr().out
        assert "WARNING: could not create a share link" in out and "only reachable locally" in out
        (key,) = srv.api_keys  # share=True is keyed even when the tunnel fails
        assert srv.share_url is None and out.count(key) == 1
        assert httpx.get(srv.api_base + "/models").status_code == 401
    finally:
        srv.stop()


def test_share_service_that_never_answers_hits_the_deadline(tiny_llama_dir, capsys, monkeypatch):
    import gradio.networking

    import nbserve.serving.share

    monkeypatch.setattr(nbserve.serving.share, "SHARE_DEADLINE_S", 0.5)
    monkeypatch.setattr(gradio.networking, "setup_tunnel", lambda *a, **k: time.sleep(3))
    srv = launch(str(tiny_llama_dir), share=True, max_batch=2)
    try:
        assert "within 0.5 s" in capsys.readouterr().out and srv.share_url is None
        assert httpx.get(srv.url + "/health").json()["ready"]
    finally:
        srv.stop()


def test_share_link_generates_an_api_key_for_v1_and_the_ui(tiny_llama_dir, capsys, monkeypatch):
    import gradio.networking

    monkeypatch.setattr(gradio.networking, "setup_tunnel",
                        lambda *a, **k: "https://abc123.gradio.live")
    srv = launch(str(tiny_llama_dir), share=True, max_batch=2)
    try:
        out = capsys.readouterr().out
        assert srv.share_url == "https://abc123.gradio.live" and srv.share_url in out
        (key,) = srv.api_keys
        assert out.count(key) == 1 and "shown once" in out
        assert httpx.get(srv.api_base + "/models").status_code == 401
        headers = {"Authorization": f"Bearer {key}"}
        assert httpx.get(srv.api_base + "/models", headers=headers).status_code == 200
        assert isinstance(greedy(srv, 4), str)  # openai_client() carries the key
        assert httpx.get(srv.url + "/config").status_code == 401  # the shared UI asks for it too
        assert f'<iframe src="{srv.share_url}"' in srv._repr_html_()
    finally:
        srv.stop()


# ----------------------------------------------------------------------------- bad arguments


def test_port_held_by_another_process_is_a_clear_error(tiny_llama_dir):
    code = ("import socket, time; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); "
            "print(s.getsockname()[1], flush=True); time.sleep(60)")
    other = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        port = int(other.stdout.readline())
        with pytest.raises(OSError, match=f"port {port} .* already in use by another process"):
            launch(str(tiny_llama_dir), port=port)
    finally:
        other.kill()
        other.wait()


def test_unknown_model_is_a_clear_error_and_frees_the_port(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(FileNotFoundError, match="not found: expected 'smollm2'"):
        launch(str(tmp_path / "no-such-model"), port=port)
    with pytest.raises(TypeError, match="cannot serve a int. Accepted models: a source"):
        launch(42, port=port)
    with pytest.raises(ValueError, match="port must be an integer"):
        launch("smollm2", port=70000)
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # nothing kept it


def test_app_py_help_lists_the_options():
    out = subprocess.run([sys.executable, str(ROOT / "app.py"), "--help"], capture_output=True,
                         text=True, timeout=60, cwd=ROOT, check=False)
    assert out.returncode == 0
    for flag in ("--model", "--port", "--host", "--share", "--devices", "--max-batch",
                 "--api-key"):
        assert flag in out.stdout


def _ignore_ctrl_c() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.slow
@pytest.mark.parametrize("inherited", ["default", "ignored"])
def test_cli_serve_answers_then_stops_cleanly_on_ctrl_c(tiny_llama_dir, inherited):
    """`nbserve serve` stops on SIGINT. "ignored": a background job of a script (`nbserve
    serve M &`, or a CI that starts the suite so) inherits SIGINT ignored, and Python then
    never raises KeyboardInterrupt; `kill -INT` must still stop it, as it stops uvicorn's and
    llama.cpp's servers (a fresh-clone CI started in the background hung here)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "nbserve.serving.cli", "serve",
                             str(tiny_llama_dir), "--port", "0", "--max-batch", "2"],
                            cwd=ROOT, env=env,
                            preexec_fn=_ignore_ctrl_c if inherited == "ignored" else None,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = None
        for line in proc.stdout:
            if " at http://" in line:
                url = line.split(" at ")[1].split()[0]
                break
        assert url, "the CLI never printed its URL"
        assert httpx.get(url + "/health", timeout=10).json()["ready"]
        proc.send_signal(signal.SIGINT)
        try:
            rc = proc.wait(timeout=20)
        except subprocess.TimeoutExpired:  # say where it hangs: faulthandler dumps each thread
            proc.send_signal(signal.SIGABRT)
            proc.wait(10)
            pytest.fail("the CLI did not stop within 20 s of Ctrl-C; it printed:\n"
                        + proc.stdout.read()[-6000:])
        assert rc == 0
        assert "stopping" in proc.stdout.read()
    finally:
        proc.kill()
        proc.wait()


def test_ctrl_c_as_launch_returns_still_stops_the_server(tiny_llama_dir, monkeypatch, capsys):
    """serve() stops what it started wherever Ctrl-C lands, here between launch() returning
    and serve() holding the server: one left running keeps `nbserve serve` from exiting (its
    threads are not daemons), the hang a CI run met once."""
    import nbserve.serving.launch as launching

    started: list[Server] = []

    def launch_then_ctrl_c(*args: Any, **kwargs: Any) -> Server:
        started.append(real_launch(*args, **kwargs))
        raise KeyboardInterrupt

    real_launch = launching.launch
    monkeypatch.setattr(launching, "launch", launch_then_ctrl_c)
    try:
        launching.serve(str(tiny_llama_dir), max_batch=2)  # Ctrl-C is how serve() ends
    except KeyboardInterrupt:  # (caught here: one that reached pytest would end the session)
        pytest.fail("serve() let the Ctrl-C out instead of stopping")
    assert started and not started[0].running and running_servers() == []
    assert "stopping" in capsys.readouterr().out


def test_ctrl_c_while_launch_announces_leaves_nothing_running(tiny_llama_dir, monkeypatch):
    """A Ctrl-C (a notebook's interrupt) while launch() prints its URL: launch() raises it and
    stops the server it had started, as it does for one during the start."""
    import builtins

    import nbserve.serving.launch as launching

    def print_then_ctrl_c(*args: Any, **kwargs: Any) -> None:
        builtins.print(*args, **kwargs)
        if args and " at http://" in str(args[0]):
            raise KeyboardInterrupt

    monkeypatch.setattr(launching, "print", print_then_ctrl_c, raising=False)
    with pytest.raises(KeyboardInterrupt):
        launch(str(tiny_llama_dir), max_batch=2)
    assert running_servers() == []


def test_nbserve_launch_stays_callable_after_its_module_is_imported():
    """Re-running `srv = nbserve.launch(...)` in a notebook must work: importing the submodule
    nbserve.launch must not replace the function `nbserve.launch` (nbserve/__init__.py has to
    import it eagerly: `from .launch import Server, launch, serve`)."""
    import importlib

    import nbserve

    importlib.import_module("nbserve.serving.launch")
    assert callable(nbserve.launch) and nbserve.launch is launch
    assert nbserve.serve is importlib.import_module("nbserve.serving.launch").serve


def test_without_gradio_the_api_serves_and_the_ui_is_off(tiny_llama_dir):
    """nbserve imports and serves where gradio is not installed (the bare GPU image of
    benchmarks/gpu_check.sh, or a user who never wants the UI): asked for the UI, launch warns
    and serves the API. A fresh process in which importing gradio fails."""

    code = ("import sys\n"
            "sys.modules['gradio'] = None  # as if not installed: its import raises\n"
            "import httpx, nbserve\n"
            f"srv = nbserve.launch({str(tiny_llama_dir)!r})\n"
            "print('models', httpx.get(srv.api_base + '/models').status_code, 'ui', srv.ui)\n"
            "srv.stop()\n"
            f"srv = nbserve.launch({str(tiny_llama_dir)!r}, ui=False)\n"
            "print('plain', httpx.get(srv.api_base + '/models').status_code)\n"
            "srv.stop()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "models 200 ui False" in out.stdout and "plain 200" in out.stdout, out.stdout
    assert "chat UI not mounted" in out.stdout
