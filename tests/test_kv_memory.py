"""KV memory comes back (issue 40, item 4): a server that has answered many distinct prompts
holds resident, once idle, what its cached prefixes need, not its whole KV budget; `/stats`
says what the cache commits; the default budget is bounded by the sequences the engine runs
and by the memory a cgroup (a container, a JupyterHub pod, a batch job) leaves it."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch
from server_util import app_running, engine_running, wait_until
from tiny_models import make_tiny_hf_dir

from nbserve.engine.kv_budget import KVBudget, available_bytes, plan_blocks, retained_blocks

MiB = 2**20


def rss() -> int:
    """This process's resident set (the server runs in it)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.fixture(scope="module")
def wide_kv_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with wide keys and values: 8 layers x 4 heads x 64 dims, 16 KiB a
    token in float32 (a block of 16 tokens: 256 KiB), so a cache's memory is easy to see."""
    return make_tiny_hf_dir(tmp_path_factory.mktemp("models") / "wide-kv", arch="llama",
                            hidden_size=256, intermediate_size=256, num_hidden_layers=8,
                            num_attention_heads=4, num_key_value_heads=4)


@pytest.mark.slow
def test_distinct_prompts_then_idle_hold_what_the_cached_prefixes_need(wide_kv_dir: Path):
    """A 256 MiB budget and 160 distinct prompts of 8 blocks each (more than the budget
    holds), each sent twice, 4 requests at a time: the resident set grows with what the
    traffic holds at once, not with every prompt seen (it rose by the whole budget, and
    stayed there, before), and once idle `/stats` commits exactly the cached blocks (the
    blocks that a twin request filled alongside the first are freed, and their pages given
    back)."""
    concurrency, n_prompts, length = 4, 320, 120
    with engine_running(wide_kv_dir, kv_memory=256 * MiB, max_batch=8) as engine, \
            app_running(engine) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id

        def complete(i: int) -> str | None:
            i //= 2  # each prompt twice, at about the same time: twin blocks are freed
            prompt = [3 + i % 500, 3 + i // 500] + [(i * 7 + j) % 600 + 3 for j in range(length)]
            out = client.completions.create(model=model, prompt=prompt, max_tokens=2,
                                            temperature=0.0)
            return out.choices[0].finish_reason

        complete(10_000)  # warm: the model's first forwards, the server's first request
        stats = httpx.get(url + "/stats").json()
        block_bytes = stats["kv_cache_bytes"] // stats["kv_blocks_total"]
        assert block_bytes == 256 * 1024 and stats["kv_blocks_total"] == 1024
        before = rss()
        with ThreadPoolExecutor(concurrency) as pool:
            reasons = list(pool.map(complete, range(n_prompts)))
        assert reasons == ["length"] * n_prompts
        assert wait_until(lambda: httpx.get(url + "/stats").json()["running"] == 0, 30)
        stats = httpx.get(url + "/stats").json()
        grew = rss() - before

    # what 4 requests (and blocks twin requests filled alongside them) hold at once, beside
    # the cached prefixes the server keeps (at most `retained_blocks`): what may stay resident
    budget = KVBudget(stats["kv_blocks_total"], 16, block_bytes // 16, 256 * MiB, "")
    retained = retained_blocks(budget, stats["max_context"])
    assert 0 < retained < stats["kv_blocks_total"] // 2
    need = (2 * concurrency * -(-(length + 2 + 2) // 16) + retained) * block_bytes
    assert grew <= need + 64 * MiB, (grew / MiB, stats)
    assert stats["kv_committed_bytes"] == stats["kv_blocks_touched"] * block_bytes <= need, stats
    assert stats["kv_blocks_touched"] == stats["kv_blocks_cached"]  # idle: nothing else held
    assert grew <= stats["kv_committed_bytes"] + 64 * MiB, (grew / MiB, stats)


def test_stats_say_what_the_cache_commits(tiny_llama_dir: Path) -> None:
    """`/stats` `kv_committed_bytes`: on CPU, the blocks that hold pages (none before the first
    request), next to the budget (`kv_cache_bytes`), which stays the same."""
    with engine_running(tiny_llama_dir, kv_memory=8 * MiB) as engine, \
            app_running(engine) as url:
        st = httpx.get(url + "/stats").json()
        assert st["kv_committed_bytes"] == 0 and st["kv_cache_bytes"] >= 7 * MiB
        r = httpx.post(url + "/v1/completions", json={"prompt": "hello there " * 10,
                                                        "max_tokens": 3})
        assert r.status_code == 200, r.text
        st = httpx.get(url + "/stats").json()
        block = st["kv_cache_bytes"] // st["kv_blocks_total"]
        assert st["kv_committed_bytes"] == st["kv_blocks_touched"] * block > 0
        assert "nbserve_kv_committed_bytes" in httpx.get(url + "/metrics").text



# ----------------------------------------------------------------------------- the budget

GiB = 2**30
CPU = torch.device("cpu")


def fake_tree(root: Path, self_cgroup: str, files: dict[str, str],
              available: int = 20 * GiB) -> tuple[Path, Path]:
    """A fake /proc (meminfo, self/cgroup) and cgroup tree under `root`: (proc, cgroup)."""
    proc, cgroup = root / "proc", root / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal: {2 * available // 1024} kB\n"
                                  f"MemAvailable: {available // 1024} kB\n")
    (proc / "self" / "cgroup").write_text(self_cgroup)
    cgroup.mkdir()
    for name, text in files.items():
        (cgroup / name).parent.mkdir(parents=True, exist_ok=True)
        (cgroup / name).write_text(text)
    return proc, cgroup


def test_available_ram_is_what_a_cgroup_v2_limit_leaves(tmp_path: Path) -> None:
    """A pod limited to 2 GiB that uses 1.5 GiB (0.25 GiB of it file cache the kernel can
    drop) on a host with 20 GiB available: 0.75 GiB is what the cache can take."""
    pod = "kubepods/pod1"
    proc, cgroup = fake_tree(tmp_path, f"0::/{pod}\n", {
        f"{pod}/memory.max": f"{2 * GiB}\n", f"{pod}/memory.current": f"{3 * GiB // 2}\n",
        f"{pod}/memory.stat": f"anon {GiB}\ninactive_file {GiB // 4}\nactive_file 0\n",
        "kubepods/memory.max": "max\n", "kubepods/memory.current": f"{5 * GiB}\n"})
    assert available_bytes(CPU, proc, cgroup) == (3 * GiB // 4,
                                                  "RAM left under the cgroup's memory limit")
    # a tighter limit above it counts too
    (cgroup / "kubepods" / "memory.max").write_text(f"{GiB}\n")
    (cgroup / "kubepods" / "memory.current").write_text(f"{GiB - 100 * MiB}\n")
    assert available_bytes(CPU, proc, cgroup)[0] == 100 * MiB
    # the default budget (a quarter) is sized from it, not from the host's 20 GiB
    budget = plan_blocks(4096, 16, CPU, None, None, proc, cgroup)
    assert budget.budget_bytes == 25 * MiB and budget.n_blocks == 25 * MiB // (16 * 4096)
    assert "cgroup" in budget.source


def test_available_ram_is_what_a_cgroup_v1_limit_leaves(tmp_path: Path) -> None:
    """docker --memory 1g, cgroup v1: the memory controller's limit and usage."""
    proc, cgroup = fake_tree(tmp_path, "12:cpu,cpuacct:/docker/abc\n11:memory:/docker/abc\n", {
        "memory/docker/abc/memory.limit_in_bytes": f"{GiB}\n",
        "memory/docker/abc/memory.usage_in_bytes": f"{GiB // 2}\n",
        "memory/docker/abc/memory.stat": "cache 0\ntotal_inactive_file 0\n",
        "memory/memory.limit_in_bytes": "9223372036854771712\n",  # the host: no limit
        "memory/memory.usage_in_bytes": f"{8 * GiB}\n"})
    assert available_bytes(CPU, proc, cgroup)[0] == GiB // 2


def test_a_container_sees_its_own_cgroup_as_the_root(tmp_path: Path) -> None:
    """Inside a container the cgroup path may name the host's tree while the container's own
    cgroup is mounted as the root: the root's limit is read."""
    proc, cgroup = fake_tree(tmp_path, "0::/\n", {"memory.max": f"{GiB}\n",
                                                  "memory.current": f"{GiB // 4}\n"})
    assert available_bytes(CPU, proc, cgroup)[0] == 3 * GiB // 4
    proc, cgroup = fake_tree(tmp_path / "v1", "5:memory:/docker/abc\n", {
        "memory/memory.limit_in_bytes": f"{GiB}\n",
        "memory/memory.usage_in_bytes": f"{GiB // 4}\n"})
    assert available_bytes(CPU, proc, cgroup)[0] == 3 * GiB // 4


def test_without_a_cgroup_limit_the_ram_available_is_used(tmp_path: Path) -> None:
    proc, cgroup = fake_tree(tmp_path, "0::/user.slice\n", {
        "user.slice/memory.max": "max\n", "user.slice/memory.current": f"{GiB}\n"})
    assert available_bytes(CPU, proc, cgroup) == (20 * GiB, "RAM available")
    (proc / "self" / "cgroup").unlink()  # no cgroups at all (not Linux's, or hidden)
    assert available_bytes(CPU, proc, cgroup) == (20 * GiB, "RAM available")


def test_the_default_budget_is_bounded_by_max_batch_sequences_of_max_context(
        tmp_path: Path, tiny_llama_dir: Path) -> None:
    """On a host with plenty of RAM, a default budget holds max_batch x max_context tokens,
    not a quarter of the RAM; a budget in bytes is taken as given."""
    proc, cgroup = fake_tree(tmp_path, "0::/\n", {}, available=1024 * GiB)
    budget = plan_blocks(4096, 16, CPU, None, 4 * 256, proc, cgroup)
    assert budget.tokens == 4 * 256 and budget.budget_bytes == 4 * 256 * 4096
    assert "max_batch x max_context" in budget.source
    assert plan_blocks(4096, 16, CPU, 64 * MiB, 4 * 256, proc, cgroup).tokens == 64 * MiB // 4096
    with engine_running(tiny_llama_dir, max_batch=3, max_context=128) as engine:  # the real RAM
        st = engine.stats()
        per_token = st["kv_cache_bytes"] // (st["kv_blocks_total"] * st["kv_block_size"])
        assert st["kv_budget_bytes"] == 3 * 128 * per_token
        assert st["kv_blocks_total"] * st["kv_block_size"] == 3 * 128
