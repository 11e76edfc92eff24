"""Several models behind one server (issue 44): launched servers on real ports, the OpenAI SDK
routing by `model`, load on first request, LRU / memory / idle unload with memory returned,
load and unload from Python and over HTTP, a 404 naming the models there are."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from server_util import engine_running, wait_until
from tiny_models import make_tiny_hf_dir

from nbserve.serving.cli import models_argument
from nbserve.serving.launch import launch
from nbserve.serving.model_set import folder_of_models, model_names, several_models

pytestmark = pytest.mark.usefixtures("no_server_left")
PROMPT = [{"role": "user", "content": "hello world"}]
# a model big enough that its weights show in the process's resident memory (~67 MB)
BIG = dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=4,
           num_attention_heads=8, num_key_value_heads=4)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of three checkpoints of two families (no config.json of its own)."""
    root = tmp_path_factory.mktemp("several")
    make_tiny_hf_dir(root / "alpha", arch="llama")
    make_tiny_hf_dir(root / "beta", arch="qwen2", tie=False, seed=1)
    make_tiny_hf_dir(root / "big", arch="llama", seed=2, **BIG)
    return root


def answer(client: openai.OpenAI, model: str) -> Any:
    return client.chat.completions.create(model=model, messages=PROMPT, temperature=0,
                                          max_tokens=8)


def alone(model_dir: Path) -> str:
    """The greedy answer of `model_dir` served by an engine of its own."""
    with engine_running(model_dir, max_batch=2) as engine:
        return str(engine.chat(PROMPT, temperature=0, max_tokens=8))


def states(client: openai.OpenAI) -> dict[str, str]:
    return {m.id: getattr(m, "state") for m in client.models.list().data}  # noqa: B009


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_a_folder_of_models_routes_by_name_and_loads_on_first_request(folder: Path):
    srv = launch(str(folder), ui=False, wait=True, max_batch=2, max_context=128)
    try:
        client = srv.openai_client()
        assert states(client) == {"alpha": "loaded", "beta": "unloaded", "big": "unloaded"}
        first = answer(client, "alpha")
        assert first.model == "alpha"
        beta = answer(client, "beta")  # loads beta, then answers
        assert beta.model == "beta"
        assert states(client)["beta"] == "loaded"
        assert first.choices[0].message.content == alone(folder / "alpha")
        assert beta.choices[0].message.content == alone(folder / "beta")
        assert answer(client, "").model == "alpha"  # no name: the default
        metrics = httpx.get(srv.url + "/metrics").text
        for name in ("alpha", "beta"):  # tokens and latency by model
            assert f'nbserve_completion_tokens_total{{model="{name}"}} ' in metrics
            assert f'nbserve_time_to_first_token_seconds_count{{model="{name}"}} ' in metrics
        beta_tokens = [line for line in metrics.splitlines()
                       if line.startswith('nbserve_completion_tokens_total{model="beta"}')]
        assert float(beta_tokens[0].split()[-1]) == beta.usage.completion_tokens
        with pytest.raises(openai.NotFoundError) as err:
            answer(client, "gamma")
        message = str(err.value)
        assert "'gamma'" in message and all(f"'{n}'" in message for n in ("alpha", "beta", "big"))
        assert client.models.retrieve("beta").id == "beta"
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("gamma")
        # the server stays healthy after the refusals
        assert httpx.get(srv.url + "/health").status_code == 200
    finally:
        srv.stop()


def test_least_recently_used_model_is_unloaded_past_max_loaded(folder: Path):
    models = {"alpha": str(folder / "alpha"), "beta": str(folder / "beta"),
              "gamma": str(folder / "alpha")}
    srv = launch(models, ui=False, wait=True, max_batch=2, max_context=128, max_loaded=2)
    try:
        client = srv.openai_client()
        answer(client, "beta")
        assert states(client) == {"alpha": "loaded", "beta": "loaded", "gamma": "unloaded"}
        answer(client, "gamma")  # two loaded at most: beta (the other) goes
        assert states(client) == {"alpha": "loaded", "beta": "unloaded", "gamma": "loaded"}
        assert answer(client, "beta").model == "beta"  # and comes back on its next request
        assert states(client) == {"alpha": "loaded", "beta": "loaded", "gamma": "unloaded"}
    finally:
        srv.stop()


# Run in a fresh process: in one that has run other tests, the allocator keeps freed pages
# for their reuse, and the resident size says little about what an unload gave back.
MEMORY_SCRIPT = """
import json, sys
from nbserve.serving.launch import launch

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

srv = launch({"alpha": sys.argv[1], "big": sys.argv[2]}, ui=False, wait=True, max_batch=2,
             max_context=128)
client = srv.openai_client()
ask = dict(messages=[{"role": "user", "content": "hi"}], max_tokens=4)
client.chat.completions.create(model="alpha", **ask)
before = rss()
client.chat.completions.create(model="big", **ask)
loaded = rss()
weights = srv._models.loaded("big").stats()["weight_bytes"]
was = srv.unload("big")
print(json.dumps(dict(before=before, loaded=loaded, after=rss(), weights=weights, was=was,
                      again=srv.unload("big"), state=srv.models[1].state)))
srv.stop()
"""


def unload_memory(default: str, second: str) -> dict[str, Any]:
    """MEMORY_SCRIPT's figures for a server of `default` and `second` (as "big")."""
    out = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, default, second],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    figures: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return figures


@pytest.mark.slow
def test_unloading_a_gguf_model_gives_its_blocks_back(folder: Path):
    """The default model's GGUF, served from its blocks (many heap allocations, which the C
    library keeps unless trimmed), as the second model: unloading it gives most of what its
    load grew back."""
    m = unload_memory(str(folder / "alpha"), "smollm2")
    grown, given_back = m["loaded"] - m["before"], m["loaded"] - m["after"]
    mib = {k: round(v / 2**20) for k, v in m.items() if isinstance(v, int)}
    assert m["weights"] > 50 * 2**20 and grown > m["weights"], mib
    assert given_back > 0.7 * grown, mib


def test_unloading_gives_the_memory_back(folder: Path):
    """In a fresh process: loading the big model grows the resident memory by more than its
    weights, and unloading it gives that back (to within a fifth of the growth)."""
    m = unload_memory(str(folder / "alpha"), str(folder / "big"))
    grown, given_back = m["loaded"] - m["before"], m["loaded"] - m["after"]
    mib = {k: round(v / 2**20) for k, v in m.items() if isinstance(v, int)}
    assert m["weights"] > 40 * 2**20 and grown > m["weights"], mib
    assert given_back > 0.8 * grown and given_back > m["weights"], mib
    assert (m["was"], m["again"], m["state"]) == (True, False, "unloaded")


def test_an_idle_model_is_unloaded_after_keep_alive(folder: Path):
    srv = launch({"alpha": str(folder / "alpha"), "beta": str(folder / "beta")}, ui=False,
                 wait=True, max_batch=2, max_context=128, keep_alive=0.5)
    try:
        client = srv.openai_client()
        answer(client, "beta")
        assert states(client)["beta"] == "loaded"
        assert wait_until(lambda: states(client)["beta"] == "unloaded", timeout=10)
        assert states(client)["alpha"] == "loaded"  # the default stays
        assert answer(client, "beta").model == "beta"
    finally:
        srv.stop()


def test_models_added_removed_and_loaded_over_http_behind_the_keys(folder: Path):
    srv = launch(str(folder / "alpha"), ui=False, wait=True, max_batch=2, max_context=128,
                 api_keys=["sk-test"])
    try:
        client = srv.openai_client()
        srv.add("beta", str(folder / "beta"))
        assert [m.name for m in srv.models] == [srv.backend.model_name, "beta"]
        assert srv.models[1].state == "unloaded"
        url, key = srv.url, {"Authorization": "Bearer sk-test"}
        assert httpx.post(url + "/models/load", json={"model": "beta"}).status_code == 401
        r = httpx.post(url + "/models/load", json={"model": "beta"}, headers=key, timeout=60)
        assert r.status_code == 200 and r.json()["state"] == "loaded", r.text
        assert srv.models[1].state == "loaded"
        r = httpx.post(url + "/models/unload", json={"model": "beta"}, headers=key)
        assert r.status_code == 200 and r.json()["was_loaded"] is True, r.text
        assert srv.models[1].state == "unloaded"
        r = httpx.post(url + "/models/unload", json={"model": srv.backend.model_name},
                       headers=key)
        assert r.status_code == 400 and r.json()["error"]["code"] == "default_model"
        r = httpx.post(url + "/models/unload", json={"model": "nope"}, headers=key)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        r = httpx.post(url + "/models/load", json={"model": "beta", "extra": 1}, headers=key)
        assert r.status_code == 400 and "extra" in r.json()["error"]["message"]
        srv.remove("beta")
        with pytest.raises(openai.NotFoundError):
            answer(client, "beta")
        with pytest.raises(ValueError, match="already served"):
            srv.add(srv.backend.model_name, str(folder / "beta"))
    finally:
        srv.stop()


def test_a_request_may_name_the_model_as_it_was_launched(folder: Path):
    """launch("smollm2") serves "SmolLM2-135M-Instruct": a request naming "smollm2" (the source
    as launched) gets that model, not a 404; a model added under the same name comes first.
    (Before, only the served name was accepted.)"""
    source = str(folder / "alpha")
    srv = launch(source, ui=False, wait=True, max_batch=2, max_context=128)
    try:
        client = srv.openai_client()
        assert srv.backend.model_name != source
        reply = answer(client, source)
        assert reply.model == srv.backend.model_name
        assert reply.choices[0].message.content == answer(client, srv.backend.model_name
                                                          ).choices[0].message.content
        with pytest.raises(openai.NotFoundError):
            answer(client, source + "-nope")
        srv.add(source, str(folder / "beta"))  # a model of that name now: it wins
        assert answer(client, source).model == source
    finally:
        srv.stop()


def test_a_model_that_fails_to_load_says_why_and_the_server_stays_healthy(folder: Path):
    srv = launch(str(folder / "alpha"), ui=False, wait=True, max_batch=2, max_context=128)
    try:
        client = srv.openai_client()
        srv.add("broken", str(folder / "nowhere.gguf"))
        with pytest.raises(openai.APIStatusError) as err:
            answer(client, "broken")
        assert err.value.status_code == 503
        assert "'broken' failed to load" in str(err.value)
        entry = [m for m in srv.models if m.name == "broken"][0]
        assert entry.state == "failed" and entry.error
        listed = {m.id: m for m in client.models.list().data}
        assert getattr(listed["broken"], "error")  # noqa: B009 -- an extra field
        assert answer(client, "").choices[0].message.content  # the default serves on
    finally:
        srv.stop()


def test_naming_several_models():
    assert model_names(["a=x.gguf", "/m/b.gguf", "/m/ckpt"]) == \
        {"a": "x.gguf", "b": "/m/b.gguf", "ckpt": "/m/ckpt"}
    with pytest.raises(ValueError, match="two models are named 'b'"):
        model_names(["/m/b.gguf", "/n/b.gguf"])
    with pytest.raises(ValueError, match="needs a name"):
        model_names(["=x.gguf"])
    assert several_models("smollm2") is None
    assert models_argument(["smollm2"]) == "smollm2"
    assert models_argument(["a=x", "b=y"]) == ["a=x", "b=y"]


def test_a_folder_lists_its_gguf_files_and_checkpoints(tmp_path: Path):
    (tmp_path / "one.gguf").write_bytes(b"")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    (tmp_path / "notes").mkdir()
    assert folder_of_models(tmp_path) == {"ckpt": str(tmp_path / "ckpt"),
                                          "one": str(tmp_path / "one.gguf")}
    assert folder_of_models(tmp_path / "ckpt") is None  # a checkpoint is one model


def test_launch_refuses_one_name_for_several_models(folder: Path):
    with pytest.raises(ValueError, match="name each one"):
        launch([str(folder / "alpha"), str(folder / "beta")], name="x", ui=False)


async def test_the_ui_compares_two_models_side_by_side(folder: Path):
    from nbserve.serving.ui_compare import make_compare_fn

    srv = launch({"alpha": str(folder / "alpha"), "beta": str(folder / "beta")}, ui=False,
                 wait=True, max_batch=2, max_context=128)
    try:
        compare = make_compare_fn(srv._models)  # the directory the UI gets from the app
        frames = [f async for f in compare("hello world", "alpha", "beta", 0.0, 8)]
        text_a, text_b, line_a, line_b = frames[-1]
        assert text_a == alone(folder / "alpha") and text_b == alone(folder / "beta")
        assert line_a.startswith("**alpha**: ") and "tokens/s" in line_a
        assert line_b.startswith("**beta**: ") and "answering" not in line_b
        *_, (_, _, missing, _) = [f async for f in compare("hi", "nope", "beta", 0.0, 8)]
        assert "failed" in missing and "'nope'" in missing
        *_, (_, _, empty, _) = [f async for f in compare("  ", "alpha", "beta", 0.0, 8)]
        assert "type a prompt" in empty
    finally:
        srv.stop()


def test_other_clients_name_the_models_their_way(folder: Path):
    """The Ollama client lists every model (`name:latest`) and answers with the one it names,
    loading it; the Anthropic SDK and embeddings route by `model` too."""
    import anthropic
    import ollama

    srv = launch({"alpha": str(folder / "alpha"), "beta": str(folder / "beta")}, ui=False,
                 wait=True, max_batch=2, max_context=128)
    try:
        client = ollama.Client(host=srv.url)
        assert [m.model for m in client.list().models] == ["alpha:latest", "beta:latest"]
        assert [m.model for m in client.ps().models] == ["alpha:latest"]
        r = client.chat(model="beta:latest", messages=PROMPT, options={"temperature": 0,
                                                                       "num_predict": 8})
        assert r.message.content == alone(folder / "beta")
        assert [m.model for m in client.ps().models] == ["alpha:latest", "beta:latest"]
        with pytest.raises(ollama.ResponseError) as err:
            client.chat(model="gamma", messages=PROMPT)
        assert err.value.status_code == 404 and "not found" in err.value.error
        m = anthropic.Anthropic(base_url=srv.url, api_key="-", max_retries=0).messages.create(
            model="beta", max_tokens=8, messages=PROMPT, extra_body={"temperature": 0})
        assert m.model == "beta" and m.content[0].text == alone(folder / "beta")
        vectors = srv.openai_client().embeddings.create(model="beta", input="hi").data
        assert len(vectors[0].embedding) == 64
    finally:
        srv.stop()


@pytest.mark.slow
def test_the_default_model_beside_another(folder: Path):
    """The README's several-models example with the default model as the default: both answer
    by name, the default a real answer."""
    srv = launch({"chat": "smollm2", "tuned": str(folder / "alpha")}, ui=False, wait=True,
                 max_batch=2, max_loaded=2, keep_alive=600)
    try:
        client = srv.openai_client()
        r = client.chat.completions.create(
            model="chat", temperature=0, max_tokens=20,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in (r.choices[0].message.content or "") and r.model == "chat"
        assert answer(client, "tuned").choices[0].message.content == alone(folder / "alpha")
        assert [m.state for m in srv.models] == ["loaded", "loaded"]
    finally:
        srv.stop()


def test_update_one_model_of_several(folder: Path):
    """srv.update(source, name=...) swaps one model's weights; without a source it reloads
    the model's own; the default is updated without a name; an unknown name is refused."""
    from nbserve.types import ModelNotFoundError

    srv = launch({"alpha": str(folder / "alpha"), "beta": str(folder / "beta")}, ui=False,
                 wait=True, max_batch=2, max_context=128)
    try:
        client = srv.openai_client()
        assert answer(client, "beta").choices[0].message.content == alone(folder / "beta")
        srv.update(str(folder / "alpha"), name="beta")  # beta now serves alpha's weights
        assert answer(client, "beta").choices[0].message.content == alone(folder / "alpha")
        assert answer(client, "beta").model == "beta"
        srv.update(name="beta")  # its (new) source again
        assert answer(client, "beta").choices[0].message.content == alone(folder / "alpha")
        with pytest.raises(ModelNotFoundError):
            srv.update(str(folder / "beta"), name="gamma")
        srv.update(str(folder / "beta"))  # the default
        assert answer(client, "").choices[0].message.content == alone(folder / "beta")
    finally:
        srv.stop()


def test_several_models_over_a_pool_of_devices(folder: Path):
    """With `devices`, every model of the set is a Pool of its own replicas (each replica
    holds the models it serves), and answers as it does alone."""
    from nbserve.pool.pool import Pool

    srv = launch({"alpha": str(folder / "alpha"), "beta": str(folder / "beta")}, ui=False,
                 wait=True, devices=["cpu", "cpu"], max_batch=2, max_context=128)
    try:
        client = srv.openai_client()
        assert answer(client, "beta").choices[0].message.content == alone(folder / "beta")
        for name in ("alpha", "beta"):
            served = srv._models.loaded(name)
            assert served is not None and isinstance(served.current, Pool)
            assert len(served.stats()["replicas"]) == 2
    finally:
        srv.stop()


async def test_the_chat_ui_says_a_picked_model_is_loading(folder: Path):
    """Picking a model that is not loaded: the chat's speed line says it loads, then the
    answer comes from that model."""
    from nbserve.serving.ui import loading_line, make_chat_fn

    srv = launch({"alpha": str(folder / "alpha"), "beta": str(folder / "beta")}, ui=False,
                 wait=True, max_batch=2, max_context=128)
    try:
        chat = make_chat_fn(srv.backend, models=srv._models)
        frames = [f async for f in chat("hello world", [], "", 0.0, 0.95, 8, "", "", "beta")]
        assert frames[0][1] == loading_line("beta")
        assert frames[-1][0] == alone(folder / "beta") and "tokens/s" in str(frames[-1][1])
        again = [f async for f in chat("hello world", [], "", 0.0, 0.95, 8, "", "", "beta")]
        assert all(f[1] != loading_line("beta") for f in again)  # loaded now
    finally:
        srv.stop()
