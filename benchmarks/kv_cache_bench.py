"""KV cache benchmark (issue 17): nbserve's paged KV cache beside llama.cpp's `llama-server` on
the same GGUF, over HTTP, each server a subprocess started as its users start it.

    python benchmarks/kv_cache_bench.py              # ~27 min on 2 AVX2 cores
    python benchmarks/kv_cache_bench.py --quick      # smoke run: short prompts, 4 users
    python benchmarks/kv_cache_bench.py --skip-peer  # nbserve only

1. Resident memory (VmRSS of the server process from /proc/<pid>/status): idle once ready,
   and the peak (sampled every 0.2 s) under 1 stream and under 16 concurrent streams of
   ~1,000-token prompts, for nbserve's defaults (`python app.py --port P`), for nbserve with
   `--kv-memory` of the same token capacity as `llama-server -np 16 -c 32768` (`--kv-dtype
   float32`, and float16, like llama-server's f16 and nbserve's default for a quantized GGUF),
   and for that llama-server.
2. A shared system prompt of ~1,500 tokens, 16 users with a short different question each,
   sent at once (OpenAI SDK, streaming, 16 new tokens, temperature 0) after one warm-up
   request with that prompt: TTFT p50/p95 and the prompt tokens each server computed
   (nbserve: /stats `tokens_prefilled`, `prefix_cache_hits`; llama-server: /metrics
   `llamacpp:prompt_tokens_total`, and each answer's `timings.prompt_n`/`cache_n`). The same
   with 16 different system prompts of that length (nothing to share).
3. How many 1k-token conversations fit in 2 GiB of resident memory, from each server's idle
   RSS and KV bytes per token, and a run of that many on nbserve with --kv-memory set so
   (float32 and float16 KV).

It prints figures and ratios and asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from peers import (  # noqa: E402
    Peer,
    PeerError,
    PeerSpec,
    RssPeak,
    idle_rss,
    llama_server_spec,
    log_tail,
    make_workdir,
    model_files,
    start_peer,
    status_kib,
    stop_peer,
)
from serve_bench import QUESTIONS, cpu_line, kernel_line, pct  # noqa: E402

APP = ROOT / "app.py"
MIB = 2**20
FALLBACK_LLAMA = Path("/work/peers/build-native/bin/llama-server")
MORE_QUESTIONS = ["What is the boiling point of water?", "Who wrote Hamlet?",
                  "How many legs does a spider have?", "What does a compiler do?"]
ALL_QUESTIONS = QUESTIONS + MORE_QUESTIONS

NB_KV_LINE = re.compile(r"KV cache (\d+) blocks x (\d+) tokens = (\d+) tokens, (\d+) MiB "
                        r"\((.*?); (\w+)\)")


# ----------------------------------------------------------------------------- prompts

SUBJECTS = ["the old harbor", "a quiet village", "the northern railway", "our garden club",
            "the city council", "a small bakery", "the river delta", "the mountain school",
            "an island clinic", "the night market", "the weather station", "a jazz quartet",
            "the copper mine", "the public library", "a fishing crew", "the tram depot"]
VERBS = ["repaired", "counted", "painted", "moved", "sold", "planted", "measured", "found",
         "cleaned", "built", "shipped", "recorded", "borrowed", "lost", "sorted", "tested"]
OBJECTS = ["lanterns", "bicycles", "apple trees", "window frames", "maps", "violins",
           "stone bridges", "blue tiles", "sailboats", "clocks", "wool blankets", "teapots",
           "radios", "notebooks", "wheelbarrows", "kites", "copper pipes", "oak barrels"]
PLACES = ["Lisbon", "Oslo", "Kyoto", "Quito", "Nairobi", "Tallinn", "Hobart", "Cusco",
          "Bergen", "Porto", "Dakar", "Hanoi", "Perth", "Riga", "Lyon", "Accra"]
EXTRAS = ["after the storm", "before the spring fair", "during a long winter",
          "with help from neighbours", "for the first time", "despite the rain",
          "on a Tuesday morning", "while the bells rang", "under a clear sky",
          "as the ferry arrived", "without any fuss", "at a steady pace"]


def make_text(seed: int, chars: int) -> str:
    """Varied plain prose of about `chars` characters (different for every seed)."""
    rng = random.Random(seed)
    out: list[str] = []
    n = 0
    while n < chars:
        kind = rng.random()
        if kind < 0.4:
            s = (f"In {rng.randint(1890, 2030)}, {rng.choice(SUBJECTS)} {rng.choice(VERBS)} "
                 f"{rng.randint(2, 900)} {rng.choice(OBJECTS)} in {rng.choice(PLACES)} "
                 f"{rng.choice(EXTRAS)}.")
        elif kind < 0.7:
            s = (f"{rng.choice(SUBJECTS).capitalize()} {rng.choice(VERBS)} the "
                 f"{rng.choice(OBJECTS)} of {rng.choice(PLACES)}, then {rng.choice(VERBS)} "
                 f"{rng.randint(3, 99)} more {rng.choice(EXTRAS)}.")
        else:
            s = (f"Note {rng.randint(1, 400)}: {rng.choice(OBJECTS)} from "
                 f"{rng.choice(PLACES)} cost {rng.randint(1, 99)}.{rng.randint(0, 99):02d} "
                 f"each, and {rng.choice(SUBJECTS)} kept {rng.randint(1, 60)} of them.")
        out.append(s)
        n += len(s) + 1
    return " ".join(out)[:chars].rsplit(" ", 1)[0]


def user_turn(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text + "\n\nSummarize the notes above in one sentence."}]


def shared_turns(system: str, questions: list[str]) -> list[list[dict[str, str]]]:
    return [[{"role": "system", "content": system}, {"role": "user", "content": q}]
            for q in questions]


def questions(round_: int, users: int) -> list[str]:
    return [f"User {round_}-{i}: {ALL_QUESTIONS[i % len(ALL_QUESTIONS)]}" for i in range(users)]


@dataclass
class ModelFacts:
    """What the GGUF says: KV shape per token and the ids that end an answer."""

    layers: int
    kv_heads: int
    head_dim: int
    stop_ids: list[int]

    def kv_bytes(self, elem: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * elem


def model_facts(gguf: Path) -> ModelFacts:
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf))
    fields = reader.fields

    def scalar(key: str) -> Any:
        f = fields.get(key)
        return None if f is None else f.parts[f.data[0]][0].item()

    arch = bytes(fields["general.architecture"].parts[-1]).decode()
    heads = scalar(f"{arch}.attention.head_count")
    kv_heads = scalar(f"{arch}.attention.head_count_kv") or heads
    head_dim = scalar(f"{arch}.attention.key_length") or \
        scalar(f"{arch}.embedding_length") // heads
    tok = fields["tokenizer.ggml.tokens"]
    names = {bytes(tok.parts[i]).decode(errors="replace"): n for n, i in enumerate(tok.data)}
    stops = [scalar(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot")]
    stops += [names.get(t) for t in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>")]
    return ModelFacts(int(scalar(f"{arch}.block_count")), int(kv_heads), int(head_dim),
                      sorted({int(i) for i in stops if i is not None}))


# ----------------------------------------------------------------------------- requests


@dataclass
class Sample:
    ttft: float | None = None
    chunks: int = 0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    timings: dict[str, Any] | None = None
    error: str | None = None


async def chat(client: Any, model: str, messages: list[dict[str, str]], max_tokens: int,
               bias: dict[str, float] | None = None) -> Sample:
    """One streaming chat request; TTFT is the first chunk with text."""
    s = Sample()
    extra: dict[str, Any] = {"logit_bias": bias} if bias else {}
    t0 = time.perf_counter()
    try:
        stream = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, **extra)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta and chunk.choices[0].delta.content:
                if s.ttft is None:
                    s.ttft = time.perf_counter() - t0
                s.chunks += 1
            if chunk.usage is not None:
                s.prompt_tokens = chunk.usage.prompt_tokens
                s.completion_tokens = chunk.usage.completion_tokens
            timings = (chunk.model_extra or {}).get("timings")
            if timings:
                s.timings = timings
    except Exception as exc:  # noqa: BLE001 - reported, the run goes on
        s.error = f"{type(exc).__name__}: {exc}"[:300]
    if s.ttft is None and s.error is None:
        s.ttft = time.perf_counter() - t0  # an answer with no text at all
    return s


async def burst(client: Any, model: str, convs: list[list[dict[str, str]]], max_tokens: int,
                bias: dict[str, float] | None = None) -> list[Sample]:
    return list(await asyncio.gather(*(chat(client, model, m, max_tokens, bias)
                                       for m in convs)))


def errors(samples: list[Sample]) -> str:
    bad = [s.error for s in samples if s.error]
    return f" ({len(bad)} failed: {bad[0]})" if bad else ""


# ----------------------------------------------------------------------------- servers


@dataclass
class Server:
    label: str
    kind: str  # "nbserve" or "llama"
    peer: Peer
    client: Any
    http: Any
    model: str

    @property
    def pid(self) -> int:
        return self.peer.proc.pid

    @property
    def root(self) -> str:
        return self.peer.base.removesuffix("/v1")

    async def counters(self) -> dict[str, float]:
        """Prompt tokens computed so far (and, for nbserve, prefix-cache hits)."""
        if self.kind == "nbserve":
            st = (await self.http.get(f"{self.root}/stats")).json()
            return {"prefilled": st["tokens_prefilled"], "hits": st["prefix_cache_hits"],
                    "reused": st["tokens_reused"]}
        text = (await self.http.get(f"{self.root}/metrics")).text
        m = re.search(r"^llamacpp:prompt_tokens_total\s+(\S+)", text, re.M)
        return {"prefilled": float(m.group(1)) if m else float("nan")}

    async def stats(self) -> dict[str, Any]:
        return (await self.http.get(f"{self.root}/stats")).json()


async def start(spec: PeerSpec, kind: str, label: str, args: argparse.Namespace,
                workdir: Path) -> Server:
    import httpx
    import openai

    peer = await asyncio.to_thread(start_peer, spec, args.peer_timeout, workdir)
    http = httpx.AsyncClient(timeout=60)
    client = openai.AsyncOpenAI(base_url=peer.base, api_key="none", max_retries=0,
                                timeout=args.peer_timeout)
    try:
        model = (await http.get(f"{peer.base}/models")).json()["data"][0]["id"]
    except BaseException:
        await http.aclose()
        await asyncio.to_thread(stop_peer, peer)
        raise
    print(f"{label}: ready in {peer.ready_s:.1f} s (pid {peer.proc.pid})", flush=True)
    return Server(label, kind, peer, client, http, model)


async def stop(server: Server) -> None:
    await server.client.close()
    await server.http.aclose()
    await asyncio.to_thread(stop_peer, server.peer)


def nbserve_spec(name: str, kv_memory: int | None = None, kv_dtype: str | None = None,
                 extra: tuple[str, ...] = ()) -> PeerSpec:
    """`python app.py --port P [--kv-memory BYTES] [--kv-dtype T]`, as a user runs it."""
    argv = [sys.executable, str(APP), "--port", "{port}", *extra]
    if kv_memory is not None:
        argv += ["--kv-memory", str(kv_memory)]
    if kv_dtype is not None:
        argv += ["--kv-dtype", kv_dtype]
    return PeerSpec(name, argv)


def llama_spec(name: str, gguf: Path, binary: Path | None, parallel: int, context: int
               ) -> PeerSpec:
    spec = llama_server_spec(gguf, binary, parallel=parallel, context=context)
    spec.name = name
    spec.argv.append("--metrics")  # exposes llamacpp:prompt_tokens_total; nothing else changes
    return spec


def find_llama(path: str | None) -> Path | None:
    if path:
        return Path(path)
    from llama_server import find

    found = find()
    if found is None and FALLBACK_LLAMA.is_file():
        return FALLBACK_LLAMA
    return found


def nbserve_kv(log: Path) -> dict[str, Any] | None:
    """nbserve's "KV cache N blocks x 32 tokens = T tokens, M MiB (source; dtype)" line."""
    try:
        m = NB_KV_LINE.search(log.read_text(errors="replace"))
    except OSError:
        return None
    if m is None:
        return None
    blocks, block, tokens, mib, source, dtype = m.groups()
    return {"line": m.group(0), "blocks": int(blocks), "block": int(block),
            "tokens": int(tokens), "mib": int(mib), "source": source, "dtype": dtype,
            "bytes_per_token": int(mib) * MIB / int(tokens)}


# ----------------------------------------------------------------------------- phases


@dataclass
class Memory:
    idle: float | None = None
    peak1: float | None = None
    peak_n: float | None = None
    hwm: float | None = None  # VmHWM once ready: the peak of loading


@dataclass
class Workload:
    round_: int
    samples: list[Sample]
    prefilled: float
    hits: float | None
    wall: float

    @property
    def ttfts(self) -> list[float]:
        return [s.ttft for s in self.samples if s.ttft is not None and s.error is None]

    def p(self, q: float) -> float | None:
        return pct(self.ttfts, q)

    @property
    def prompt_tokens(self) -> int | None:
        values = [s.prompt_tokens for s in self.samples if s.prompt_tokens]
        return int(statistics.median(values)) if values else None

    def timing_sum(self, key: str) -> int | None:
        values = [s.timings.get(key) for s in self.samples if s.timings]
        values = [v for v in values if isinstance(v, (int, float))]
        return int(sum(values)) if values else None


@dataclass
class Result:
    label: str
    kind: str
    memory: Memory = field(default_factory=Memory)
    kv: dict[str, Any] | None = None
    shared: list[Workload] = field(default_factory=list)
    different: list[Workload] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


async def memory_phases(server: Server, res: Result, prompts: dict[str, Any],
                        args: argparse.Namespace, bias: dict[str, float],
                        measure_idle: bool = True) -> None:
    if measure_idle:
        res.memory.idle = await asyncio.to_thread(idle_rss, server.pid)
        print(f"  idle RSS {res.memory.idle:.0f} MiB", flush=True)
    with RssPeak(server.pid) as peak:
        one = await chat(server.client, server.model, user_turn(prompts["mem"][0]),
                         args.mem_max_tokens, bias)
    res.memory.peak1 = peak.peak
    print(f"  1 stream: peak RSS {peak.peak:.0f} MiB ({peak.samples} samples; prompt "
          f"{one.prompt_tokens} + {one.completion_tokens} tokens){errors([one])}", flush=True)
    convs = [user_turn(t) for t in prompts["mem"][1:]]
    with RssPeak(server.pid) as peak:
        many = await burst(server.client, server.model, convs, args.mem_max_tokens, bias)
    res.memory.peak_n = peak.peak
    toks = sum((s.prompt_tokens or 0) + (s.completion_tokens or 0) for s in many)
    print(f"  {len(convs)} streams: peak RSS {peak.peak:.0f} MiB ({peak.samples} samples; "
          f"{toks} tokens in all){errors(many)}", flush=True)
    if server.kind == "nbserve":
        st = await server.stats()
        held = (st["kv_blocks_used"] + st["kv_blocks_cached"]) * st["kv_block_size"]
        res.notes.append(f"after the {len(convs)} streams the cache holds {held} tokens "
                         f"({held * res.kv['bytes_per_token'] / MIB:.0f} MiB of KV) in "
                         f"{st['kv_blocks_used'] + st['kv_blocks_cached']} blocks; "
                         f"preemptions {st['preemptions']}")
        print(f"  {res.notes[-1]}", flush=True)


async def workload(server: Server, convs: list[list[dict[str, str]]], max_tokens: int,
                   round_: int) -> Workload:
    before = await server.counters()
    t0 = time.perf_counter()
    samples = await burst(server.client, server.model, convs, max_tokens)
    wall = time.perf_counter() - t0
    after = await server.counters()
    hits = after["hits"] - before["hits"] if "hits" in after else None
    return Workload(round_, samples, after["prefilled"] - before["prefilled"], hits, wall)


def describe(w: Workload) -> str:
    line = (f"round {w.round_}: TTFT p50 {ms(w.p(50))} p95 {ms(w.p(95))} ms, prompt "
            f"{w.prompt_tokens} tokens each, {w.prefilled:.0f} prompt tokens computed for "
            f"{len(w.samples)} requests")
    if w.hits is not None:
        line += f", prefix-cache hits {w.hits:.0f} tokens"
    prompt_n, cache_n = w.timing_sum("prompt_n"), w.timing_sum("cache_n")
    if prompt_n is not None:
        line += f", timings.prompt_n {prompt_n}"
    if cache_n is not None:
        line += f", timings.cache_n {cache_n}"
    return line + f", wall {w.wall:.1f} s{errors(w.samples)}"


async def workload_phases(server: Server, res: Result, prompts: dict[str, Any],
                          args: argparse.Namespace) -> None:
    warm = await chat(server.client, server.model,
                      shared_turns(prompts["system"], ["Hello."])[0], args.max_tokens)
    print(f"  warm-up with the shared prompt: {warm.prompt_tokens} prompt tokens, TTFT "
          f"{ms(warm.ttft)} ms{errors([warm])}", flush=True)
    for r in range(args.rounds):
        w = await workload(server, shared_turns(prompts["system"], questions(r, args.users)),
                           args.max_tokens, r + 1)
        res.shared.append(w)
        print(f"  shared prompt, {describe(w)}", flush=True)
    for r in range(args.rounds):
        qs = questions(100 + r, args.users)
        convs = [[{"role": "system", "content": s}, {"role": "user", "content": q}]
                 for s, q in zip(prompts["different"][r], qs)]
        w = await workload(server, convs, args.max_tokens, r + 1)
        res.different.append(w)
        print(f"  different prompts, {describe(w)}", flush=True)


async def run_one(spec: PeerSpec, kind: str, label: str, args: argparse.Namespace,
                  workdir: Path, prompts: dict[str, Any], bias: dict[str, float],
                  memory: bool = True, workloads: bool = False) -> Result:
    """Start a server, run the phases asked for, stop it. Failures are printed and kept."""
    res = Result(label, kind)
    print(f"\n{label}: starting", flush=True)
    try:
        server = await start(spec, kind, label, args, workdir)
    except PeerError as exc:
        res.notes.append(f"skipped: {exc}")
        print(f"{label}: skipped: {exc}", flush=True)
        return res
    try:
        if kind == "nbserve":
            res.kv = nbserve_kv(server.peer.log)
            st = await server.stats()
            if res.kv is not None:
                tokens = st["kv_blocks_total"] * st["kv_block_size"]
                res.kv["bytes_per_token"] = st["kv_cache_bytes"] / tokens  # exact, from /stats
                print(f"  log: {res.kv['line']}", flush=True)
        res.memory.hwm = (status_kib(server.pid, "VmHWM") or 0) / 1024
        print(f"  load peak (VmHWM once ready) {res.memory.hwm:.0f} MiB", flush=True)
        if memory:
            await memory_phases(server, res, prompts, args, bias)
        else:
            res.memory.idle = await asyncio.to_thread(idle_rss, server.pid)
            print(f"  idle RSS {res.memory.idle:.0f} MiB", flush=True)
        if workloads:
            await workload_phases(server, res, prompts, args)
    except Exception as exc:  # noqa: BLE001 - keep what was measured
        res.notes.append(f"failed: {type(exc).__name__}: {exc}; log: "
                         f"{log_tail(server.peer.log)}")
        print(f"{label}: {res.notes[-1]}", flush=True)
    finally:
        await stop(server)
    return res


async def verify_fit(args: argparse.Namespace, workdir: Path, kv_bytes: int, n: int,
                     prompts: list[str], bias: dict[str, float], kv_dtype: str | None = None
                     ) -> dict[str, Any]:
    """nbserve with kv_memory=kv_bytes, n concurrent ~1k-token conversations: peak RSS."""
    label = f"nbserve --kv-memory {kv_bytes}" + (f" --kv-dtype {kv_dtype}" if kv_dtype else "")
    print(f"\n{label} (2 GiB fit): starting", flush=True)
    try:
        server = await start(nbserve_spec("nbserve_fit", kv_bytes, kv_dtype), "nbserve", label,
                             args, workdir)
    except PeerError as exc:
        print(f"{label}: skipped: {exc}", flush=True)
        return {"error": str(exc)}
    out: dict[str, Any] = {}
    try:
        kv = nbserve_kv(server.peer.log)
        if kv:
            print(f"  log: {kv['line']}", flush=True)
        out["hwm_ready"] = (status_kib(server.pid, "VmHWM") or 0) / 1024
        out["idle"] = await asyncio.to_thread(idle_rss, server.pid)
        convs = [user_turn(t) for t in prompts[:n]]
        with RssPeak(server.pid) as peak:
            samples = await burst(server.client, server.model, convs, args.conv_answer_tokens,
                                  bias)
        st = await server.stats()
        out.update(peak=peak.peak, samples=peak.samples, n_run=len(convs),
                   hwm=(status_kib(server.pid, "VmHWM") or 0) / 1024,
                   conv_tokens=[(s.prompt_tokens or 0) + (s.completion_tokens or 0)
                                for s in samples],
                   preemptions=st["preemptions"], failed=sum(1 for s in samples if s.error),
                   error=errors(samples))
        print(f"  {len(convs)} concurrent conversations: load peak {out['hwm_ready']:.0f} MiB, "
              f"idle {out['idle']:.0f} MiB, peak RSS "
              f"{peak.peak:.0f} MiB, VmHWM {out['hwm']:.0f} MiB, tokens each "
              f"{min(out['conv_tokens'])}-{max(out['conv_tokens'])}, preemptions "
              f"{st['preemptions']}"
              f"{out['error']}", flush=True)
    except Exception as exc:  # noqa: BLE001
        out["error"] = f"{type(exc).__name__}: {exc}"
        print(f"{label}: failed: {out['error']}", flush=True)
    finally:
        await stop(server)
    return out


# ----------------------------------------------------------------------------- report


def ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def mib(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or not b else f"{a / b:.2f}x"


def print_memory(results: list[Result], peer: Result | None, streams: int) -> None:
    print("\n== 1. resident memory (VmRSS, MiB; peaks sampled every 0.2 s; load peak: VmHWM "
          "once ready) ==")
    rows = [r for r in [*results, *([peer] if peer else [])] if r.memory.idle is not None]
    width = max([30, *(len(r.label) for r in rows),
                 *(len("/ llama-server: " + r.label) for r in results if peer)]) + 1
    print(f"{'server':<{width}} {'load peak':>9} {'idle':>6} {'1 stream':>9} "
          f"{f'{streams} streams':>11}")
    for r in rows:
        m = r.memory
        print(f"{r.label:<{width}} {mib(m.hwm):>9} {mib(m.idle):>6} {mib(m.peak1):>9} "
              f"{mib(m.peak_n):>11}")
    if peer is None or peer.memory.idle is None:
        return
    p = peer.memory
    for r in results:
        m = r.memory
        if m.peak1 is None:
            continue
        print(f"{'/ llama-server: ' + r.label:<{width}} {ratio(m.hwm, p.hwm):>9} "
              f"{ratio(m.idle, p.idle):>6} {ratio(m.peak1, p.peak1):>9} "
              f"{ratio(m.peak_n, p.peak_n):>11}")


def print_workloads(nb: Result | None, peer: Result | None) -> None:
    print("\n== 2. shared system prompt: TTFT (ms) and prompt tokens computed ==")
    rows = [(nb, "shared"), (peer, "shared"), (nb, "different"), (peer, "different")]
    print("   (TTFT p50/p95 in ms; prompt: tokens per request; computed: prompt tokens the "
          "server computed for the burst, in all and per request)")
    print(f"{'server / prompts':<34} {'round':>5} {'p50':>6} {'p95':>6} {'prompt':>7} "
          f"{'computed':>9} {'per req':>8}")
    for r, which in rows:
        if r is None:
            continue
        for w in getattr(r, which):
            n = len(w.samples) or 1
            name = "nbserve" if r.kind == "nbserve" else "llama-server"
            print(f"{name + ' / ' + which:<34} {w.round_:>5} "
                  f"{ms(w.p(50)):>6} {ms(w.p(95)):>6} {w.prompt_tokens or '-':>7} "
                  f"{w.prefilled:>9.0f} {w.prefilled / n:>8.0f}")
    if nb is None or not nb.shared:
        return
    for i, w in enumerate(nb.shared):
        r = w.round_
        line = f"round {r}: nbserve shared TTFT p50"
        if peer is not None and len(peer.shared) > i:
            line += f" / llama-server shared {ratio(w.p(50), peer.shared[i].p(50))}"
        if len(nb.different) > i:
            line += f"; / nbserve different prompts {ratio(w.p(50), nb.different[i].p(50))}"
        if peer is not None and len(peer.different) > i and len(nb.different) > i:
            line += (f"; nbserve different / llama-server different "
                     f"{ratio(nb.different[i].p(50), peer.different[i].p(50))}")
        print(line)
        if peer is not None and len(peer.shared) > i:
            print(f"round {r}: prompt tokens computed, nbserve {w.prefilled:.0f} / "
                  f"llama-server {peer.shared[i].prefilled:.0f} = "
                  f"{ratio(w.prefilled, peer.shared[i].prefilled)}")


def fit_count(limit: float, idle_mib: float, bytes_per_token: float, conv: int
              ) -> tuple[int, int]:
    """(KV tokens, conversations) that fit in `limit` bytes beside `idle_mib` resident."""
    tokens = int(max(0.0, limit - idle_mib * MIB) // bytes_per_token)
    return tokens, tokens // conv


# ----------------------------------------------------------------------------- main


def make_prompts(ratio_: float, args: argparse.Namespace) -> dict[str, Any]:
    sys_chars = round(args.prompt_tokens * ratio_)
    mem_chars = round(args.mem_prompt_tokens * ratio_)
    conv_chars = round(args.conv_prompt_tokens * ratio_)
    return {
        "system": make_text(1, sys_chars),
        "different": [[make_text(1000 + 100 * r + i, sys_chars) for i in range(args.users)]
                      for r in range(args.rounds)],
        "mem": [make_text(100 + i, mem_chars) for i in range(args.streams + 1)],
        "conv": [make_text(5000 + i, conv_chars) for i in range(args.verify_max)],
    }


async def calibrate(server: Server, args: argparse.Namespace) -> float:
    """Characters per token of make_text's prose, from nbserve's tokenizer (/v1/completions
    usage; a raw prompt, so the chat prompts' cached blocks are not touched)."""
    async def tokens(text: str) -> int:
        r = await server.client.completions.create(model=server.model, prompt=text,
                                                   max_tokens=1, temperature=0)
        return r.usage.prompt_tokens

    probe = make_text(7, 5000)
    ratio_ = len(probe) / await tokens(probe)
    target = args.prompt_tokens
    got = await tokens(make_text(1, round(target * ratio_)))
    ratio_ *= target / got  # one correction on the real system prompt
    got2 = await tokens(make_text(1, round(target * ratio_)))
    print(f"  prompts: {ratio_:.2f} characters per token; the shared system prompt is "
          f"{round(target * ratio_)} characters = {got2} tokens (as a raw completion prompt)",
          flush=True)
    return ratio_


PARTS = ("defaults", "kv", "kv16", "peer", "fit", "fit16")


def fit_line(label: str, fit: dict[str, Any], limit: float) -> str:
    if fit.get("peak") is None:
        return f"  run ({label}): failed: {fit.get('error')}"
    under = "under" if fit["peak"] < limit / MIB else "OVER"
    return (f"  run ({label}): {fit['n_run']} concurrent conversations of "
            f"{min(fit['conv_tokens'])}-{max(fit['conv_tokens'])} tokens: idle {fit['idle']:.0f} "
            f"MiB, peak RSS "
            f"{fit['peak']:.0f} MiB ({under} {limit / MIB:.0f}); VmHWM {fit['hwm']:.0f} MiB "
            f"(loading: {fit['hwm_ready']:.0f}), preemptions {fit['preemptions']}"
            f"{fit['error']}")


async def main_async(args: argparse.Namespace) -> None:
    print(cpu_line(), flush=True)
    print(kernel_line(), flush=True)
    print(f"started {time.strftime('%Y-%m-%d %H:%M:%S %Z')}; parts {','.join(args.parts)}",
          flush=True)
    gguf, _ = model_files(args.model)
    if gguf is None:
        raise SystemExit("kv_cache_bench needs a .gguf model (the default, or --model x.gguf)")
    facts = model_facts(gguf)
    bias = {str(t): -100.0 for t in facts.stop_ids}  # every stream runs to max_tokens
    print(f"model file {gguf} ({gguf.stat().st_size / MIB:.0f} MiB): {facts.layers} layers, "
          f"{facts.kv_heads} KV heads x {facts.head_dim}; KV per token 2 x layers x heads x "
          f"dim x 4 = {facts.kv_bytes(4)} B in float32, {facts.kv_bytes(2)} B in 16 bits; "
          f"stop ids {facts.stop_ids}", flush=True)
    parts = set(args.parts)
    llama_bin = find_llama(args.llama_server) if "peer" in parts else None
    workdir = make_workdir()
    results: list[Result] = []
    a: Result | None = None
    peer: Result | None = None
    small: Result | None = None
    fits: dict[str, dict[str, Any]] = {}
    llama_fit: dict[str, Any] = {}
    cap = args.llama_context
    limit = args.limit_gib * 2**30
    conv = args.conv_tokens
    t_start = time.perf_counter()
    try:
        # (a') nbserve without the chat UI: idle, then its tokenizer sizes the prompts (on a
        # server of its own, so that no measured server holds the calibration's KV pages)
        label = "nbserve --no-ui (idle only)"
        print(f"\n{label}: starting", flush=True)
        server = await start(nbserve_spec("nbserve_no_ui", extra=("--no-ui",)), "nbserve",
                             label, args, workdir)
        no_ui = Result(label, "nbserve")
        try:
            no_ui.kv = nbserve_kv(server.peer.log)
            st = await server.stats()
            bpt = st["kv_cache_bytes"] / (st["kv_blocks_total"] * st["kv_block_size"])
            if no_ui.kv is not None:
                print(f"  log: {no_ui.kv['line']}", flush=True)
                print(f"  KV bytes per token: {bpt:.0f} (/stats), "
                      f"{no_ui.kv['bytes_per_token']:.0f} (the log line's MiB / tokens)",
                      flush=True)
                no_ui.kv["bytes_per_token"] = bpt
            no_ui.memory.hwm = (status_kib(server.pid, "VmHWM") or 0) / 1024
            no_ui.memory.idle = await asyncio.to_thread(idle_rss, server.pid)
            print(f"  idle RSS {no_ui.memory.idle:.0f} MiB, load peak {no_ui.memory.hwm:.0f} MiB",
                  flush=True)
            prompts = make_prompts(await calibrate(server, args), args)
        finally:
            await stop(server)
        bpt16, bpt32 = facts.kv_bytes(2), facts.kv_bytes(4)  # the budgets' own dtypes
        # (a) nbserve as a user starts it: python app.py --port P
        if "defaults" in parts:
            a = await run_one(nbserve_spec("nbserve_defaults"), "nbserve",
                              "nbserve defaults (python app.py)", args, workdir, prompts, bias,
                              workloads=not args.memory_only)
            results.append(a)
        results.append(no_ui)
        # (b) nbserve with llama-server's token capacity, float32 and float16 KV
        if "kv" in parts:
            results.append(await run_one(
                nbserve_spec("nbserve_kv", cap * bpt32, "float32"), "nbserve",
                f"nbserve --kv-memory {cap * bpt32} --kv-dtype float32 ({cap} tokens)", args,
                workdir, prompts, bias))
        if "kv16" in parts:
            results.append(await run_one(
                nbserve_spec("nbserve_kv16", cap * bpt16, "float16"), "nbserve",
                f"nbserve --kv-memory {cap * bpt16} --kv-dtype float16 ({cap} tokens)", args,
                workdir, prompts, bias))
        if "peer" in parts:
            peer = await run_one(llama_spec("llama_server", gguf, llama_bin, args.llama_parallel,
                                            args.llama_context), "llama",
                                 f"llama-server -np {args.llama_parallel} -c {args.llama_context}",
                                 args, workdir, prompts, bias, workloads=not args.memory_only)
            small = await run_one(llama_spec("llama_server_small", gguf, llama_bin, 1, 1024),
                                  "llama", "llama-server -np 1 -c 1024 (idle only)", args,
                                  workdir, prompts, bias, memory=False)

        # 3. 2 GiB of conversations: the idle RSS of nbserve as users run it (with its UI)
        ui_idles = [r.memory.idle for r in results if r is not no_ui and r.memory.idle]
        ref_idle = ui_idles[0] if ui_idles else no_ui.memory.idle or 0
        plans = {"fit": (bpt32, "float32"), "fit16": (bpt16, "float16")}
        for name, (per_token, dtype) in plans.items():
            tokens, n = fit_count(limit, ref_idle, per_token, conv)
            fits[name] = {"bpt": per_token, "tokens": tokens, "n": n, "dtype": dtype}
            if name in parts and not args.no_verify and n > 0:
                fits[name].update(await verify_fit(args, workdir, int(tokens * per_token),
                                                   min(n, args.verify_max), prompts["conv"],
                                                   bias, dtype))
        if small is not None and small.memory.idle is not None:
            base = small.memory.idle - 1024 * bpt16 / MIB  # its idle without its 1k-token KV
            l_tokens, n_l = fit_count(limit, base, bpt16, conv)
            llama_fit = {"base": base, "tokens": l_tokens, "n": n_l}
            if n_l > 0 and not args.no_verify and not args.quick:
                r = await run_one(llama_spec("llama_server_fit", gguf, llama_bin, n_l, n_l * conv),
                                  "llama", f"llama-server -np {n_l} -c {n_l * conv} (idle only)",
                                  args, workdir, prompts, bias, memory=False)
                llama_fit["idle"] = r.memory.idle
    finally:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)

    # ------------------------------------------------------------------ report
    print(f"\n{cpu_line()}\nended {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, wall time "
          f"{time.perf_counter() - t_start:.0f} s")
    for r in [*results, *([peer] if peer else [])]:
        if r.kv:
            print(f"{r.label}: {r.kv['line']}")
        for note in r.notes:
            print(f"{r.label}: {note}")
    if peer is not None:
        print(f"{peer.label}: KV f16 (its default -ctk/-ctv), {args.llama_context} x "
              f"{bpt16} B = {args.llama_context * bpt16 / MIB:.0f} MiB, allocated at start; "
              f"one {args.llama_context // args.llama_parallel}-token context per slot")
    print_memory(results, peer, args.streams)
    print_workloads(a, peer)
    print(f"\n== 3. 1k-token conversations ({conv} tokens each) in {args.limit_gib:g} GiB ==")
    for f in fits.values():
        what = f"--kv-dtype {f['dtype']}"
        print(f"nbserve, {what}: ({args.limit_gib:g} GiB - idle {ref_idle:.0f} MiB) / "
              f"{f['bpt']:.0f} B per token = {f['tokens']} tokens = {f['n']} conversations "
              f"(--kv-memory {int(f['tokens'] * f['bpt'])})")
        if f.get("peak") is not None or f.get("error"):
            print(fit_line(what, f, limit))
        if f.get("peak") is not None:
            kv_used = sum(f["conv_tokens"]) * f["bpt"] / MIB
            extra = f["peak"] - f["idle"] - kv_used
            n_adj = fit_count(limit, f["idle"] + extra, f["bpt"], conv)[1]
            print(f"  beyond idle and the conversations' KV ({kv_used:.0f} MiB) the run took "
                  f"{extra:.0f} MiB more at its peak; counting that too: {n_adj} conversations "
                  f"(an estimate, not run)")
    if llama_fit:
        print(f"llama-server: ({args.limit_gib:g} GiB - base {llama_fit['base']:.0f} MiB "
              f"[idle at -c 1024 less its KV]) / {bpt16} B per token (f16) = "
              f"{llama_fit['tokens']} tokens = {llama_fit['n']} conversations")
        if llama_fit.get("idle") is not None:
            print(f"  started at -np {llama_fit['n']} -c {llama_fit['n'] * conv}: idle RSS "
                  f"{llama_fit['idle']:.0f} MiB (its f16 KV, "
                  f"{llama_fit['n'] * conv * bpt16 / MIB:.0f} MiB, is allocated at start; not "
                  f"load-tested)")
            extra = llama_fit["idle"] - llama_fit["base"] - llama_fit["n"] * conv * bpt16 / MIB
            per_slot = extra / llama_fit["n"]
            n_adj = int((limit / MIB - llama_fit["base"]) // (conv * bpt16 / MIB + per_slot))
            print(f"  beyond base and KV it holds {extra:.0f} MiB more ({per_slot:.1f} MiB per "
                  f"slot); counting that per slot: {n_adj} conversations (an estimate, not run)")
        for name, f in fits.items():
            if f["n"] and llama_fit["n"]:
                print(f"ratio nbserve ({name}) / llama-server conversations: "
                      f"{f['n'] / llama_fit['n']:.2f}x")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2", help="a .gguf file, or smollm2 (default)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: short prompts, 4 users and streams, 1 round")
    p.add_argument("--skip-peer", action="store_true", help="nbserve only (no llama-server)")
    p.add_argument("--memory-only", action="store_true",
                   help="part 1 only: no shared-prompt workloads (part 2)")
    p.add_argument("--parts", default=",".join(PARTS),
                   help=f"what to run (default: all of {','.join(PARTS)}): defaults = nbserve "
                   "as started by `python app.py` (memory and the shared-prompt workload), kv / "
                   "kv16 = nbserve with llama-server's token capacity (float32 / float16 KV), "
                   "peer = llama-server, fit / fit16 = part 3's nbserve runs")
    p.add_argument("--llama-server", default=None,
                   help="the llama-server binary (default: llama_server.py's cached build)")
    p.add_argument("--llama-parallel", type=int, default=16, help="llama-server -np")
    p.add_argument("--llama-context", type=int, default=32768, help="llama-server -c")
    p.add_argument("--prompt-tokens", type=int, default=1500, help="shared system prompt")
    p.add_argument("--users", type=int, default=16, help="concurrent users in part 2")
    p.add_argument("--rounds", type=int, default=2, help="bursts per workload in part 2")
    p.add_argument("--max-tokens", type=int, default=16, help="new tokens per answer, part 2")
    p.add_argument("--streams", type=int, default=16, help="concurrent streams in part 1")
    p.add_argument("--mem-prompt-tokens", type=int, default=1000, help="prompt, part 1")
    p.add_argument("--mem-max-tokens", type=int, default=64, help="new tokens, part 1")
    p.add_argument("--limit-gib", type=float, default=2.0, help="memory limit of part 3")
    p.add_argument("--conv-tokens", type=int, default=1100,
                   help="tokens one conversation takes in part 3 (prompt + answer)")
    p.add_argument("--conv-prompt-tokens", type=int, default=980,
                   help="its prompt's text (the chat template and a question add ~20)")
    p.add_argument("--conv-answer-tokens", type=int, default=100, help="its answer")
    p.add_argument("--verify-max", type=int, default=64,
                   help="at most this many conversations in part 3's nbserve run")
    p.add_argument("--no-verify", action="store_true", help="part 3 computed only")
    p.add_argument("--peer-timeout", type=float, default=600.0,
                   help="seconds a server may take to get ready, and a request to answer")
    args = p.parse_args(argv)
    args.parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown:
        p.error(f"unknown part(s) {', '.join(unknown)}; parts: {', '.join(PARTS)}")
    if args.skip_peer:
        args.parts = [x for x in args.parts if x != "peer"]
    if args.quick:
        args.prompt_tokens, args.users, args.rounds, args.streams = 300, 4, 1, 4
        args.mem_prompt_tokens, args.mem_max_tokens, args.max_tokens = 200, 8, 8
        args.conv_prompt_tokens, args.conv_tokens, args.verify_max = 200, 240, 4
        args.conv_answer_tokens = 20
    return args


def main(argv: list[str] | None = None) -> None:
    asyncio.run(main_async(parse_args(argv)))


if __name__ == "__main__":
    main()
