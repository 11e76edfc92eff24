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

pytest.importorskip("ray.serve", reason="the Ray tests need: pip install 'nbserve[ray]'")
import httpx  # noqa: E402
import psutil  # noqa: E402  (a dependency of ray)
import ray  # noqa: E402
from ray import serve  # noqa: E402
from server_util import wait_until  # noqa: E402

import nbserve  # noqa: E402
import nbserve.ray as nray  # noqa: E402

pytestmark = pytest.mark.slow

ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # keeps the test cluster on 127.0.0.1
       "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
ENGINE = {"max_batch": 4, "max_context": 512, "quiet": True}
PROMPTS = ["Hello there", "Tell me about the sea", "Count to five", "What is Paris?"]
LONG = {"prompt": "Write a long story", "max_tokens": 480, "logit_bias": {"2": -100}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_env() -> Iterator[str]:
    """Loopback-only Ray settings and a short private temp dir (Unix socket paths are short)."""
    old = {k: os.environ.get(k) for k in ENV}
    os.environ.update(ENV)
    tmp = tempfile.mkdtemp(prefix="nbray-")
    yield tmp
    for k, v in old.items():
        os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    shutil.rmtree(tmp, ignore_errors=True)


def ray_processes() -> list[psutil.Process]:
    """Processes this test started through Ray (gcs_server, raylet, workers, replicas)."""
    return [p for p in psutil.Process().children(recursive=True) if p.is_running()]


def shutdown_and_check(procs: list[psutil.Process]) -> None:
    serve.shutdown()
    ray.shutdown()
    gone, alive = psutil.wait_procs(procs, timeout=20)
    alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"Ray processes left after shutdown: {[p.cmdline()[:2] for p in alive]}"


@pytest.fixture(scope="module")
def cluster(ray_env: str, tiny_llama_dir) -> Iterator[dict[str, Any]]:
    """Ray on this machine (2 CPUs), the tiny model on two replicas behind Ray's proxy."""
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=ray_env)
    port = free_port()
    app = nray.deployment(tiny_llama_dir, num_replicas=2, max_ongoing_requests=2,
                          max_queued_requests=2, retry_after_s=2, **ENGINE)
    nray.run(app, port=port)
    state = {"url": f"http://127.0.0.1:{port}", "procs": ray_processes(), "down": False}
    assert any("raylet" in " ".join(p.cmdline()) for p in state["procs"])
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
        model="tiny", messages=[{"role": "user", "content": prompt}], temperature=0,
        max_tokens=16)
    return raw.parse().choices[0].message.content, raw.headers.get(nray.REPLICA_HEADER, "")


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
    assert {s["node_ip"] for s in seen.values()} == {"127.0.0.1"}
    stats = nray.replica_stats()
    assert sorted(s["replica"]["id"] for s in stats) == sorted(seen)


def test_greedy_answers_equal_a_single_launch_server(cluster, single):
    import openai

    ray_client = openai.OpenAI(base_url=cluster["url"] + "/v1", api_key="x", max_retries=0)
    by_replica: dict[str, dict[str, str]] = {}
    for prompt in PROMPTS:
        want, _ = chat(single.openai_client(max_retries=0), prompt)
        for _ in range(3):
            got, rid = chat(ray_client, prompt)
            assert got == want, f"replica {rid} answered {got!r}, launch() {want!r}"
            by_replica.setdefault(rid, {})[prompt] = got
    assert len(by_replica) == 2, "all answers came from one replica"


def test_streaming_passes_chunk_by_chunk_and_a_dropped_stream_is_cancelled(cluster):
    before = {s["replica"]["id"]: s["requests_finished"] for s in nray.replica_stats()}
    with httpx.Client(base_url=cluster["url"], timeout=30) as http:
        with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
            assert r.status_code == 200
            rid = r.headers[nray.REPLICA_HEADER]
            chunks = 0
            for line in r.iter_lines():
                chunks += line.startswith("data: {")
                if chunks == 3:
                    break  # leaving the block closes the connection mid-stream

    def cancelled() -> dict | None:
        mine = [s for s in nray.replica_stats() if s["replica"]["id"] == rid][0]
        done = mine["requests_finished"]
        return done if done.get("cancelled", 0) > before[rid].get("cancelled", 0) else None

    assert wait_until(cancelled, timeout=10, interval=0.1), \
        f"replica {rid} did not cancel the dropped stream: {cancelled()}"
    done = cancelled()
    assert done.get("length", 0) == before[rid].get("length", 0)  # it did not run to the end


def test_a_full_queue_answers_429_with_retry_after_in_the_openai_shape(cluster):
    async def flood() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=cluster["url"], timeout=60) as http:
            return await asyncio.gather(*[http.post("/v1/completions", json=LONG)
                                          for _ in range(12)])

    responses = asyncio.run(flood())
    codes = sorted(r.status_code for r in responses)
    assert set(codes) == {200, 429}, codes
    busy = [r for r in responses if r.status_code == 429]
    for r in busy:
        assert r.headers["retry-after"] == "2"
        assert r.headers["content-type"].startswith("application/json")
        err = r.json()["error"]
        assert err["type"] == "rate_limit_error" and err["code"] == "server_busy"
        assert "Retry after 2 s" in err["message"]
    assert codes.count(200) >= 2  # 2 replicas x max_ongoing 2, plus the queue


def test_shutdown_leaves_no_ray_process(cluster):
    t0 = time.perf_counter()
    cluster["down"] = True
    shutdown_and_check(cluster["procs"])
    assert time.perf_counter() - t0 < 30


def test_two_simulated_nodes_get_one_replica_each(ray_env, tiny_llama_dir):
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "temp_dir": ray_env,
                                                      "include_dashboard": False})
    try:
        c.add_node(num_cpus=1)
        ray.init(address=c.address)
        assert wait_until(lambda: len([n for n in ray.nodes() if n["Alive"]]) == 2, 20)
        app = nray.deployment(tiny_llama_dir, num_replicas=2, cpus_per_replica=1, **ENGINE)
        handle = nray.run(app, port=free_port())
        stats = nray.replica_stats()
        assert len({s["replica"]["node_id"] for s in stats}) == 2, stats
        procs = ray_processes()
        assert handle is not None
    finally:
        serve.shutdown()
        ray.shutdown()
        c.shutdown()
    gone, alive = psutil.wait_procs(procs, timeout=20)
    assert not [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
