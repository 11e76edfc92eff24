"""Engine decode throughput on a random-weight model, beside the GPU's memory-bandwidth bound.

    python benchmarks/gpu_bench.py                      # Qwen2.5-1.5B shape, cuda, bf16,
                                                        # batch 1,16,64,256
    python benchmarks/gpu_bench.py --config qwen2.5-0.5b --batch 1,16,64
    python benchmarks/gpu_bench.py --device cpu --tiny  # the same path on a tiny model

The model is built on the device with random weights (no download) in a shape nbserve serves;
prompts are random token ids, every request decodes `--new-tokens` tokens (EOS ignored). Decode
tokens/s is measured while every request of the batch is decoding. The bound is what memory
bandwidth allows: each decode step reads every weight once (plus the batch's KV cache), so
bound = batch x bandwidth / (weight bytes + KV bytes read per step). Also: the time to first
token of one `--ttft-prompt`-token prompt (default 2,000) on the idle engine, the KV budget
the engine chose, and its step time split (model, sampling, bookkeeping).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402

from nbserve.engine import Engine  # noqa: E402
from nbserve.execution.weights import count_parameters  # noqa: E402
from nbserve.models.base import LoadedModel  # noqa: E402
from nbserve.models.config import LlamaConfig  # noqa: E402
from nbserve.models.decoder import LlamaModel, build_llama
from nbserve.types import Delta, Request, SamplingParams  # noqa: E402

CONFIGS: dict[str, dict[str, Any]] = {  # shapes of public checkpoints (weights are random)
    "qwen2.5-1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                         num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         head_dim=128, max_position_embeddings=32768, rope_theta=1e6,
                         tie_word_embeddings=True, attention_bias=True,
                         architecture="Qwen2ForCausalLM"),
    "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         head_dim=64, max_position_embeddings=32768, rope_theta=1e6,
                         tie_word_embeddings=True, attention_bias=True,
                         architecture="Qwen2ForCausalLM"),
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=64, max_position_embeddings=131072, rope_theta=5e5,
                         tie_word_embeddings=True, architecture="LlamaForCausalLM"),
    "tiny": dict(vocab_size=640, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 max_position_embeddings=1024, tie_word_embeddings=True),
}
# Vendor datasheet HBM bandwidths, bytes/s, matched against torch.cuda.get_device_name().
BANDWIDTH = [("H200", 4.8e12), ("H100 NVL", 3.9e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12),
             ("GH200", 4.0e12), ("B200", 8.0e12), ("A100-SXM4-80GB", 2.039e12),
             ("A100 80GB PCIe", 1.935e12), ("A100", 1.555e12), ("L40S", 0.864e12),
             ("L4", 0.3e12), ("A10G", 0.6e12), ("A10", 0.6e12), ("RTX 4090", 1.008e12),
             ("T4", 0.32e12)]


def build_random_model(name: str, device: str, dtype: torch.dtype, seed: int = 0) -> LoadedModel:
    """A LlamaModel of shape `name` with N(0, 0.02) weights made on `device`, and a tokenizer."""
    cfg = LlamaConfig(name=f"random-{name}", **CONFIGS[name])
    with torch.device("meta"):
        skeleton = LlamaModel(cfg)
    shapes = [(n, tuple(p.shape)) for n, p in skeleton.named_parameters()
              if not (n == "lm_head.weight" and cfg.tie_word_embeddings)]
    gen = torch.Generator(device=device).manual_seed(seed)

    def tensors():
        for n, shape in shapes:
            if n.endswith("norm.weight"):
                yield n, torch.ones(shape, device=device, dtype=dtype)
            elif n.endswith(".bias"):
                yield n, torch.zeros(shape, device=device, dtype=dtype)
            else:
                yield n, torch.randn(shape, device=device, dtype=dtype, generator=gen).mul_(0.02)

    model = build_llama(cfg, tensors(), device=device, dtype=dtype)
    return LoadedModel(model=model, tokenizer=_tokenizer(), template=None, name=cfg.name,
                       stop_token_ids=[])


def _tokenizer() -> Any:
    """The tests' tiny byte-level BPE: ids beyond its vocabulary decode to nothing, which is
    fine here (the benchmark measures tokens, and the detokenizer still runs for each)."""
    from tiny_models import make_tiny_tokenizer

    from nbserve.text import Tokenizer

    return Tokenizer(make_tiny_tokenizer(), eos_token_ids=[2])


def bandwidth_of(device: str, override_gbs: float | None) -> tuple[float | None, str]:
    if override_gbs:
        return override_gbs * 1e9, "given"
    if torch.device(device).type != "cuda":
        return None, "unknown (pass --bandwidth GB/s)"
    gpu = torch.cuda.get_device_name(torch.device(device))
    for key, bw in BANDWIDTH:
        if key in gpu:
            return bw, f"{gpu} datasheet"
    return None, f"{gpu}: unknown (pass --bandwidth GB/s)"


async def _one(engine: Engine, ids: list[int], new_tokens: int) -> list[float]:
    """Arrival time of each generated token."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    times: list[float] = []
    async for ev in engine.generate(Request(prompt_ids=ids, params=params)):
        if isinstance(ev, Delta):
            times.extend([time.perf_counter()] * len(ev.token_ids))
    return times


async def run_batch(engine: Engine, batch: int, prompt_len: int, new_tokens: int,
                    seed: int) -> dict[str, float]:
    """Decode tokens/s while all `batch` requests decode, and the median inter-token time."""
    g = torch.Generator().manual_seed(seed)
    hi = min(engine.vocab_size, 600)  # ids the tokenizer knows, so prompts are ordinary text
    prompts = [torch.randint(3, hi, (prompt_len,), generator=g).tolist() for _ in range(batch)]
    t0 = time.perf_counter()
    runs = await asyncio.gather(*[_one(engine, p, new_tokens) for p in prompts])
    wall = time.perf_counter() - t0
    start = max(r[0] for r in runs)  # the last request's first token: all are decoding now
    end = min(r[-1] for r in runs)  # the first request's last token
    tokens = sum(sum(start < t <= end for t in r) for r in runs)
    itl = [b - a for r in runs for a, b in zip(r, r[1:]) if start < a and b <= end]
    steady = end > start and tokens > 0
    if not steady:  # too few tokens for a window where all decode: use the whole run
        start, end, tokens = t0, t0 + wall, sum(len(r) for r in runs)
    return {"tokens_per_s": tokens / (end - start), "wall_s": wall,
            "itl_ms_p50": 1e3 * statistics.median(itl) if itl else None,
            "window_s": end - start, "steady": steady}


def step_split_ms(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """Milliseconds a step in each part of the step (model, sampling, bookkeeping) between two
    engine stats snapshots: host time, so on CUDA the GPU's work shows up where the host first
    waits for it (the sampler), not in "model"."""
    steps = max(after["steps"] - before["steps"], 1)
    return {k: 1e3 * (v - before["step_time_s"].get(k, 0.0)) / steps
            for k, v in after["step_time_s"].items()}


async def time_to_first_token(engine: Engine, prompt_len: int, seed: int) -> float:
    """Seconds from submitting one `prompt_len`-token prompt to its first token."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, min(engine.vocab_size, 600), (prompt_len,), generator=g).tolist()
    t0 = time.perf_counter()
    times = await _one(engine, ids, 1)
    return times[0] - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--config", default="qwen2.5-1.5b", choices=sorted(CONFIGS))
    ap.add_argument("--tiny", action="store_true", help="tiny config, few tokens (a smoke run)")
    ap.add_argument("--batch", default="1,16,64,256", help="comma-separated batch sizes")
    ap.add_argument("--ttft-prompt", type=int, default=2000,
                    help="prompt tokens of the time-to-first-token run (0: none)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--bandwidth", type=float, default=None, help="memory bandwidth in GB/s")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    ap.add_argument("--static-decode", choices=["auto", "on", "off"], default="auto",
                    help="decode steps at fixed shapes, CUDA graphs on CUDA (auto: the "
                    "engine's default, on for CUDA)")
    args = ap.parse_args(argv)
    if args.tiny:
        args.config, args.new_tokens, args.prompt_len = "tiny", min(args.new_tokens, 48), 32
        args.ttft_prompt = min(args.ttft_prompt, 256)
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        print(f"CUDA is not available to torch {torch.__version__}: run with --device cpu --tiny")
        return 2
    from nbserve.loading import resolve_dtype

    dtype = resolve_dtype(args.dtype, args.device)
    batches = [int(b) for b in args.batch.split(",")]
    t0 = time.perf_counter()
    loaded = build_random_model(args.config, args.device, dtype)
    n_params, weight_bytes = count_parameters(loaded.model)
    max_context = max(args.prompt_len + args.new_tokens, args.ttft_prompt + 1) + 8
    static = {"auto": None, "on": True, "off": False}[args.static_decode]
    t_engine = time.perf_counter()
    engine = Engine(loaded, max_batch=max(batches), max_context=max_context, quiet=True,
                    static_decode=static)
    engine_s = time.perf_counter() - t_engine
    kv_dtype = engine.cache.dtype
    kv_per_token = loaded.model.kv_bytes_per_token(kv_dtype)
    stats = engine.stats()
    kv = {"budget_bytes": stats["kv_budget_bytes"], "blocks": stats["kv_blocks_total"],
          "block_size": stats["kv_block_size"], "dtype": str(kv_dtype),
          "bytes_per_token": kv_per_token,
          "tokens": stats["kv_blocks_total"] * stats["kv_block_size"]}
    bw, bw_src = bandwidth_of(args.device, args.bandwidth)
    print(f"model {loaded.name}: {n_params / 1e6:.1f} M parameters, {weight_bytes / 2**30:.3f} GiB"
          f" of {str(dtype).replace('torch.', '')} weights on {args.device}, built in "
          f"{time.perf_counter() - t0:.1f} s; KV cache {engine.cache.nbytes / 2**30:.3f} GiB; "
          f"bandwidth {bw / 1e12 if bw else float('nan'):.2f} TB/s ({bw_src})", flush=True)
    print(f"KV budget chosen: {kv['budget_bytes'] / 2**30:.2f} GiB = {kv['blocks']} blocks x "
          f"{kv['block_size']} tokens = {kv['tokens']} tokens ({kv_per_token} B a token, "
          f"{kv['dtype'].replace('torch.', '')})", flush=True)
    graphs = engine.static_decode
    print(f"engine ready in {engine_s:.1f} s; static decode: "
          + ("off" if graphs is None else f"{graphs['graphs']} CUDA graphs captured, buckets "
             f"{graphs['batch_buckets']} x {graphs['length_buckets']} tokens"
             + (f", capture failed: {graphs['capture_error']}" if graphs["capture_error"]
                else "")), flush=True)
    results = []
    ttft = None
    st: Any = None
    try:
        if args.ttft_prompt:
            asyncio.run(run_batch(engine, 1, args.ttft_prompt, 1, seed=7))  # warm-up
            ttft = asyncio.run(time_to_first_token(engine, args.ttft_prompt, seed=8))
            print(f"time to first token, {args.ttft_prompt}-token prompt: {ttft * 1e3:.1f} ms",
                  flush=True)
        for b in batches:  # warm-up: kernels, allocator, the cuBLAS heuristics of each shape
            asyncio.run(run_batch(engine, b, args.prompt_len, 4, seed=99))
        print(f"{'batch':>5} {'decode tok/s':>13} {'bound tok/s':>12} {'of bound':>9} "
              f"{'ITL p50 ms':>11} {'wall s':>7}")
        for b in batches:
            before = engine.stats()
            r = asyncio.run(run_batch(engine, b, args.prompt_len, args.new_tokens, seed=b))
            r["step_ms"] = step_split_ms(before, engine.stats())
            kv_read = b * (args.prompt_len + args.new_tokens / 2) * kv_per_token
            bound = b * bw / (weight_bytes + kv_read) if bw else None
            r.update(batch=b, bound_tokens_per_s=bound,
                     fraction_of_bound=r["tokens_per_s"] / bound if bound else None)
            results.append(r)
            print(f"{b:>5} {r['tokens_per_s']:>13.1f} "
                  f"{bound if bound else float('nan'):>12.1f} "
                  f"{r['fraction_of_bound'] if bound else float('nan'):>9.1%} "
                  f"{r['itl_ms_p50'] or float('nan'):>11.2f} {r['wall_s']:>7.1f}"
                  f"{'' if r['steady'] else '  (whole run: no window where all decode)'}",
                  flush=True)
        print("step time split, ms a step of host time (prefill steps of the batch included; "
              "no sync between the parts: on CUDA 'model' is the launch, and 'sampling' holds "
              "the wait for the step's kernels): " + "; ".join(
            f"batch {r['batch']}: " + ", ".join(f"{k} {v:.2f}" for k, v in r["step_ms"].items())
            for r in results))
        st = engine.stats()["step_time_s"]
        if bw and results and results[0]["batch"] == 1:
            frac = results[0]["fraction_of_bound"]
            print(f"goal: batch-1 decode at least 70% of the bandwidth bound: {frac:.1%} "
                  f"({'met' if frac >= 0.7 else 'NOT met'})")
        print(f"engine step time split over the whole run: {st}")
        if torch.device(args.device).type == "cuda":
            print(f"peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
    finally:
        engine.close()
    summary = {"model": loaded.name, "params": n_params, "weight_bytes": weight_bytes,
               "kv": kv, "ttft_prompt": args.ttft_prompt, "ttft_s": ttft,
               "engine_start_s": engine_s, "static_decode": engine.static_decode,
               "step_time_s": st,
               "device": args.device, "gpu": torch.cuda.get_device_name() if
               torch.device(args.device).type == "cuda" else None,
               "dtype": str(dtype), "bandwidth": bw, "prompt_len": args.prompt_len,
               "new_tokens": args.new_tokens, "torch": torch.__version__, "results": results}
    print("JSON " + json.dumps(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
