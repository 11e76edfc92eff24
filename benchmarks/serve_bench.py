"""Load generator for the OpenAI HTTP API: streaming chat at several concurrency levels.

    python benchmarks/serve_bench.py                       # default model, server in-process
    python benchmarks/serve_bench.py --model path/to/hf_dir --concurrency 1,4
    python benchmarks/serve_bench.py --url http://127.0.0.1:8000/v1   # any OpenAI server

For each level it prints output tokens/s, TTFT and ITL p50/p95. With the in-process server it
also runs the same requests straight on the engine (`engine.generate`) and prints the ratio of
HTTP throughput to engine throughput (the HTTP layer's cost; goal >= 0.9).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

QUESTIONS = [
    "What is the capital of France?", "Explain photosynthesis briefly.",
    "Write a haiku about the sea.", "How do I reverse a list in Python?",
    "Why is the sky blue?", "Give me three tips for better sleep.",
    "What is a prime number?", "Describe a cat to someone who has never seen one.",
    "What causes rain?", "Name some famous painters.", "How does a bicycle stay upright?",
    "What is the difference between weather and climate?",
]


@dataclass
class Sample:
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    tokens: int = 0


@dataclass
class LevelResult:
    mode: str
    concurrency: int
    requests: int
    wall: float
    samples: list[Sample]

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.samples)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall if self.wall else 0.0


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def messages(i: int, run: str) -> list[dict[str, str]]:
    # A unique tag per request and run, so no run gets another run's prefix cache for free.
    return [{"role": "user", "content": f"[{run}-{i}] {QUESTIONS[i % len(QUESTIONS)]}"}]


async def run_level(concurrency: int, n: int, one: Callable[[int], Awaitable[Sample]]
                    ) -> tuple[float, list[Sample]]:
    """Run requests 0..n-1 with `concurrency` workers; return (wall seconds, samples)."""
    queue = list(range(n))
    samples: list[Sample] = []

    async def worker() -> None:
        while queue:
            samples.append(await one(queue.pop(0)))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - t0, samples


# ----------------------------------------------------------------------------- clients


def http_one(client: Any, model: str, max_tokens: int, bias: dict[str, int], run: str,
             ) -> Callable[[int], Awaitable[Sample]]:
    body_base = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                 "stream_options": {"include_usage": True}}
    if bias:
        body_base["logit_bias"] = bias

    async def one(i: int) -> Sample:
        s = Sample()
        start = last = time.perf_counter()
        body = {**body_base, "messages": messages(i, run)}
        async with client.stream("POST", "/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    s.tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                    now = time.perf_counter()
                    if s.ttft is None:
                        s.ttft = now - start
                    else:
                        s.itl.append(now - last)
                    last = now
        return s

    return one


def engine_one(engine: Any, max_tokens: int, run: str) -> Callable[[int], Awaitable[Sample]]:
    from nbserve.types import Delta, Finished, Request, SamplingParams

    async def one(i: int) -> Sample:
        s = Sample()
        start = last = time.perf_counter()
        req = Request(messages=messages(i, run), params=SamplingParams(
            temperature=0, max_tokens=max_tokens, logit_bias={t: -100.0 for t in
                                                              engine.stop_token_ids}))
        async for ev in engine.generate(req):
            if isinstance(ev, Delta) and ev.text:
                now = time.perf_counter()
                if s.ttft is None:
                    s.ttft = now - start
                else:
                    s.itl.append(now - last)
                last = now
            elif isinstance(ev, Finished):
                s.tokens = ev.usage.completion_tokens
        return s

    return one


# ----------------------------------------------------------------------------- server


def start_server(app: Any) -> tuple[str, Callable[[], None]]:
    """uvicorn in a daemon thread with its own loop, on a free loopback port."""
    import uvicorn

    # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY on accepted connections only when the
    # listening socket says it is TCP; with proto 0, Nagle + delayed ACKs stall SSE by ~40 ms.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))

    def run() -> None:
        asyncio.run(server.serve(sockets=[sock]))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the server did not start")
        time.sleep(0.02)

    def stop() -> None:
        server.should_exit = True
        thread.join(10)
        sock.close()

    return f"http://127.0.0.1:{sock.getsockname()[1]}/v1", stop


def report(r: LevelResult, ratio: float | None = None) -> None:
    ttft = [s.ttft for s in r.samples if s.ttft is not None]
    itl = [x for s in r.samples for x in s.itl]
    print(f"{r.concurrency:>5} {r.mode:>7} {r.requests:>5} {r.tokens:>7} {r.tok_s:>8.1f} "
          f"{ms(pct(ttft, 50)):>9} {ms(pct(ttft, 95)):>9} {ms(pct(itl, 50)):>8} "
          f"{ms(pct(itl, 95)):>8}" + (f" {ratio:>7.2f}" if ratio is not None else ""),
          flush=True)


async def main_async(args: argparse.Namespace) -> None:
    import httpx

    levels = [int(x) for x in args.concurrency.split(",")]
    engine, stop = None, None
    if args.url:
        base = args.url.rstrip("/")
    else:
        from nbserve.engine import Engine
        from nbserve.loading import load
        from nbserve.server import create_app

        t0 = time.perf_counter()
        engine = Engine(load(args.model), max_batch=args.max_batch or max(levels),
                        max_context=args.max_context, quiet=True)
        print(f"loaded {engine.model_name} in {time.perf_counter() - t0:.1f} s; "
              f"max_batch={engine.max_batch}", flush=True)
        base, stop = start_server(create_app(engine, ui=False))
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=max(levels) + 8, max_keepalive_connections=max(levels) + 8)
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=None,
                                 limits=limits) as client:
        model = args.served_model
        if model is None:
            model = (await client.get("/models")).json()["data"][0]["id"]
        bias = {str(t): -100 for t in engine.stop_token_ids} if engine is not None else {}
        # warm-up: compile paths, fill allocator caches, open connections
        await run_level(2, 2, http_one(client, model, 8, bias, "warm"))
        print(f"model {model!r}, {args.max_tokens} new tokens per request, prompts of "
              f"~{len(QUESTIONS[0].split())}-word questions", flush=True)
        print(f"{'conc':>5} {'mode':>7} {'reqs':>5} {'tokens':>7} {'tok/s':>8} "
              f"{'TTFT p50':>9} {'TTFT p95':>9} {'ITL p50':>8} {'ITL p95':>8}"
              + (" {:>7}".format("http/eng") if engine is not None else ""), flush=True)
        for c in levels:
            n = args.requests_per_level or max(4, c)
            # Alternate engine and HTTP rounds so that background load drifts hit both alike.
            rounds = max(1, min(args.rounds, n // c))
            per_round = [n // rounds + (r < n % rounds) for r in range(rounds)]
            results = {m: LevelResult(m, c, 0, 0.0, []) for m in ("engine", "http")}
            for r, k in enumerate(per_round):
                runs = [("http", http_one(client, model, args.max_tokens, bias, f"h{c}.{r}"))]
                if engine is not None:
                    runs.insert(0, ("engine", engine_one(engine, args.max_tokens,
                                                         f"e{c}.{r}")))
                for mode, one in runs:
                    wall, samples = await run_level(c, k, one)
                    res = results[mode]
                    res.requests += k
                    res.wall += wall
                    res.samples += samples
            eng_tps = results["engine"].tok_s if engine is not None else None
            if engine is not None:
                report(results["engine"])
            report(results["http"], results["http"].tok_s / eng_tps if eng_tps else None)
    if stop is not None:
        stop()
    if engine is not None:
        engine.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2", help="model source for the in-process server")
    p.add_argument("--url", help="benchmark an external OpenAI-compatible server (…/v1)")
    p.add_argument("--served-model", help="model name to send (default: first of /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--concurrency", default="1,4,16,32")
    p.add_argument("--requests-per-level", type=int, default=None,
                   help="requests per level (default: max(4, concurrency))")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2,
                   help="alternating engine/HTTP rounds per level (less drift between them)")
    p.add_argument("--max-batch", type=int, default=None, help="default: the top concurrency")
    p.add_argument("--max-context", type=int, default=1024)
    asyncio.run(main_async(p.parse_args(argv)))


if __name__ == "__main__":
    main()
