"""In-process engine benchmark on the default model, beside `transformers` generate, in one run.

Prints: load time, parameters, weight bytes; prefill tokens/s; single-stream decode tokens/s
(float32, and weights="mixed16" and "blocks" with how many of 20 greedy answers differ from
float32); aggregate decode tokens/s at 1, 4, 16, 32 concurrent requests; transformers
`generate` at batch 1 and a left-padded batch of 16 on the same weights and prompts; llama.cpp
single-stream on the same GGUF (`--llama-cpp-python`); and the ratios. Single-stream figures,
nbserve's and the peers', are the median of 3 runs after a warm-up run.

    python benchmarks/engine_bench.py               # full run (a few minutes on 2 cores)
    python benchmarks/engine_bench.py --quick       # fewer levels, for a smoke test
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import nbserve  # noqa: E402
from nbserve.engine import Engine  # noqa: E402
from nbserve.execution.weights import count_parameters  # noqa: E402
from nbserve.loading import summary_line  # noqa: E402
from nbserve.models.dtypes import FORMAT_ALIASES, load_kwargs  # noqa: E402
from nbserve.types import Delta, Request, SamplingParams  # noqa: E402

TOPICS = ["the moon", "bread", "rivers", "chess", "volcanoes", "owls", "the piano", "glaciers",
          "bicycles", "honey", "lighthouses", "tea", "comets", "coral reefs", "maps", "clocks",
          "deserts", "whales", "paper", "bridges", "tides", "bees", "castles", "rainbows",
          "trains", "cheese", "caves", "kites", "forests", "salt", "storms", "libraries"]


def chat_prompts(tokenizer, template, n: int) -> list[list[int]]:
    """n different chat prompts of about 60 tokens each."""
    out = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        msg = [{"role": "user", "content": f"Write a short paragraph about {topic}, with one "
                                           f"surprising fact that most people do not know."}]
        out.append(tokenizer.encode(template.render(msg, add_generation_prompt=True)))
    return out


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


async def run_concurrent(engine: Engine, prompts: list[list[int]], max_tokens: int) -> dict:
    """All prompts at once; aggregate output tokens/s over the wall time, and TTFT."""
    ttft: list[float] = []

    async def one(ids: list[int]) -> int:
        t0, n = time.perf_counter(), 0
        async for ev in engine.generate(Request(prompt_ids=ids, params=params(max_tokens))):
            if isinstance(ev, Delta):
                if n == 0:
                    ttft.append(time.perf_counter() - t0)
                n += len(ev.token_ids)
        return n

    t0 = time.perf_counter()
    counts = await asyncio.gather(*[one(p) for p in prompts])
    wall = time.perf_counter() - t0
    ttft.sort()
    return {"tok_s": sum(counts) / wall, "ttft_p50": ttft[len(ttft) // 2]}


def single_stream(engine: Engine, ids: list[int], max_tokens: int) -> tuple[float, float]:
    """(prefill tokens/s, decode tokens/s) of one request alone."""
    t0 = time.perf_counter()
    times = []
    for ev in engine.stream(Request(prompt_ids=ids, params=params(max_tokens))):
        if isinstance(ev, Delta):
            times.append(time.perf_counter())
    prefill = len(ids) / (times[0] - t0)
    decode = (len(times) - 1) / (times[-1] - times[0])
    return prefill, decode


STEADY_RUNS = 3  # single-stream figures: the median of this many runs after a warm-up run


def steady_single_stream(engine: Engine, ids: list[int], max_tokens: int) -> tuple[float, float]:
    """`single_stream` in steady state: one full warm-up run (the engine's thread tuner times
    its choices over the first forwards), then the median of STEADY_RUNS runs. llama.cpp's
    figure is taken the same way (LLAMA_CPP_CHILD)."""
    single_stream(engine, ids, max_tokens)
    runs = sorted(single_stream(engine, ids, max_tokens) for _ in range(STEADY_RUNS))
    prefill = sorted(r[0] for r in runs)[len(runs) // 2]
    return prefill, sorted(r[1] for r in runs)[len(runs) // 2]


def hf_generate(model, prompts: list[list[int]], max_tokens: int, pad_id: int) -> float:
    """transformers generate, greedy, left-padded batch; returns output tokens/s."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, do_sample=False, pad_token_id=pad_id)
    wall = time.perf_counter() - t0
    return (out.shape[1] - width) * len(prompts) / wall


async def answers(engine: Engine, prompts: list[list[int]], max_tokens: int,
                  together: bool, ignore_eos: bool = False) -> list[list[int]]:
    """Greedy token ids for each prompt, all at once (batched) or one after another (alone)."""

    async def one(ids: list[int]) -> list[int]:
        out: list[int] = []
        async for ev in engine.generate(Request(prompt_ids=ids, params=SamplingParams(
                temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos))):
            if isinstance(ev, Delta):
                out += ev.token_ids
        return out

    if together:
        return list(await asyncio.gather(*[one(p) for p in prompts]))
    return [await one(p) for p in prompts]


QUALITY_PROMPTS = 20  # greedy answers compared: formats against float32, float32 against HF
WEIGHT_FORMATS = tuple(FORMAT_ALIASES)  # mixed16, quantized, quantized-exact: the formats
# timed, named as the model's weight_format names them


def format_figures(fmt: str, model: str, prompts: list[list[int]], reference: list[list[int]],
                   max_tokens: int, quality_tokens: int,
                   hf_greedy: list[list[int]] | None = None) -> list[tuple[str, float]]:
    """Weight format `fmt` (mixed16; quantized: weights="blocks"; quantized-exact: blocks with
    exact=True): single-stream decode, and how many
    greedy answers differ from float32 (each answered alone, so that its steps use the
    copies); with `hf_greedy`, how many equal transformers', answered alone (one-row steps:
    for quantized on AVX2, inputs rounded to 16 bits) and all together (steps of 20 rows: for
    quantized, the panel kernel). `fmt` "quantized:float16": the same
    with a float16 KV cache (`kv_dtype`)."""
    name, _, kv_dtype = fmt.partition(":")
    loaded = nbserve.load(model, verbose=False, **load_kwargs(name))
    with Engine(loaded, max_batch=max(4, len(reference)), max_context=512, quiet=True,
                kv_dtype=kv_dtype or None) as engine:
        _, decode = steady_single_stream(engine, prompts[0], max_tokens)
        got = asyncio.run(answers(engine, prompts[:len(reference)], quality_tokens, False))
        vs_hf = [asyncio.run(answers(engine, prompts[:len(hf_greedy)], quality_tokens, together,
                                     ignore_eos=True)) for together in (False, True)] \
            if hf_greedy else []
    changed = [i for i, (a, b) in enumerate(zip(got, reference)) if a != b]
    first = [next((j for j, (x, y) in enumerate(zip(got[i], reference[i])) if x != y),
                  min(len(got[i]), len(reference[i]))) for i in changed]
    print(f"{fmt}: {len(changed)} of {len(reference)} greedy answers ({quality_tokens} tokens) "
          f"differ from float32" + (f", first differing token at {first}" if first else ""))
    rows = [(f"nbserve {fmt} single-stream decode", decode),
            (f"{fmt} greedy answers equal to float32, of {len(reference)}",
             float(len(reference) - len(changed)))]
    for how, got_hf in zip(("alone", "all together"), vs_hf):
        same = sum(a == b for a, b in zip(got_hf, hf_greedy or []))
        print(f"{fmt}, {how}: {same} of {len(got_hf)} greedy answers ({quality_tokens} tokens) "
              "identical to transformers'")
        rows.append((f"{fmt} ({how}) answers equal to transformers', of {len(got_hf)}",
                     float(same)))
    return rows


def transformers_figures(max_tokens: int, batch: int, quality: int) -> None:
    """Child process: print transformers' (batch 1, padded batch) tokens/s as JSON, and its
    greedy answers (`quality` tokens, past end-of-text) to the first 20 prompts, each alone."""
    from transformers import AutoModelForCausalLM

    from nbserve.loading.default import default_model_path

    loaded = nbserve.load("smollm2", verbose=False)  # tokenizer and template only
    prompts = chat_prompts(loaded.tokenizer, loaded.template, max(batch, QUALITY_PROMPTS))
    path = default_model_path()
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                              dtype=torch.float32).eval()
    hf_generate(hf, prompts[:1], max_tokens, 0)  # warm-up, then the median of STEADY_RUNS
    one = sorted(hf_generate(hf, prompts[:1], max_tokens, 0) for _ in range(STEADY_RUNS))[
        STEADY_RUNS // 2]
    many = hf_generate(hf, prompts[:batch], max_tokens, 0)
    greedy = []
    with torch.no_grad():
        for ids in prompts[:QUALITY_PROMPTS] if quality else []:
            out = hf.generate(input_ids=torch.tensor([ids]), max_new_tokens=quality,
                              min_new_tokens=quality, do_sample=False, pad_token_id=0)
            greedy.append(out[0, len(ids):].tolist())
    print(json.dumps({"batch1": one, "batched": many, "greedy": greedy}))


LLAMA_CPP_CHILD = r"""
import json, sys, time
from llama_cpp import Llama
path, max_tokens, ids = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
llm = Llama(model_path=path, n_ctx=512, verbose=False)  # its own default thread count

def run(n):
    times = []
    for _ in llm.generate(ids, temp=0.0, top_k=1, reset=True):  # greedy, past end-of-text
        times.append(time.perf_counter())
        if len(times) >= n:
            break
    return times

run(max_tokens)  # warm-up, then the median of 3 runs (as nbserve's steady_single_stream)
rates = sorted((len(t) - 1) / (t[-1] - t[0]) for t in (run(max_tokens) for _ in range(3)))
print(json.dumps({"decode": rates[1]}))
"""


def llama_cpp_in_subprocess(python: str, ids: list[int], max_tokens: int) -> float | None:
    """llama.cpp's single-stream decode tokens/s on the same GGUF file and prompt, through
    llama-cpp-python in `python` (its own venv is fine); None, with a line, if it cannot run."""
    from nbserve.loading.default import default_model_path

    try:
        done = subprocess.run([python, "-c", LLAMA_CPP_CHILD, str(default_model_path()),
                               str(max_tokens), json.dumps(ids)],
                              capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        print(f"llama.cpp: skipped ({exc})")
        return None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["?"])[-1]
        print(f"llama.cpp: skipped ({last}); install llama-cpp-python, see benchmarks/README.md")
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])["decode"]


def transformers_in_subprocess(max_tokens: int, batch: int, quality: int
                               ) -> tuple[float, float, list[list[int]]]:
    """transformers runs in a fresh process with torch's defaults: no thread pool left over
    from the engine can slow it (or flatter nbserve)."""
    out = subprocess.run([sys.executable, __file__, "--transformers-child",
                          "--max-tokens", str(max_tokens), "--hf-batch", str(batch),
                          "--quality-tokens", str(quality)],
                         check=True, capture_output=True, text=True).stdout
    figures = json.loads(out.strip().splitlines()[-1])
    return figures["batch1"], figures["batched"], figures["greedy"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--levels", default="1,4,16,32")
    ap.add_argument("--quick", action="store_true", help="levels 1,4 and a batch of 4 for HF")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--formats", default=",".join(WEIGHT_FORMATS),
                    help="weight formats to time single-stream and check against float32's "
                    "20 greedy answers (default: %(default)s; '' for none; 'quantized:float16' "
                    "for a float16 KV cache)")
    ap.add_argument("--threads", type=int, default=None,
                    help="engine threads (default: tuned per forward size by timing)")
    ap.add_argument("--llama-cpp-python", default=sys.executable,
                    help="Python with llama-cpp-python installed, for llama.cpp's single-stream "
                    "figure on the same GGUF (default: this one; skipped if it lacks it)")
    ap.add_argument("--transformers-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--hf-batch", type=int, default=16, help=argparse.SUPPRESS)
    ap.add_argument("--quality-tokens", type=int, default=32, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.transformers_child:
        transformers_figures(args.max_tokens, args.hf_batch, args.quality_tokens)
        return
    levels = [1, 4] if args.quick else [int(x) for x in args.levels.split(",")]
    hf_batch = 4 if args.quick else 16

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{time.strftime('%Y-%m-%d %H:%M')}")
    t0 = time.perf_counter()
    loaded = nbserve.load(args.model, weights="dense", verbose=False)  # not the default for
    # a GGUF of Q4/Q8 blocks ("quantized", timed below with the other formats): the baseline
    load_s = time.perf_counter() - t0
    n_params, n_bytes = count_parameters(loaded.model)
    print(summary_line(loaded, load_s))
    engine = Engine(loaded, max_batch=max(levels), max_context=512, quiet=True,
                    threads=args.threads)
    print(f"engine threads: {engine.threads}; transformers threads: {torch.get_num_threads()}")
    prompts = chat_prompts(loaded.tokenizer, loaded.template, max(levels + [hf_batch, 20]))
    print(f"prompts: {len(prompts)} chats of {min(map(len, prompts))}-"
          f"{max(map(len, prompts))} tokens, {args.max_tokens} new tokens each, greedy")

    prefill, decode = steady_single_stream(engine, prompts[0], args.max_tokens)
    rows = [("nbserve single-stream decode", decode), ("nbserve prefill (tokens/s)", prefill)]
    agg = {}
    for n in levels:
        r = asyncio.run(run_concurrent(engine, prompts[:n], args.max_tokens))
        agg[n] = r["tok_s"]
        rows.append((f"nbserve aggregate, {n} concurrent (TTFT p50 {r['ttft_p50']:.2f} s)",
                     r["tok_s"]))
    stats = engine.stats()
    quality_tokens = args.quality_tokens
    formats = [f for f in args.formats.split(",") if f]
    alone = None if args.no_transformers else asyncio.run(  # to compare with transformers'
        answers(engine, prompts[:QUALITY_PROMPTS], quality_tokens, False, ignore_eos=True))
    reference = asyncio.run(answers(engine, prompts[:QUALITY_PROMPTS], quality_tokens, True)) \
        if formats else None
    engine.close()
    hf1 = hf16 = None
    hf_greedy: list[list[int]] | None = None
    if not args.no_transformers:
        if args.model != "smollm2":
            print("transformers comparison only wired for the default model; skipping")
        else:
            hf1, hf16, hf_greedy = transformers_in_subprocess(args.max_tokens, hf_batch,
                                                              quality_tokens)
            rows += [("transformers generate, batch 1", hf1),
                     (f"transformers generate, padded batch {hf_batch}", hf16)]
            same = sum(a == b for a, b in zip(alone or [], hf_greedy))
            print(f"float32, each prompt alone: {same} of {len(hf_greedy)} greedy answers "
                  f"({quality_tokens} tokens) identical to transformers'")
            rows.append((f"float32 greedy answers equal to transformers', of {len(hf_greedy)}",
                         float(same)))
    for fmt in formats:
        rows += format_figures(fmt, args.model, prompts, reference, args.max_tokens,
                               quality_tokens, hf_greedy)

    llama = llama_cpp_in_subprocess(args.llama_cpp_python, prompts[0], args.max_tokens) \
        if args.model == "smollm2" else None
    if llama:
        rows.append(("llama.cpp (llama-cpp-python, Q4_1 file) single-stream decode", llama))

    copies = getattr(loaded.model, "derived_bytes", lambda: 0)()
    print(f"\nload {load_s:.1f} s | {n_params / 1e6:.1f}M parameters | "
          f"{(n_bytes - copies) / 2**20:.0f} MiB weights "
          f"({str(loaded.model.dtype).replace('torch.', '')}) + {copies / 2**20:.0f} MiB copies")
    print(f"{'measure':<58} {'tokens/s':>9}")
    for name, value in rows:
        print(f"{name:<58} {value:>9.1f}")
    if hf1:
        print(f"\nratio single-stream decode / transformers batch 1: {decode / hf1:.2f}x")
        key = hf_batch if hf_batch in agg else max(agg)
        print(f"ratio aggregate at {key} concurrent / transformers padded batch {hf_batch}: "
              f"{agg[key] / hf16:.2f}x")
    if llama:
        print(f"ratio single-stream decode / llama.cpp: float32 {decode / llama:.2f}x" +
              "".join(f", {k.split()[1]} {v / llama:.2f}x" for k, v in rows
                      if k.endswith("single-stream decode") and k.split()[1] in WEIGHT_FORMATS))
    split = stats["step_time_s"]
    print(f"engine step time split: model {split['model']:.2f} s, sampling "
          f"{split['sampling']:.2f} s, bookkeeping {split['bookkeeping']:.2f} s "
          f"({stats['bookkeeping_fraction'] * 100:.1f}%)")
    print(f"engine threads per forward size (tokens: choice, ms per forward): {stats['threads']}")


if __name__ == "__main__":
    main()
