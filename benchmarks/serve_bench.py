"""Load generator for the OpenAI HTTP API: streaming chat at several concurrency levels.

    python benchmarks/serve_bench.py                       # default model, server in-process
    python benchmarks/serve_bench.py --model path/to/hf_dir --concurrency 1,4
    python benchmarks/serve_bench.py --url http://127.0.0.1:8000/v1   # any OpenAI server
    python benchmarks/serve_bench.py --peers transformers --levels 1,16 --plot out.png

For each level it prints output tokens/s, TTFT and ITL p50/p95. With the in-process server it
also runs the same requests straight on the engine (`engine.generate`) and prints the ratio of
HTTP throughput to engine throughput (the HTTP layer's cost; goal >= 0.9).

Then, unless `--no-peers` (or `--url`), it load-tests, one at a time after the in-process
server has stopped, nbserve's own `python app.py` (a subprocess, as users run it) and the peers
that are installed, on the same model: llama.cpp's `llama-server` (`-np 16 -c 32768` up to 16
streams, `-np 64 -c 65536` past that), `llama_cpp.server` and `transformers serve
--continuous-batching` (see peers.py), with the same client, prompts and levels; a peer that is
missing or fails is reported as "skipped: <reason>". For each server started as a subprocess it
also prints the resident memory (VmRSS) once warmed up and idle, and its peak in each level.
It ends with a table of nbserve / peer ratios (`python app.py` against each peer when it ran,
else the in-process HTTP server), each subprocess server's start-to-ready time and resident
memory idle and at its peak, for a GGUF model the memory-bandwidth bound of one stream (the
weight bytes a decode step reads over the read bandwidth that bandwidth.py measures, with the
servers' thread count) and each server's fraction of it, and a PNG plot (throughput and TTFT
p50 vs concurrency; needs matplotlib).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import cpu_line  # noqa: E402  (also imported from here by the other benchmarks)

DEFAULT_PLOT = Path(__file__).resolve().with_name("serve_bench.png")
# server -> (start-to-ready seconds, resident MiB once warmed up and idle), one per start
STARTUPS: dict[str, list[tuple[float, float | None]]] = {}
NBSERVE_ENGINE, NBSERVE_HTTP = "nbserve engine", "nbserve http"
NBSERVE_APP = "nbserve_app"
LABELS = {NBSERVE_ENGINE: "nbserve engine (in-process)", NBSERVE_HTTP: "nbserve HTTP",
          NBSERVE_APP: "nbserve python app.py", "llama_server": "llama-server",
          "llama_cpp": "llama_cpp.server", "transformers": "transformers serve --cb",
          "http": "server at --url"}

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
    rss_mib: float | None = None  # the server process's peak resident memory in this level

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.samples)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall if self.wall else 0.0

    @property
    def ttfts(self) -> list[float]:
        return [s.ttft for s in self.samples if s.ttft is not None]

    @property
    def itls(self) -> list[float]:
        return [x for s in self.samples for x in s.itl]


Results = dict[str, dict[int, LevelResult]]  # server -> concurrency -> result


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


# "chat" (/chat/completions through the model's template) or "completions" (/completions with
# the question as a plain prompt: a base model without a chat template); set by --api
API = {"route": "chat"}


def messages(i: int, run: str) -> list[dict[str, str]]:
    # A unique tag per request and run, so no run gets another run's prefix cache for free.
    return [{"role": "user", "content": prompt_text(i, run)}]


def prompt_text(i: int, run: str) -> str:
    return f"[{run}-{i}] {QUESTIONS[i % len(QUESTIONS)]}"


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


def http_one(client: Any, model: str, max_tokens: int, bias: dict[str, float], run: str,
             ) -> Callable[[int], Awaitable[Sample]]:
    body_base = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                 "stream_options": {"include_usage": True}}
    if bias:
        body_base["logit_bias"] = bias

    async def one(i: int) -> Sample:
        import httpx

        for attempt in range(3):  # as the OpenAI SDK: retry a connection the server dropped
            try:
                return await attempt_one(i)
            except httpx.RemoteProtocolError:  # closed before any answer (a stale keep-alive)
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    async def attempt_one(i: int) -> Sample:
        s = Sample()
        start = last = time.perf_counter()
        chunks = 0
        chat = API["route"] == "chat"
        body = {**body_base, **({"messages": messages(i, run)} if chat else
                                {"prompt": prompt_text(i, run)})}
        async with client.stream("POST", "/chat/completions" if chat else "/completions",
                                 json=body) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    s.tokens = chunk["usage"]["completion_tokens"]
                choice = chunk["choices"][0] if chunk.get("choices") else {}
                if (choice.get("delta") or {}).get("content") or choice.get("text"):
                    now = time.perf_counter()
                    chunks += 1
                    if s.ttft is None:
                        s.ttft = now - start
                    else:
                        s.itl.append(now - last)
                    last = now
        s.tokens = s.tokens or chunks  # a server without streamed usage: count content chunks
        return s

    return one


def engine_one(engine: Any, max_tokens: int, run: str) -> Callable[[int], Awaitable[Sample]]:
    from nbserve.types import Delta, Finished, Request, SamplingParams

    async def one(i: int) -> Sample:
        s = Sample()
        start = last = time.perf_counter()
        asked = {"messages": messages(i, run)} if API["route"] == "chat" else \
            {"prompt": prompt_text(i, run)}
        req = Request(**asked, params=SamplingParams(
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


def report(r: LevelResult, ratio: float | None = None, width: int = 7) -> None:
    """One row of the per-level table (`width`: of the mode column)."""
    ttft, itl = r.ttfts, r.itls
    print(f"{r.concurrency:>5} {r.mode:>{width}} {r.requests:>5} {r.tokens:>7} {r.tok_s:>8.1f} "
          f"{ms(pct(ttft, 50)):>9} {ms(pct(ttft, 95)):>9} {ms(pct(itl, 50)):>8} "
          f"{ms(pct(itl, 95)):>8}" + (f" {ratio:>7.2f}" if ratio is not None else "")
          + (f"  peak RSS {r.rss_mib:.0f} MiB" if r.rss_mib is not None else ""), flush=True)


def header(width: int = 7, ratio: bool = False) -> None:
    """Column names of the per-level table."""
    print(f"{'conc':>5} {'mode':>{width}} {'reqs':>5} {'tokens':>7} {'tok/s':>8} "
          f"{'TTFT p50':>9} {'TTFT p95':>9} {'ITL p50':>8} {'ITL p95':>8}"
          + (" {:>7}".format("http/eng") if ratio else ""), flush=True)


def parse_levels(text: str) -> list[int]:
    """"1,4,16" -> [1, 4, 16]."""
    return [int(x) for x in text.split(",") if x.strip()]


def split_rounds(n: int, concurrency: int, rounds: int) -> list[int]:
    """Requests per round: `n` split into at most `rounds` rounds of at least `concurrency`."""
    rounds = max(1, min(rounds, n // concurrency))
    return [n // rounds + (r < n % rounds) for r in range(rounds)]


def requests_for(args: argparse.Namespace, concurrency: int) -> int:
    """Requests to send at one concurrency level (at least one a stream)."""
    return max(args.requests_per_level or 4, concurrency)


def make_client(base: str, levels: list[int], headers: dict[str, str] | None = None,
                timeout: float | None = None) -> Any:
    """An httpx.AsyncClient for `base` with a connection per concurrent request."""
    import httpx

    limits = httpx.Limits(max_connections=max(levels) + 8,
                          max_keepalive_connections=max(levels) + 8)
    return httpx.AsyncClient(base_url=base, headers=headers or {}, timeout=timeout,
                             limits=limits)


async def served_model(client: Any, name: str | None = None) -> str:
    """`name`, or the first model of GET /models."""
    return name or (await client.get("/models")).json()["data"][0]["id"]


async def warm_up(client: Any, model: str, bias: dict[str, float]) -> dict[str, float]:
    """Two short requests (compile paths, open connections); returns the logit_bias to use.

    `bias` (-100.0 on the stop tokens, so that every answer runs to max tokens) is sent as
    floats: `transformers serve` answers 500 to integer biases. A server that refuses it gets
    the load without it (its answers may then end early; the token counts show it).
    """
    try:
        await run_level(2, 2, http_one(client, model, 8, bias, "warm"))
        return bias
    except RuntimeError as exc:
        if not bias:
            raise
        print(f"  logit_bias refused ({exc}); sending no logit_bias", flush=True)
        await run_level(2, 2, http_one(client, model, 8, {}, "warm"))
        return {}


# ----------------------------------------------------------------------------- nbserve


def load_engine(args: argparse.Namespace, levels: list[int]) -> Any:
    """The in-process nbserve engine for `args.model`."""
    from nbserve.engine import Engine
    from nbserve.loading import load

    t0 = time.perf_counter()
    loaded = load(args.model, dtype=args.dtype, weights=args.weights, exact=args.exact)
    engine = Engine(loaded, max_batch=args.max_batch or max(levels),
                    max_context=args.max_context, quiet=True)
    print(f"loaded {engine.model_name} in {time.perf_counter() - t0:.1f} s "
          f"({getattr(loaded.model, 'weight_format', 'its own dtype')}); "
          f"max_batch={engine.max_batch}", flush=True)
    return engine


async def measure_level(c: int, n: int, rounds: int, runs: dict[str, Callable[[str], Any]]
                        ) -> dict[str, LevelResult]:
    """Alternate rounds of each mode at concurrency `c` (background drift hits all alike).

    `runs` maps mode -> function(run tag) -> the per-request coroutine function.
    """
    results = {m: LevelResult(m, c, 0, 0.0, []) for m in runs}
    for r, k in enumerate(split_rounds(n, c, rounds)):
        for mode, make_one in runs.items():
            wall, samples = await run_level(c, k, make_one(f"{mode[0]}{c}.{r}"))
            res = results[mode]
            res.requests += k
            res.wall += wall
            res.samples += samples
    return results


async def measure_nbserve(args: argparse.Namespace, levels: list[int], width: int
                          ) -> tuple[Results, list[int]]:
    """The engine vs HTTP rounds (or only HTTP with --url); returns results and stop ids."""
    engine, stop = None, None
    if args.url:
        base = args.url.rstrip("/")
    else:
        from nbserve.loading.memory_check import ModelTooLargeError
        from nbserve.server import create_app

        try:
            engine = load_engine(args, levels)
        except ModelTooLargeError as exc:  # the peers still run: the point of the comparison
            print(f"nbserve: refused: {exc}", flush=True)
            return {}, []
        base, stop = start_server(create_app(engine, ui=False))
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    stop_ids = list(engine.stop_token_ids) if engine is not None else []
    try:
        async with make_client(base, levels, headers) as client:
            model = await served_model(client, args.served_model)
            bias = await warm_up(client, model, {str(t): -100.0 for t in stop_ids})
            print(f"model {model!r}, {args.max_tokens} new tokens per request, prompts of "
                  f"~{len(QUESTIONS[0].split())}-word questions", flush=True)
            header(width, ratio=engine is not None)
            runs: dict[str, Callable[[str], Any]] = {}
            if engine is not None:
                runs["engine"] = lambda tag: engine_one(engine, args.max_tokens, tag)
            runs["http"] = lambda tag: http_one(client, model, args.max_tokens, bias, tag)
            results: Results = {NBSERVE_ENGINE: {}, NBSERVE_HTTP: {}} if engine else {"http": {}}
            for c in levels:
                level = await measure_level(c, requests_for(args, c), args.rounds, runs)
                eng_tps = level["engine"].tok_s if engine is not None else None
                if engine is not None:
                    report(level["engine"], width=width)
                    results[NBSERVE_ENGINE][c] = level["engine"]
                report(level["http"], level["http"].tok_s / eng_tps if eng_tps else None, width)
                results[NBSERVE_HTTP if engine else "http"][c] = level["http"]
    finally:
        if stop is not None:
            stop()
        if engine is not None:
            engine.close()
    return results, stop_ids


# ----------------------------------------------------------------------------- peers


async def start_announced(spec: Any, args: argparse.Namespace, workdir: Path) -> Any:
    """Start a peer with a line saying how; None (and a line saying why) when it cannot."""
    from peers import PeerError, start_peer

    print(f"peer {spec.name}: starting {' '.join(spec.argv[1:])} (timeout "
          f"{args.peer_timeout:.0f} s)", flush=True)
    try:
        return await asyncio.to_thread(start_peer, spec, args.peer_timeout, workdir)
    except PeerError as exc:
        print(f"peer {spec.name}: skipped: {exc}", flush=True)
        return None


async def warm_up_peer(client: Any, peer: Any, stop_ids: list[int]
                       ) -> tuple[str, dict[str, float]]:
    """A started peer's served model and the logit_bias it takes (`warm_up`), with a line on
    how long it took to start and what it holds resident once warmed up and idle."""
    from peers import rss_mib

    model = await served_model(client)
    bias = await warm_up(client, model, {str(t): -100.0 for t in stop_ids})
    await asyncio.sleep(1.0)  # idle: what the first answers left resident
    idle = rss_mib(peer.proc.pid)
    STARTUPS.setdefault(peer.name, []).append((peer.ready_s, idle))
    print(f"peer {peer.name}: ready in {peer.ready_s:.1f} s at {peer.base}, model {model!r}; "
          f"resident once warmed up, idle: {'?' if idle is None else f'{idle:.0f}'} MiB",
          flush=True)
    return model, bias


async def measure_peer(spec: Any, args: argparse.Namespace, levels: list[int],
                       stop_ids: list[int], workdir: Path, width: int) -> dict[int, LevelResult]:
    """Start one peer, run the same HTTP load on it (the levels its spec serves), stop it; {}
    (and a line) when skipped. Its resident memory is watched throughout."""
    import httpx
    from peers import RssPeak, log_tail, stop_peer

    low, high = spec.levels
    levels = [c for c in levels if low <= c <= high]
    if not levels:
        return {}
    peer = await start_announced(spec, args, workdir)
    if peer is None:
        return {}
    results: dict[int, LevelResult] = {}
    try:
        async with make_client(peer.base, levels, timeout=args.peer_timeout) as client:
            model, bias = await warm_up_peer(client, peer, stop_ids)
        # a new client: a server may close connections left idle (llama-server does)
        async with make_client(peer.base, levels, timeout=args.peer_timeout) as client:
            for c in levels:
                make = {spec.name: lambda tag: http_one(client, model, args.max_tokens, bias,
                                                        tag)}
                with RssPeak(peer.proc.pid) as watch:
                    level = await measure_level(c, requests_for(args, c), args.rounds, make)
                results[c] = level[spec.name]
                results[c].rss_mib = watch.peak or None
                report(results[c], width=width)
    except (RuntimeError, OSError, ValueError, KeyError, httpx.HTTPError) as exc:
        # a peer that breaks mid-run: keep what it did
        print(f"peer {spec.name}: skipped{' the rest' if results else ''}: "
              f"{type(exc).__name__}: {exc}; log: {log_tail(peer.log)}", flush=True)
    finally:
        await asyncio.to_thread(stop_peer, peer)
    return results


async def measure_peers_together(specs: list[Any], args: argparse.Namespace,
                                 levels: list[int], stop_ids: list[int], workdir: Path,
                                 width: int) -> Results:
    """The peers side by side: at each level every peer that serves it is up, and their
    rounds alternate (`measure_level`), so that the drift of a shared machine (other tenants,
    clocks) hits them alike. A peer starts at the first level it serves and stops after its
    last (llama-server's -np 16 spec, then its -np 64 one). Each one's resident memory is
    watched on its own."""
    import contextlib

    import httpx
    from peers import RssPeak, log_tail, stop_peer

    results: Results = {}
    up: dict[int, tuple[Any, Any, str, dict[str, float]]] = {}  # spec index -> peer, client..
    stacks: dict[int, contextlib.AsyncExitStack] = {}
    broken: set[int] = set()

    async def stop(i: int) -> None:
        await stacks.pop(i).aclose()
        await asyncio.to_thread(stop_peer, up.pop(i)[0])

    try:
        for c in levels:
            need = [i for i, spec in enumerate(specs)
                    if spec.levels[0] <= c <= spec.levels[1] and i not in broken]
            for i in [i for i in up if i not in need]:
                await stop(i)
            for i in need:
                if i in up:
                    continue
                spec = specs[i]
                peer = await start_announced(spec, args, workdir)
                if peer is None:
                    broken.add(i)
                    continue
                stack = contextlib.AsyncExitStack()
                client = await stack.enter_async_context(
                    make_client(peer.base, levels, timeout=args.peer_timeout))
                model, bias = await warm_up_peer(client, peer, stop_ids)
                up[i], stacks[i] = (peer, client, model, bias), stack
            live = [i for i in need if i in up]
            runs = {specs[i].name: (lambda tag, i=i: http_one(
                up[i][1], up[i][2], args.max_tokens, up[i][3], tag)) for i in live}
            if not runs:
                continue
            watches = {i: RssPeak(up[i][0].proc.pid) for i in live}
            for watch in watches.values():
                watch.__enter__()
            try:
                level = await measure_level(c, requests_for(args, c), args.rounds, runs)
            except (RuntimeError, OSError, ValueError, KeyError, httpx.HTTPError) as exc:
                print(f"peers at {c} streams: skipped: {type(exc).__name__}: {exc}; logs: "
                      + "; ".join(log_tail(up[i][0].log) for i in live), flush=True)
                continue
            finally:
                for watch in watches.values():
                    watch.__exit__(None, None, None)
            for i in live:
                res = level[specs[i].name]
                res.rss_mib = watches[i].peak or None
                results.setdefault(specs[i].name, {})[c] = res
                report(res, width=width)
    finally:
        for i in list(up):
            await stop(i)
    return results


async def measure_peers(args: argparse.Namespace, levels: list[int], stop_ids: list[int],
                        width: int) -> Results:
    """Each requested peer in turn (a peer of several specs, as llama-server, runs each);
    skipped ones print a line and are left out."""
    from peers import PeerError, make_workdir, peer_specs

    workdir = make_workdir()
    results: Results = {}
    try:
        specs = peer_specs(args.peers, args.model, workdir, max(args.max_context, 2048),
                           args.peer_timeout, args.llama_cpp_python,
                           args.llama_server_flavour)
        if args.together:
            for name, spec in specs:
                if isinstance(spec, PeerError):
                    print(f"peer {name}: skipped: {spec}", flush=True)
            return await measure_peers_together(
                [spec for _, spec in specs if not isinstance(spec, PeerError)], args, levels,
                stop_ids, workdir, width)
        for name, spec in specs:
            if isinstance(spec, PeerError):
                print(f"peer {name}: skipped: {spec}", flush=True)
                continue
            res = await measure_peer(spec, args, levels, stop_ids, workdir, width)
            if res:
                results.setdefault(spec.name, {}).update(res)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return results


# ----------------------------------------------------------------------------- summary


@dataclass
class RatioRow:
    concurrency: int
    server: str
    tok_s: float
    ttft_p50: float | None
    itl_p95: float | None
    ratio: float | None  # nbserve tok/s / this server's tok/s; None for nbserve itself
    rss_mib: float | None = None  # peak resident memory in the level (subprocess servers)
    rss_ratio: float | None = None  # nbserve's / this server's


def ratio_rows(results: Results, ref: str | None = None) -> list[RatioRow]:
    """Per level: the reference row (`python app.py` when it ran, else the in-process HTTP
    server), then a row per other server with the ratios (throughput, resident memory).

    The in-process engine is left out (it is no server), and the in-process HTTP server where
    `python app.py` is the reference; levels the reference lacks too.
    """
    ref = ref or (NBSERVE_APP if NBSERVE_APP in results else NBSERVE_HTTP)
    rows: list[RatioRow] = []
    servers = sorted(results, key=lambda name: name != ref)  # the reference first
    for c, base in sorted(results.get(ref, {}).items()):
        for server in servers:
            r = results[server].get(c)
            if server == NBSERVE_ENGINE or r is None or (server == NBSERVE_HTTP != ref):
                continue
            ratio = None if server == ref else (base.tok_s / r.tok_s if r.tok_s else None)
            rss_ratio = None if server == ref or not (base.rss_mib and r.rss_mib) else \
                base.rss_mib / r.rss_mib
            rows.append(RatioRow(c, server, r.tok_s, pct(r.ttfts, 50), pct(r.itls, 95), ratio,
                                 r.rss_mib, rss_ratio))
    return rows


def format_ratios(rows: list[RatioRow]) -> str:
    """The ratio table as text."""
    width = max([len("server"), *(len(r.server) for r in rows)])
    head = (f"{'conc':>5} {'server':<{width}} {'tok/s':>8} {'TTFT p50':>9} {'ITL p95':>8} "
            f"{'nbserve/peer':>12} {'RSS MiB':>8} {'RSS ratio':>9}")
    lines = [head]
    for r in rows:
        ratio = "" if r.ratio is None else f"{r.ratio:.2f}x"
        rss = "" if r.rss_mib is None else f"{r.rss_mib:.0f}"
        rss_ratio = "" if r.rss_ratio is None else f"{r.rss_ratio:.2f}x"
        lines.append(f"{r.concurrency:>5} {r.server:<{width}} {r.tok_s:>8.1f} "
                     f"{ms(r.ttft_p50):>9} {ms(r.itl_p95):>8} {ratio:>12} {rss:>8} "
                     f"{rss_ratio:>9}")
    return "\n".join(lines)


def write_plot(results: Results, path: Path, title: str = "") -> bool:
    """Throughput and TTFT p50 vs concurrency, a line per server, to a PNG.

    Returns False (after saying how to install it) when matplotlib is missing.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        print('no plot: matplotlib is not installed (pip install -e ".[bench]")', flush=True)
        return False
    fig = Figure(figsize=(11, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    tput, ttft = fig.subplots(1, 2)
    levels = sorted({c for by_level in results.values() for c in by_level})
    for server, by_level in results.items():
        cs = sorted(by_level)
        label = LABELS.get(server, server)
        tput.plot(cs, [by_level[c].tok_s for c in cs], marker="o", label=label)
        p50 = [pct(by_level[c].ttfts, 50) for c in cs]
        ttft.plot(cs, [float("nan") if v is None else v for v in p50], marker="o", label=label)
    for ax, ylabel in ((tput, "aggregate output tokens/s"), (ttft, "TTFT p50 (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels or [1], [str(c) for c in levels or [1]])
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    tput.set_title("throughput")
    ttft.set_title("time to first token")
    if title:
        fig.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return True


def summarize(results: Results, args: argparse.Namespace) -> None:
    """The ratio table (when a peer ran) and the plot."""
    if any(server not in (NBSERVE_ENGINE, NBSERVE_HTTP, "http") for server in results):
        ref = "python app.py" if NBSERVE_APP in results else "nbserve HTTP (in process)"
        print(f"\nnbserve / peers: same client, prompts, greedy, {args.max_tokens} new tokens; "
              f"ratio = {ref} tok/s / peer tok/s; RSS: peak resident memory in the level",
              flush=True)
        print(format_ratios(ratio_rows(results)), flush=True)
    if STARTUPS:
        print(format_startups(results), flush=True)
    if args.bandwidth:
        print(format_bound(results, args), flush=True)
    if args.plot is not None and results:
        title = f"{args.model if not args.url else args.url}, {args.max_tokens} new tokens"
        if write_plot(results, args.plot, title):
            print(f"plot: {args.plot}", flush=True)


def format_startups(results: Results) -> str:
    """Each subprocess server's start to ready, resident memory once warmed up and idle, and
    its peak over the levels."""
    lines = ["\nstart to ready and resident memory (subprocess servers):"]
    for name, starts in STARTUPS.items():
        peaks = [r.rss_mib for r in results.get(name, {}).values() if r.rss_mib is not None]
        peak = f"{max(peaks):.0f} MiB" if peaks else "?"
        for ready_s, idle in starts:
            lines.append(f"  {LABELS.get(name, name):<26} ready in {ready_s:5.1f} s, idle "
                         f"{'?' if idle is None else f'{idle:.0f}'} MiB, peak {peak}")
    return "\n".join(lines)


def weights_read_per_token(model: str) -> tuple[int, Path] | None:
    """(bytes, file) of the weights one decode step reads from a GGUF model ("smollm2" is the
    default model's file): every tensor as the file stores it, but the token embedding when a
    separate LM head leaves it to lookups. None for other sources."""
    if model.lower() in ("smollm2", "default"):
        from nbserve.loading.default import default_model_path

        path = default_model_path()
    elif model.lower().endswith(".gguf") and Path(model).expanduser().is_file():
        path = Path(model).expanduser()
    else:
        return None
    from gguf import GGUFReader

    tensors = GGUFReader(path).tensors
    tied = not any(t.name == "output.weight" for t in tensors)
    read = sum(int(t.n_bytes) for t in tensors if tied or t.name != "token_embd.weight")
    return read, path


def format_bound(results: Results, args: argparse.Namespace) -> str:
    """The memory-bandwidth bound of one stream and each server's fraction of it."""
    found = weights_read_per_token(args.model) if not args.url else None
    if found is None:
        return "\nbandwidth bound: only for a GGUF model (--model FILE.gguf or smollm2)"
    from bandwidth import read_bandwidth

    read, path = found
    threads = args.bandwidth_threads or os.cpu_count() or 1
    gbs = read_bandwidth(threads)
    bound = gbs * 1e9 / read
    lines = [f"\nbandwidth bound of one stream: {read / 1e6:.0f} MB of {path.name} read per "
             f"token, {gbs:.1f} GB/s read ({threads} threads, bandwidth.py) -> "
             f"{bound:.1f} tok/s"]
    for name, levels in results.items():
        if 1 in levels:
            tok_s = levels[1].tok_s
            lines.append(f"  {LABELS.get(name, name):<26} {tok_s:6.1f} tok/s at 1 stream = "
                         f"{tok_s / bound:.0%} of the bound")
    return "\n".join(lines)


def kernel_line() -> str:
    """Which path of nbserve's C kernels runs (NBSERVE_KERNEL_ISA can force the AVX2 one)."""
    try:
        from nbserve.cpu.kernels.build import KernelBuildError, quant_kernels

        width = quant_kernels().nbq_simd_width()
    except (ImportError, KernelBuildError) as exc:
        return f"nbserve kernels: none ({exc})"
    path = {16: "AVX-512", 8: "AVX2", 1: "plain C"}.get(width, f"{width} lanes")
    isa = os.environ.get("NBSERVE_KERNEL_ISA", "native")
    return f"nbserve kernels: {path} (NBSERVE_KERNEL_ISA={isa})"


async def main_async(args: argparse.Namespace) -> None:
    """nbserve first (then it stops), then each peer, then the ratios and the plot."""
    print(cpu_line(), flush=True)
    print(kernel_line(), flush=True)
    levels = parse_levels(args.concurrency)
    if args.url and args.peers:
        print("peers: skipped: --url given (peers are compared with the in-process nbserve)",
              flush=True)
        args.peers = []
    width = max([7, *(len(name) for name in args.peers)])
    results, stop_ids = await measure_nbserve(args, levels, width)
    if args.peers:
        results.update(await measure_peers(args, levels, stop_ids, width))
    summarize(results, args)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags."""
    from peers import PEER_NAMES

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2", help="model source for the in-process server")
    p.add_argument("--url", help="benchmark an external OpenAI-compatible server (…/v1)")
    p.add_argument("--served-model", help="model name to send (default: first of /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--concurrency", "--levels", dest="concurrency", default="1,4,16,64",
                   help="comma-separated concurrency levels")
    p.add_argument("--requests-per-level", type=int, default=None,
                   help="requests per level, at least the concurrency (default 4)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2,
                   help="alternating engine/HTTP rounds per level (less drift between them)")
    p.add_argument("--max-batch", type=int, default=None, help="default: the top concurrency")
    p.add_argument("--max-context", type=int, default=1024)
    p.add_argument("--peers", default=",".join(PEER_NAMES),
                   help=f"peers to load-test when installed (default: {','.join(PEER_NAMES)})")
    p.add_argument("--no-peers", action="store_true", help="nbserve only")
    p.add_argument("--together", action=argparse.BooleanOptionalAction, default=True,
                   help="run the peers side by side, their rounds alternating at each level "
                        "(default; --no-together: one peer after the other)")
    p.add_argument("--dtype", default=None,
                   help="the in-process engine's compute dtype (default: the loader's, float32 "
                   "on CPU): float32, bfloat16, float16")
    p.add_argument("--weights", default="auto", choices=["auto", "blocks", "dense", "mixed16"],
                   help="the in-process engine's weight format (default auto: a quantized GGUF "
                   "on CPU is served from its blocks)")
    p.add_argument("--api", choices=["chat", "completions"], default="chat",
                   help="the route load-tested: chat (the model's template) or completions (the "
                   "question as a plain prompt, for a base model without a chat template)")
    p.add_argument("--exact", action="store_true",
                   help="blocks in float32 arithmetic on every kernel path")
    p.add_argument("--llama-cpp-python", default=sys.executable,
                   help="Python interpreter that has llama-cpp-python[server] installed (default: "
                   "this one); a separate venv keeps its dependencies out of nbserve's")
    p.add_argument("--llama-server-flavour", default="native",
                   choices=["native", "avx2", "avx512"],
                   help="which llama_server.py build to run (avx2: AVX2-class figures on "
                   "an AVX-512 machine, pair it with NBSERVE_KERNEL_ISA=avx2; avx512: AVX-512 "
                   "without AMX, where the native build's AMX path fails)")
    p.add_argument("--peer-timeout", type=float, default=600.0,
                   help="seconds a peer may take to get ready (model export and load)")
    p.add_argument("--bandwidth", action=argparse.BooleanOptionalAction, default=True,
                   help="measure the read bandwidth at the end and print the one-stream "
                   "bound of a GGUF model (default; --no-bandwidth skips it)")
    p.add_argument("--bandwidth-threads", type=int, default=None,
                   help="threads of the bandwidth measure (default: every core, as the "
                   "servers use them)")
    p.add_argument("--plot", type=Path, default=DEFAULT_PLOT,
                   help="PNG plot path (default: benchmarks/serve_bench.png)")
    p.add_argument("--no-plot", dest="plot", action="store_const", const=None,
                   help="write no plot")
    args = p.parse_args(argv)
    args.peers = [] if args.no_peers else [x.strip() for x in args.peers.split(",") if x.strip()]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    API["route"] = args.api
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
