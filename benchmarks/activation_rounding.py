"""What rounding the matmul inputs to integers per 32-value block would do to the default
model's greedy answers: the arithmetic of llama.cpp's CPU kernels (8-bit activations, Q8_0/Q8_1
style: scale = max |x| / 127 per block) and of a 16-bit variant (max |x| / 32767), against the
float32 activations nbserve's quantized kernels use.

The model runs in float32 on the GGUF's dequantized weights, through plain F.linear, with the
input of every matmul (after its norm, or silu(gate) * up) rounded and scaled back first; so
only the activations' rounding differs between the modes. 20 chat prompts, each alone, 64
greedy tokens past end-of-text: how many answers stay identical to the unrounded run, and where
the others first differ. Asserts nothing.

With `--file FILE.gguf` (a quantized GGUF, e.g. a K-quant file): the real kernels instead of
a simulation. The file loads once per mode, served from its blocks (`FILE_MODES`):
weights="blocks", exact=True (float32 arithmetic on gguf's dequantized weights, the
reference); weights="blocks" with NBSERVE_ROUND16=1 and NBSERVE_ROUND8=0 (the integer row
kernels of cpu/kernels/gguf_blocks.c and quant_matmul.c: a lone stream's matmul inputs rounded
to 16 bits per block of 32); with Q4_K's and Q6_K's inputs in decode steps rounded to 8 bits
per 256 (llama.cpp's Q8_K) and prompts at 16 bits (NBSERVE_ROUND8=decode); the default (the
same decode steps, prompt chunks past 8 rows at 8 bits per 32 through gemm8); and with
NBSERVE_ROUND8=all (every prompt chunk; up to 8 rows per 256). The same count of identical
greedy answers, each rounding against exact; then `transformers` on the same file (its GGUF
loader dequantizes every tensor to float32; `--no-transformers` skips it), greedy on the same
prompt ids, the reference each mode's answers are counted against too, and so are llama.cpp's
llama-server's on the same file and prompt ids, where it is built
(benchmarks/llama_server.py). Chat prompts through the file's template, or plain text prompts
for a base model without one.

    python benchmarks/activation_rounding.py            # ~6 minutes on 2 cores
    python benchmarks/activation_rounding.py --file FILE.gguf   # Gemma 3 270M: ~8 minutes
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

MODES = {"float32": None, "16-bit": 32767, "8-bit (llama.cpp)": 127}


def rounded(x: torch.Tensor, levels: int | None) -> torch.Tensor:
    """x with each block of 32 along the last dim rounded to `levels` steps of max |x| / levels
    and scaled back (None: x as it is)."""
    if levels is None or x.shape[-1] % 32:
        return x
    blocks = x.reshape(-1, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / levels
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.where(scale > 0, torch.round(blocks / safe), torch.zeros_like(blocks))
    return (q * scale).reshape(x.shape)


def answers(levels: int | None, prompts: list[list[int]], loaded, max_tokens: int
            ) -> list[list[int]]:
    """Greedy answers with every matmul input rounded to `levels` (see `rounded`)."""
    from nbserve.models import attention, decoder, layers

    def lin(x, layer):  # noqa: ANN001, ANN202 -- holders.linear's signature
        return F.linear(rounded(x, levels), layer.weight, layer.bias)

    def normed(x, norm, layer):  # noqa: ANN001, ANN202
        return lin(norm(x), layer)

    def gated(gate_up, layer):  # noqa: ANN001, ANN202
        half = gate_up.shape[-1] // 2
        return lin(F.silu(gate_up[..., :half]) * gate_up[..., half:], layer)

    # where the model's modules call execution.holders' three functions
    patches = [(layers, "linear", lin), (layers, "normed_linear", normed),
               (layers, "gated_linear", gated), (attention, "linear", lin),
               (decoder, "normed_linear", normed)]
    saved = [(module, name, vars(module)[name]) for module, name, _ in patches]
    for module, name, fn in patches:
        setattr(module, name, fn)
    try:
        return greedy(loaded, prompts, max_tokens)
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)


def greedy(loaded, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:  # noqa: ANN001
    """Each prompt's greedy tokens, alone, through the engine as it serves the model."""
    from nbserve.engine import Engine
    from nbserve.types import Delta, Request, SamplingParams

    out = []
    with Engine(loaded, max_batch=1, max_context=512, quiet=True) as engine:
        for ids in prompts:
            got: list[int] = []
            for ev in engine.stream(Request(prompt_ids=ids, params=SamplingParams(
                    temperature=0.0, max_tokens=max_tokens, ignore_eos=True))):
                if isinstance(ev, Delta):
                    got += ev.token_ids
            out.append(got)
    return out


def transformers_greedy(path: Path, prompts: list[list[int]], max_tokens: int
                        ) -> list[list[int]]:
    """Each prompt's greedy tokens from `transformers` on the same GGUF (dequantized to
    float32 by its loader), alone, past any end of text, through its own KV cache."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32)
    model.eval()
    out = []
    with torch.inference_mode():
        for ids in prompts:
            step = model(torch.tensor([ids]), use_cache=True)
            got: list[int] = []
            for _ in range(max_tokens):
                token = int(step.logits[0, -1].argmax())
                got.append(token)
                step = model(torch.tensor([[token]]), past_key_values=step.past_key_values,
                             use_cache=True)
            out.append(got)
    return out


def llama_server_greedy(path: Path, prompts: list[list[int]], max_tokens: int
                        ) -> list[list[int]] | None:
    """Each prompt's greedy tokens from llama.cpp's llama-server on the same file (its own
    arithmetic: 8-bit activations everywhere), one at a time through /completion with the prompt
    as token ids, past any end of text; None where llama-server is not built."""
    import json
    import tempfile
    import urllib.request

    import llama_server
    from peers import PeerError, llama_server_spec, start_peer, stop_peer

    binary = llama_server.find()
    if binary is None:
        print("llama-server: not built (python benchmarks/llama_server.py --build); skipped")
        return None
    try:
        peer = start_peer(llama_server_spec(path, binary, parallel=1, context=4096), 300,
                          Path(tempfile.mkdtemp()))
    except PeerError as exc:
        print(f"llama-server: {exc}; skipped")
        return None
    out = []
    try:
        for ids in prompts:
            body = json.dumps({"prompt": ids, "n_predict": max_tokens, "temperature": 0.0,
                               "top_k": 1, "ignore_eos": True, "cache_prompt": False,
                               "return_tokens": True}).encode()
            request = urllib.request.Request(peer.base.removesuffix("/v1") + "/completion",
                                             body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=300) as answer:
                out.append(list(json.load(answer)["tokens"]))
    finally:
        stop_peer(peer)
    return out


def report(name: str, got: list[list[int]], reference: list[list[int]], what: str,
           max_tokens: int) -> None:
    first = [next((j for j, (a, b) in enumerate(zip(x, y)) if a != b), None)
             for x, y in zip(got, reference)]
    same = sum(f is None for f in first)
    print(f"{name}: {same} of {len(reference)} greedy answers ({max_tokens} tokens) identical "
          f"to {what}; first differing token: {[f for f in first if f is not None]}", flush=True)


# a base model's prompts: each form over every topic of engine_bench.TOPICS, then the next
PLAIN = ["Here is a short paragraph about {}, with one surprising fact that most people do not "
         "know:", "Question: What is the most important thing to understand about {}?\nAnswer:"]
# a mode's name: (NBSERVE_ROUND16, NBSERVE_ROUND8, what it is)
FILE_MODES = {
    "exact": ("0", "0", "exact float32 arithmetic (weights='blocks', exact=True)"),
    "16-bit": ("1", "0", "16-bit inputs (NBSERVE_ROUND8=0)"),
    "decode": ("1", "decode", "8-bit inputs for Q4_K and Q6_K in decode steps, prompts at 16 bits "
                              "(NBSERVE_ROUND8=decode)"),
    "default": ("1", "1", "8-bit inputs for Q4_K and Q6_K in decode steps and in prompt chunks "
                          "past 8 rows, per 32 (the default)"),
    "all": ("1", "all", "8-bit inputs for Q4_K and Q6_K in every prompt chunk too "
                        "(NBSERVE_ROUND8=all)"),
}


def file_modes(path: Path, n_prompts: int, max_tokens: int, with_transformers: bool = True
               ) -> None:
    """The real kernels on a quantized GGUF: exact against 16-bit and 8-bit inputs (see the
    docstring)."""
    from engine_bench import TOPICS, chat_prompts

    import nbserve

    results, rates = {}, {}
    for mode, (round16, round8, _) in FILE_MODES.items():
        os.environ["NBSERVE_ROUND16"] = round16  # read when the kernels are made, at load
        os.environ["NBSERVE_ROUND8"] = round8
        loaded = nbserve.load(str(path), weights="blocks", exact=mode == "exact", verbose=False)
        if loaded.template is not None:
            prompts = chat_prompts(loaded.tokenizer, loaded.template, n_prompts)
        else:  # a base model: plain text
            prompts = [loaded.tokenizer.encode(PLAIN[i // len(TOPICS) % len(PLAIN)].format(
                TOPICS[i % len(TOPICS)])) for i in range(n_prompts)]
        start = time.perf_counter()
        results[mode] = greedy(loaded, prompts, max_tokens)
        rates[mode] = len(prompts) * max_tokens / (time.perf_counter() - start)
        del loaded
    print(f"{path.name}: served from its blocks, one stream (prefills included, load average "
          f"{os.getloadavg()[0]:.1f}), tok/s: "
          + ", ".join(f"{mode} {rate:.1f}" for mode, rate in rates.items()), flush=True)
    for mode, (_, _, name) in FILE_MODES.items():
        if mode != "exact":
            report(name, results[mode], results["exact"], FILE_MODES["exact"][2], max_tokens)
    if not with_transformers:
        return
    reference = transformers_greedy(path, prompts, max_tokens)
    what = "transformers' on the same file (float32)"
    for mode, (_, _, name) in FILE_MODES.items():
        report(name, results[mode], reference, what, max_tokens)
    theirs = llama_server_greedy(path, prompts, max_tokens)
    if theirs is not None:
        report("llama-server", theirs, reference, what, max_tokens)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--file", type=Path, default=None,
                    help="a quantized GGUF: its real kernels, exact against 16- and 8-bit inputs")
    ap.add_argument("--no-transformers", action="store_true",
                    help="with --file: skip transformers' answers on the same file")
    args = ap.parse_args(argv)
    if args.file is not None:
        file_modes(args.file.expanduser(), args.prompts, args.max_tokens,
                   not args.no_transformers)
        return
    from engine_bench import chat_prompts

    import nbserve

    loaded = nbserve.load("smollm2", dtype="float32", verbose=False)
    model = loaded.model
    from nbserve.execution.formats import Float32Form

    for holder in model._weight_holders():  # plain float32 matmuls, nothing in the C kernel
        form = holder.form
        packed = form.packed if isinstance(form, Float32Form) else None
        holder.form = Float32Form(holder.weight, holder.bias, packed)
    model._head_t = None  # the LM head through the rounded path too
    prompts = chat_prompts(loaded.tokenizer, loaded.template, args.prompts)
    results = {name: answers(levels, prompts, loaded, args.max_tokens)
               for name, levels in MODES.items()}
    reference = results["float32"]
    for name, got in results.items():
        if name == "float32":
            continue
        first = [next((j for j, (a, b) in enumerate(zip(x, y)) if a != b), None)
                 for x, y in zip(got, reference)]
        same = sum(f is None for f in first)
        print(f"{name} activations: {same} of {len(prompts)} greedy answers ({args.max_tokens} "
              f"tokens) identical to float32's; first differing token: "
              f"{[f for f in first if f is not None]}", flush=True)


if __name__ == "__main__":
    main()
