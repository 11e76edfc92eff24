"""Soak: mixed requests at high concurrency against a real server; reliability, not speed.

    python benchmarks/soak.py                        # 2,000 requests, concurrency 32, tiny model
    python benchmarks/soak.py --model smollm2        # the real default model
    python benchmarks/soak.py --requests 200 --ui    # shorter, with the chat UI mounted

It starts `python app.py` in a subprocess (so the figures are the server's alone), sends
streaming, non-streaming, cancelled-mid-stream, invalid and over-long requests, and prints:
the count by outcome, the 5xx count (must be 0), whether every valid request completed or was
cancelled as asked, running sequences and the server's thread count afterwards, and its
resident memory at request 500 and at the end with the growth, less what the KV cache newly
committed (blocks that held keys/values for the first time; goal: under 50 MB).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
NO_EOS = {"0": -100, "2": -100}  # the tiny model's end tokens; harmless for other models
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
             "Why is the sky blue?", "Explain recursion to a child.", "Name three colors."]
KINDS = [("stream", 30), ("plain", 20), ("completion", 10), ("cancel", 15), ("invalid", 15),
         ("overlong", 9), ("too_big", 1)]
INVALID = [({"temperature": 5}, 400), ({"n": 0}, 400), ({"top_p": 0}, 400),
           ({"max_tokens": 0}, 400), ({"logprobs": True, "top_logprobs": 99}, 400),
           ({"messages": [{"role": "wizard", "content": "hi"}]}, 400), ({"messages": []}, 400),
           ({"stop": ["x"] * 40}, 400), ({"temperature": "hot"}, 400), ({"model": "gpt-4o"}, 404)]


@dataclass
class Result:
    """What a soak run saw; `ok` says whether every property held."""

    outcomes: Counter[str] = field(default_factory=Counter)
    statuses: Counter[int] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    cancels_sent: int = 0
    server_cancelled: int = 0
    after: dict[str, Any] = field(default_factory=dict)
    threads_before: int = 0
    threads_after: int = 0
    rss_at: dict[int, int] = field(default_factory=dict)
    kv_at: dict[int, int] = field(default_factory=dict)  # KV cache bytes resident, same marks
    wall: float = 0.0

    @property
    def server_errors(self) -> int:
        return sum(n for s, n in self.statuses.items() if s >= 500)

    @property
    def rss_growth(self) -> int:
        marks = sorted(self.rss_at)
        return self.rss_at[marks[-1]] - self.rss_at[marks[0]] if len(marks) > 1 else 0

    @property
    def kv_growth(self) -> int:
        """What the KV cache committed between the marks: blocks that held keys/values for
        the first time (the prefix cache keeps finished requests' blocks, so a lazily
        committed cache grows into its budget; that is bounded, and no leak)."""
        marks = sorted(self.kv_at)
        return self.kv_at[marks[-1]] - self.kv_at[marks[0]] if len(marks) > 1 else 0

    @property
    def other_growth(self) -> int:
        """RSS growth that the KV cache does not account for: what a leak would show as."""
        return self.rss_growth - self.kv_growth

    @property
    def ok(self) -> bool:
        return (not self.problems and self.server_errors == 0
                and self.cancels_sent == self.server_cancelled
                and self.after.get("running") == 0 and self.after.get("waiting") == 0
                and self.after.get("slots_used") == 0
                and self.threads_after <= self.threads_before
                and self.other_growth < 50 * 2**20)


# ----------------------------------------------------------------------------- the server


def server_memory(pid: int) -> tuple[int, int]:
    """(resident bytes, OS threads) of process `pid`, from /proc."""
    with open(f"/proc/{pid}/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    with open(f"/proc/{pid}/status") as f:
        threads = next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
    return rss, threads


def kv_resident(stats: httpx.Response) -> int:
    """Bytes of the KV cache that have held keys/values, from a /stats answer."""
    st = stats.json()
    total = st.get("kv_blocks_total") or 1
    return st.get("kv_cache_bytes", 0) * st.get("kv_blocks_touched", 0) // total


def start_server(model: str, ui: bool, extra: list[str]) -> tuple[subprocess.Popen, str]:
    """`python app.py --model MODEL --port 0` in a subprocess; returns it and its base URL."""
    cmd = [sys.executable, str(ROOT / "app.py"), "--model", model, "--port", "0", *extra]
    if not ui:
        cmd.append("--no-ui")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    assert proc.stdout is not None
    for line in proc.stdout:
        if " at http://" in line:
            url = line.split(" at ")[1].split()[0]
            break
    else:
        raise RuntimeError(f"the server exited with {proc.wait()} before printing its URL")
    return proc, url


def stop_server(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


# ----------------------------------------------------------------------------- the requests


async def one(http: httpx.AsyncClient, kind: str, rng: random.Random, max_context: int,
              res: Result) -> str:
    """Send one request of `kind`; return its outcome name, recording problems in `res`."""
    msgs = [{"role": "user", "content": rng.choice(QUESTIONS)}]
    chat: dict[str, Any] = {"messages": msgs, "max_tokens": rng.randint(1, 48),
                            "temperature": rng.choice([0, 0.7, 1.0])}
    if kind == "stream":
        return await _stream(http, {**chat, "stream": True}, res)
    if kind == "cancel":
        body = {**chat, "stream": True, "max_tokens": 400, "logit_bias": NO_EOS}
        return await _stream(http, body, res, stop_after=rng.randint(1, 3))
    if kind == "plain":
        body = {**chat, "n": rng.choice([1, 1, 2])}
        return _expect_answer(await http.post("/v1/chat/completions", json=body), res)
    if kind == "completion":
        body = {"prompt": rng.choice(QUESTIONS), "max_tokens": rng.randint(1, 32)}
        return _expect_answer(await http.post("/v1/completions", json=body), res)
    if kind == "invalid":
        fields, status = rng.choice(INVALID)
        return _expect_error(await http.post("/v1/chat/completions", json={**chat, **fields}),
                             status, res)
    if kind == "overlong":  # token ids past the context: a 400 naming the limit
        body = {"prompt": [rng.randrange(3, 200) for _ in range(max_context + 8)]}
        resp = await http.post("/v1/completions", json=body)
        return _expect_error(resp, 400, res, code="context_length_exceeded")
    body_bytes = b'{"prompt": "' + b"a" * (3 * 2**20) + b'"}'  # too_big: over the 2 MB limit
    resp = await http.post("/v1/completions", content=body_bytes,
                           headers={"content-type": "application/json"})
    return _expect_error(resp, 413, res)


async def _stream(http: httpx.AsyncClient, body: dict[str, Any], res: Result,
                  stop_after: int | None = None) -> str:
    content, finish, done = 0, None, False
    async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        res.statuses[resp.status_code] += 1
        if resp.status_code != 200:
            res.problems.append(f"stream: HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
            return "failed"
        async for line in resp.aiter_lines():
            if line == "data: [DONE]":
                done = True
                break
            if not line.startswith("data: "):
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                res.problems.append(f"stream error event: {chunk['error']}")
                return "failed"
            for choice in chunk["choices"]:
                finish = choice["finish_reason"] or finish
                content += bool(choice["delta"].get("content"))
            if stop_after is not None and content >= stop_after:
                res.cancels_sent += 1
                return "cancelled"  # leaving the block closes the connection mid-stream
    if not done or finish not in ("stop", "length"):
        res.problems.append(f"stream ended without [DONE] or finish_reason ({finish})")
        return "failed"
    return "completed"


def _expect_answer(resp: httpx.Response, res: Result) -> str:
    res.statuses[resp.status_code] += 1
    if resp.status_code != 200:
        res.problems.append(f"HTTP {resp.status_code}: {resp.text[:200]}")
        return "failed"
    reasons = [c["finish_reason"] for c in resp.json()["choices"]]
    if not reasons or any(r not in ("stop", "length") for r in reasons):
        res.problems.append(f"answer without finish_reason: {reasons}")
        return "failed"
    return "completed"


def _expect_error(resp: httpx.Response, status: int, res: Result, code: str | None = None) -> str:
    res.statuses[resp.status_code] += 1
    try:
        err = resp.json()["error"]
        shaped = set(err) == {"message", "type", "param", "code"}
    except (ValueError, KeyError, TypeError):
        err, shaped = {}, False
    if resp.status_code != status or not shaped or (code and err.get("code") != code):
        res.problems.append(f"expected {status} {code or ''}, got {resp.status_code}: "
                            f"{resp.text[:200]}")
        return "failed"
    return "refused"


async def drive(url: str, pid: int, n: int, concurrency: int, seed: int = 0,
                progress: bool = True) -> Result:
    """Send `n` mixed requests, `concurrency` at a time, to the server at `url` (process
    `pid`); measure its memory, and the KV cache's resident part, at request 500 (or n/2) and at
    the end."""
    res = Result()
    rng = random.Random(seed)
    names, weights = zip(*KINDS)
    kinds = rng.choices(names, weights, k=n)
    mark = 500 if n >= 1000 else max(1, n // 2)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        max_context = (await http.get("/v1/models")).json()["data"][0]["max_model_len"]
        # warm up at full concurrency, so that lazily made threads exist before the baseline
        await asyncio.gather(*(one(http, "plain", random.Random(i), max_context, Result())
                               for i in range(concurrency)))
        await asyncio.sleep(0.5)
        res.threads_before = server_memory(pid)[1]
        sem = asyncio.Semaphore(concurrency)
        done = 0
        t0 = time.perf_counter()

        async def run(i: int, kind: str) -> None:
            nonlocal done
            async with sem:
                try:
                    outcome = await one(http, kind, random.Random(seed * 100_003 + i),
                                        max_context, res)
                except httpx.HTTPError as exc:
                    res.problems.append(f"request {i} ({kind}): {type(exc).__name__}: {exc}")
                    outcome = "failed"
            res.outcomes[f"{kind}:{outcome}"] += 1
            done += 1
            if done in (mark, n):
                at = done  # others finish while /stats answers
                res.kv_at[at] = kv_resident(await http.get("/stats"))
                res.rss_at[at] = server_memory(pid)[0]
            if progress and done % 250 == 0:
                print(f"  {done}/{n} requests, {time.perf_counter() - t0:.0f} s", flush=True)

        await asyncio.gather(*(run(i, k) for i, k in enumerate(kinds)))
        res.wall = time.perf_counter() - t0
        # the server may still be tearing down the last cancelled streams: give it a moment
        for _ in range(100):
            res.after = (await http.get("/stats")).json()
            if res.after["running"] == 0 and res.after["waiting"] == 0:
                break
            await asyncio.sleep(0.05)
        res.server_cancelled = res.after["requests_finished"].get("cancelled", 0)
    for _ in range(150):  # idle worker threads of the server exit after a few seconds
        res.threads_after = server_memory(pid)[1]
        if res.threads_after <= res.threads_before:
            break
        await asyncio.sleep(0.1)
    return res


def report(res: Result, n: int, concurrency: int) -> str:
    mb = 2**20
    lines = [f"soak: {n} requests at concurrency {concurrency} in {res.wall:.1f} s",
             "outcomes:"]
    lines += [f"  {k:<22} {v}" for k, v in sorted(res.outcomes.items())]
    cancels = (f"cancelled mid-stream: {res.cancels_sent} sent, {res.server_cancelled} "
               "cancelled by the server")
    after = (f"afterwards: running {res.after.get('running')}, waiting "
             f"{res.after.get('waiting')}, slots used {res.after.get('slots_used')}")
    problems = f"problems: {len(res.problems)}" + "".join(f"\n  {p}" for p in res.problems[:10])
    lines += [f"HTTP statuses: {dict(sorted(res.statuses.items()))}",
              f"5xx responses: {res.server_errors} (must be 0)", cancels, problems, after,
              f"server threads: {res.threads_before} before, {res.threads_after} after"]
    marks = sorted(res.rss_at)
    lines += [f"server RSS at request {m}: {res.rss_at[m] / mb:.1f} MB" for m in marks]
    if marks:
        lines.append(f"RSS growth {marks[0]} -> {marks[-1]}: {res.rss_growth / mb:+.1f} MB, "
                     f"of which the KV cache's newly used blocks {res.kv_growth / mb:+.1f} MB; "
                     f"the rest {res.other_growth / mb:+.1f} MB (goal < 50 MB)")
    lines.append("result: " + ("OK" if res.ok else "FAILED"))
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None,
                        help="a model for app.py (default: a tiny random model made here)")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--ui", action="store_true", help="mount the chat UI as app.py does")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            sys.path.insert(0, str(ROOT / "tests"))
            from tiny_models import make_tiny_hf_dir

            model = str(make_tiny_hf_dir(Path(tmp) / "tiny-llama"))
        proc, url = start_server(model, args.ui, [])
        try:
            res = asyncio.run(drive(url, proc.pid, args.requests, args.concurrency, args.seed))
        finally:
            code = stop_server(proc)
    print(report(res, args.requests, args.concurrency))
    print(f"server exit code after SIGTERM: {code}")
    return 0 if res.ok and code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
