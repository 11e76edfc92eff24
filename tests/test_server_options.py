"""One set of server options for every entry point: create_app, launch, serve, `nbserve serve`
and app.py (ServerOptions); the options reach the server from each; bad ones are clear errors."""

from __future__ import annotations

import argparse
import inspect
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from nbserve.serving.launch import launch, running_servers

ROOT = Path(__file__).resolve().parents[1]
CHAT = {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 2}
ORIGIN = "http://notebook.example"


pytestmark = pytest.mark.usefixtures("no_server_left")


def _help(argv: list[str]) -> str:
    out = subprocess.run([sys.executable, *argv, "--help"], capture_output=True, text=True,
                         timeout=60, cwd=ROOT, check=False)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _check_options_reach_the_server(base: str, api_key: str | None = None) -> None:
    """limits max_tokens=5, cors_origins=[ORIGIN], no UI, and rate_limit_per_minute=2: the
    rate limit counts the refused request too (it is checked first), so the third is a 429."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    too_many = httpx.post(base + "/v1/chat/completions", headers=headers,
                          json={**CHAT, "max_tokens": 6}, timeout=30)
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "max_tokens"
    assert "between 1 and 5" in too_many.json()["error"]["message"]
    first = httpx.post(base + "/v1/chat/completions", headers={**headers, "Origin": ORIGIN},
                       json=CHAT, timeout=30)
    assert first.status_code == 200
    assert first.headers["access-control-allow-origin"] == ORIGIN
    second = httpx.post(base + "/v1/chat/completions", headers=headers, json=CHAT, timeout=30)
    assert second.status_code == 429
    assert second.json()["error"]["code"] == "rate_limit_exceeded"
    assert httpx.get(base + "/", timeout=10).status_code == 404  # ui off


# ----------------------------------------------------------------------------- one record


def test_every_create_app_option_is_a_launch_keyword_and_a_cli_flag():
    """Adding a create_app keyword without adding it to ServerOptions fails here: then launch,
    serve, `nbserve serve` and app.py could not set it."""
    from nbserve.server import create_app
    from nbserve.serving.cli import add_serve_options
    from nbserve.serving.launch import split_launch_options
    from nbserve.serving.options import ServerOptions, option_fields

    params = inspect.signature(create_app).parameters
    app_keywords = [n for n in params if n not in ("backend", "options")]
    fields = {f.name: f for f in option_fields()}
    assert set(app_keywords) <= set(fields), \
        f"create_app keywords missing from ServerOptions: {set(app_keywords) - set(fields)}"
    assert {f.name for f in option_fields(app=True)} == set(app_keywords)
    for name in app_keywords:  # create_app's default is None or the record's default
        assert params[name].default in (None, ServerOptions().__getattribute__(name)), name

    parser = argparse.ArgumentParser()
    add_serve_options(parser)  # what `nbserve serve` and app.py both call
    dests = {a.dest: a for a in parser._actions}
    cli_help = _help(["-m", "nbserve.serving.cli", "serve"])
    app_py_help = _help([str(ROOT / "app.py")])
    for name, f in fields.items():
        opts, engine_options = split_launch_options({name: ServerOptions().__getattribute__(name)})
        assert isinstance(opts, ServerOptions) and engine_options == {}, name
        assert name in dests, f"no CLI flag for {name}"
        flag = f.metadata["flag"]
        assert flag in dests[name].option_strings
        assert flag in cli_help and flag in app_py_help, flag


def test_launch_sets_rate_limit_cors_and_limits(tiny_llama_dir):
    """These were create_app-only: launch passed them to Engine, which raised TypeError."""
    srv = launch(str(tiny_llama_dir), max_batch=2, ui=False, rate_limit_per_minute=2,
                 cors_origins=[ORIGIN], limits={"max_tokens": 5})
    try:
        _check_options_reach_the_server(srv.url)
    finally:
        srv.stop()


def test_launch_takes_a_server_options_record(tiny_llama_dir):
    from nbserve import Limits, ServerOptions

    opts = ServerOptions(ui=False, rate_limit_per_minute=2, cors_origins=ORIGIN,
                         limits=Limits(max_tokens=5), api_keys="k-1")
    srv = launch(str(tiny_llama_dir), max_batch=2, options=opts)
    try:
        assert srv.api_key == "k-1"
        assert httpx.post(srv.url + "/v1/chat/completions", json=CHAT).status_code == 401
        _check_options_reach_the_server(srv.url, api_key="k-1")
    finally:
        srv.stop()


def test_create_app_takes_the_record_too(tiny_engine):
    from server_util import running_server

    from nbserve import ServerOptions, create_app

    opts = ServerOptions(ui=False, rate_limit_per_minute=2, cors_origins=[ORIGIN],
                         limits={"max_tokens": 5})
    with running_server(create_app(tiny_engine, options=opts)) as url:
        _check_options_reach_the_server(url)
    with pytest.raises(ValueError, match="either options= or keywords"):
        create_app(tiny_engine, options=opts, rate_limit_per_minute=3)


@pytest.mark.slow
@pytest.mark.parametrize("entry", ["nbserve serve", "app.py"])
def test_cli_flags_reach_the_server(tiny_llama_dir, entry):
    argv = ([sys.executable, "-m", "nbserve.serving.cli", "serve", str(tiny_llama_dir)]
            if entry == "nbserve serve" else
            [sys.executable, str(ROOT / "app.py"), "--model", str(tiny_llama_dir)])
    argv += ["--port", "0", "--max-batch", "2", "--no-ui", "--rate-limit-per-minute", "3",
             "--cors-origin", ORIGIN, "--limit", "max_tokens=5", "--limit", "max_n=2"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        url = None
        for line in proc.stdout:
            if " at http://" in line:
                url = line.split(" at ")[1].split()[0]
                break
        assert url, "the CLI never printed its URL"
        n3 = httpx.post(url + "/v1/chat/completions", json={**CHAT, "n": 3}, timeout=30)
        assert n3.status_code == 400 and n3.json()["error"]["param"] == "n"
        _check_options_reach_the_server(url)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 0
    finally:
        proc.kill()
        proc.wait()


# ----------------------------------------------------------------------------- bad options


def test_misspelt_launch_keyword_is_a_clear_error_naming_it(tiny_llama_dir):
    with pytest.raises(TypeError, match=r"unknown keyword argument 'max_batchs' \(did you mean "
                                        r"'max_batch'\?\)"):
        launch(str(tiny_llama_dir), max_batchs=2)
    with pytest.raises(TypeError, match=r"'rate_limit' \(did you mean 'rate_limit_per_minute'"):
        launch(str(tiny_llama_dir), rate_limit=5)
    with pytest.raises(TypeError, match="'colour'.*Server options: api_keys"):
        launch(str(tiny_llama_dir), colour="blue")
    assert running_servers() == []


def test_bad_option_values_are_clear_errors():
    from nbserve import ServerOptions

    with pytest.raises(ValueError, match=r"unknown limit 'max_tokes' \(did you mean "
                                         r"'max_tokens'\?\)"):
        ServerOptions(limits={"max_tokes": 5})
    with pytest.raises(ValueError, match="Limits.max_tokens must be an integer >= 1"):
        ServerOptions(limits={"max_tokens": 0})
    with pytest.raises(ValueError, match="rate_limit_per_minute must be a number > 0"):
        ServerOptions(rate_limit_per_minute=-1)
    with pytest.raises(ValueError, match="api_keys must be"):
        ServerOptions(api_keys=["ok", " "])
    with pytest.raises(ValueError, match="cors_origins must be"):
        ServerOptions(cors_origins=[None])
    with pytest.raises(TypeError, match="ui must be True or False"):
        ServerOptions(ui="no")
    assert ServerOptions(cors_origins="http://a.example").cors_origins == ("http://a.example",)


def test_bad_limit_flag_is_a_clear_cli_error(tiny_llama_dir):
    out = subprocess.run([sys.executable, "-m", "nbserve.serving.cli", "serve", str(tiny_llama_dir),
                          "--limit", "max_tokes=5"], capture_output=True, text=True,
                         timeout=60, cwd=ROOT, check=False)
    assert out.returncode == 2
    assert "unknown limit 'max_tokes' (did you mean 'max_tokens'?)" in out.stderr
    out = subprocess.run([sys.executable, "-m", "nbserve.serving.cli", "serve", str(tiny_llama_dir),
                          "--limit", "max_tokens"], capture_output=True, text=True,
                         timeout=60, cwd=ROOT, check=False)
    assert out.returncode == 2 and "NAME=VALUE" in out.stderr


@pytest.mark.parametrize(("text", "value"), [("2GiB", 2 * 2**30), ("512MiB", 512 * 2**20),
                                             ("1000000", 10**6), ("1.5GB", 15 * 10**8),
                                             ("0.3", 0.3), ("1.0", 1.0)])
def test_kv_memory_flag_takes_bytes_or_a_fraction(text, value):
    from nbserve.serving.cli import build_parser, serve_kwargs

    args = build_parser().parse_args(["serve", "--kv-memory", text, "--kv-block-size", "16",
                                      "--kv-dtype", "float16"])
    kwargs = serve_kwargs(args)
    assert kwargs["kv_memory"] == value and type(kwargs["kv_memory"]) is type(value)
    assert kwargs["kv_block_size"] == 16 and kwargs["kv_dtype"] == "float16"


@pytest.mark.parametrize("text", ["lots", "-1GiB", "2.5", "0", "3TiB"])
def test_a_bad_kv_memory_flag_says_what_it_takes(text, capsys):
    from nbserve.serving.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", f"--kv-memory={text}"])
    assert "is not a KV budget: give bytes" in capsys.readouterr().err


def test_the_slow_client_flags_reach_the_engine_options(capsys):
    from nbserve.engine.config import EngineConfig
    from nbserve.serving.cli import build_parser, serve_kwargs

    kwargs = serve_kwargs(build_parser().parse_args(
        ["serve", "--max-backlog", "64", "--slow-client-timeout", "2.5"]))
    assert kwargs["max_backlog"] == 64 and kwargs["slow_client_timeout"] == 2.5
    cfg = EngineConfig.from_options(max_backlog=64, slow_client_timeout=2.5)
    assert (cfg.max_backlog, cfg.slow_client_timeout) == (64, 2.5)
    assert "max_backlog" not in serve_kwargs(build_parser().parse_args(["serve"]))
    for flag, bad, says in (("--slow-client-timeout", "-1", "not a number of seconds >= 0"),
                            ("--slow-client-timeout", "soon", "not a number of seconds >= 0"),
                            ("--max-backlog", "0", "not an integer >= 1")):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", flag, bad])
        assert says in capsys.readouterr().err
