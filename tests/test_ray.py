"""nbserve on Ray Serve, on one machine, loopback only, with the tiny model: two replicas both
answer, greedy answers equal a plain `launch()` server's, a dropped stream is cancelled on its
replica, a full queue answers 429 in the OpenAI shape, shutdown leaves no Ray process; and a
simulated two-node cluster puts one replica on each node.

One Ray session serves the single-node tests (in file order: the shutdown test ends it)."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import pytest

ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # Ray then uses 127.0.0.1 (read at import)
       "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
for _k, _v in ENV.items():
    os.environ.setdefault(_k, _v)

pytest.importorskip("ray.serve", reason="the Ray tests need: pip install 'nbserve[ray]'")
import httpx
import psutil
import ray
from ray import serve
from server_util import wait_until

import nbserve
import nbserve.ray as nray

ENGINE = {"max_batch": 4, "max_context": 512, "quiet": True}
PROMPTS = ["Hello there", "Tell me about the sea", "Count to five", "What is Paris?"]
# ~480 tokens (EOS banned): about half a second on a replica, long enough to overlap.
LONG = {"prompt": "Write a long story", "max_tokens": 480, "logit_bias": {"2": -100}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ray_processes() -> list[psutil.Process]:
    """Ray's processes started from this test process (gcs_server, raylet, agents, actors)."""
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if cmd.startswith("ray::") or "/ray/" in cmd:
            found.append(p)
    return found


def assert_all_gone(procs: list[psutil.Process]) -> None:
    _, alive = psutil.wait_procs(procs, timeout=20)
    alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"Ray processes left after shutdown: {[p.name() for p in alive]}"


@pytest.fixture(scope="module")
def ray_tmp() -> Iterator[str]:
    """A short private temp dir for Ray (its Unix socket paths must stay short)."""
    tmp = tempfile.mkdtemp(prefix="nbray-")
    yield tmp
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(ray_tmp: str, tiny_llama_dir) -> Iterator[dict[str, Any]]:
    """Ray on this machine (2 CPUs), the tiny model on two replicas behind Ray's proxy."""
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=ray_tmp)
    port = free_port()
    app = nray.deployment(tiny_llama_dir, num_replicas=2, max_ongoing_requests=2,
                          max_queued_requests=2, retry_after_s=2, **ENGINE)
    nray.run(app, port=port)
    state = {"url": nray.url(port), "procs": ray_processes(), "down": False}
    assert any(p.name() == "raylet" for p in state["procs"])
    yield state
    if not state["down"]:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def single(tiny_llama_dir) -> Iterator[Any]:
    """The same model on a plain `launch()` server, for reference answers."""
    srv = nbserve.launch(tiny_llama_dir, port=None, ui=False, **ENGINE)
    yield srv
    srv.stop()


def chat(client: Any, prompt: str) -> tuple[str, str]:
    raw = client.chat.completions.with_raw_response.create(
        model="tiny-llama", messages=[{"role": "user", "content": prompt}], temperature=0,
        max_tokens=16)
    return raw.parse().choices[0].message.content, raw.headers.get(nray.REPLICA_HEADER, "")


# ----------------------------------------------------------------------------- no cluster


def test_deployment_refuses_what_it_cannot_ship_or_place(tiny_llama_dir):
    with pytest.raises(TypeError, match="function that returns a model"):
        nray.deployment(object())
    with pytest.raises(ValueError, match="whole number"):
        nray.deployment(tiny_llama_dir, gpus_per_replica=1.5)
    with pytest.raises(ValueError, match="either num_replicas or autoscaling"):
        nray.deployment(tiny_llama_dir, num_replicas=2, autoscaling={"max_replicas": 4})
    with pytest.raises(ValueError, match="unknown autoscaling key"):
        nray.deployment(tiny_llama_dir, autoscaling={"max_replicaz": 4})
    app = nray.deployment(os.path.relpath(tiny_llama_dir), autoscaling={"max_replicas": 3})
    d = app._bound_deployment  # what Ray will get
    assert d._deployment_config.autoscaling_config.target_ongoing_requests == 32  # 64 // 2
    assert d.backpressure_config.status_code == 429 and d.max_ongoing_requests == 128
    assert d.ray_actor_options["num_gpus"] == 0
    model, build, app_options = d.init_args
    assert model == str(tiny_llama_dir) and build["device"] == "cpu"  # absolute for replicas
    assert app_options["ui"] is False  # several replicas: no Gradio UI by default


# ----------------------------------------------------------------------------- one machine


@pytest.mark.slow
def test_two_replicas_answer_and_name_themselves(cluster):
    seen: dict[str, dict] = {}
    with httpx.Client(base_url=cluster["url"], timeout=30) as http:
        for _ in range(40):
            for path in ("/health", "/stats"):
                r = http.get(path)
                assert r.status_code == 200
                rid = r.headers[nray.REPLICA_HEADER]
                assert r.json()["replica"]["id"] == rid  # body and header agree
                seen[rid] = r.json()["replica"]
            if len(seen) == 2:
                break
    assert len(seen) == 2, f"only replica(s) {sorted(seen)} answered"
    assert {s["node_ip"] for s in seen.values()} == {"127.0.0.1"}  # loopback only
    assert sorted(s["replica"]["id"] for s in nray.replica_stats()) == sorted(seen)
    metrics = nray.replica_metrics()
    assert sorted(metrics) == sorted(seen)
    assert all("nbserve_requests_total" in text for text in metrics.values())


@pytest.mark.slow
def test_greedy_answers_equal_a_single_launch_server(cluster, single):
    import openai

    ray_client = openai.OpenAI(base_url=cluster["url"] + "/v1", api_key="x", max_retries=0)
    replicas = set()
    for prompt in PROMPTS:
        want, _ = chat(single.openai_client(max_retries=0), prompt)
        for _ in range(3):
            got, rid = chat(ray_client, prompt)
            assert got == want, f"replica {rid} answered {got!r}, launch() {want!r}"
            replicas.add(rid)
    assert len(replicas) == 2, "all answers came from one replica"


@pytest.mark.slow
def test_a_stream_dropped_after_3_chunks_is_cancelled_on_its_replica(cluster):
    before = {s["replica"]["id"]: s["requests_finished"] for s in nray.replica_stats()}
    with httpx.Client(base_url=cluster["url"], timeout=30) as http, \
            http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
        assert r.status_code == 200
        rid = r.headers[nray.REPLICA_HEADER]
        chunks = 0
        for line in r.iter_lines():
            chunks += line.startswith("data: {")
            if chunks == 3:
                break  # leaving the block closes the connection mid-stream
    # 3 chunks came while the generation still ran: Ray's proxy streams, it does not buffer.

    def finished() -> dict:
        return next(s for s in nray.replica_stats() if s["replica"]["id"] == rid)[
            "requests_finished"]

    assert wait_until(lambda: finished().get("cancelled", 0) > before[rid].get("cancelled", 0),
                      timeout=10, interval=0.1), f"replica {rid} did not cancel: {finished()}"
    assert finished().get("length", 0) == before[rid].get("length", 0)  # it did not run on


@pytest.mark.slow
def test_a_full_queue_answers_429_with_retry_after_in_the_openai_shape(cluster):
    async def flood() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=cluster["url"], timeout=60) as http:
            return await asyncio.gather(*[http.post("/v1/completions", json=LONG)
                                          for _ in range(12)])

    responses = asyncio.run(flood())
    codes = sorted(r.status_code for r in responses)
    assert set(codes) == {200, 429}, codes
    assert codes.count(200) >= 2  # 2 replicas x max_ongoing_requests 2, plus the queue
    for r in responses:
        if r.status_code == 429:
            assert r.headers["retry-after"] == "2"
            assert r.headers["content-type"].startswith("application/json")
            err = r.json()["error"]
            assert err["type"] == "rate_limit_error" and err["code"] == "server_busy"
            assert "Retry after 2 s" in err["message"] and err["param"] is None


@pytest.mark.slow
def test_shutdown_leaves_no_ray_process(cluster):
    t0 = time.perf_counter()
    cluster["down"] = True
    serve.shutdown()
    ray.shutdown()
    assert_all_gone(cluster["procs"])
    assert time.perf_counter() - t0 < 30


# ----------------------------------------------------------------------------- two nodes


@pytest.mark.slow
def test_two_simulated_nodes_get_one_replica_each(ray_tmp, tiny_llama_dir):
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "temp_dir": ray_tmp,
                                                      "include_dashboard": False})
    procs: list[psutil.Process] = []
    try:
        c.add_node(num_cpus=1)
        ray.init(address=c.address)
        assert wait_until(lambda: len([n for n in ray.nodes() if n["Alive"]]) == 2, 20)
        port = free_port()
        nray.run(nray.deployment(tiny_llama_dir, num_replicas=2, **ENGINE), port=port)
        nodes = {s["replica"]["id"]: s["replica"]["node_id"] for s in nray.replica_stats()}
        assert len(set(nodes.values())) == 2, nodes  # one replica per node
        # A proxy on each node, both on the port (SO_REUSEPORT); each prefers its own node's
        # replica, so new connections spread over the two nodes.
        assert len(serve.status().proxies) == 2
        seen = set()
        for _ in range(40):
            seen.add(httpx.get(nray.url(port) + "/health").json()["replica"]["node_id"])
            if len(seen) == 2:
                break
        assert seen == set(nodes.values())  # HTTP reaches both nodes' replicas
        procs = ray_processes()
    finally:
        serve.shutdown()
        ray.shutdown()
        c.shutdown()
    assert_all_gone(procs)
