"""What rounding the matmul inputs to integers per 32-value block would do to the default
model's greedy answers: the arithmetic of llama.cpp's CPU kernels (8-bit activations, Q8_0/Q8_1
style: scale = max |x| / 127 per block) and of a 16-bit variant (max |x| / 32767), against the
float32 activations nbserve's quantized kernels use.

The model runs in float32 on the GGUF's dequantized weights, through plain F.linear, with the
input of every matmul (after its norm, or silu(gate) * up) rounded and scaled back first; so
only the activations' rounding differs between the modes. 20 chat prompts, each alone, 64
greedy tokens past end-of-text: how many answers stay identical to the unrounded run, and where
the others first differ. Asserts nothing.

    python benchmarks/activation_rounding.py            # ~6 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import sys
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
    from nbserve.engine import Engine
    from nbserve.models import llama
    from nbserve.types import Request, SamplingParams

    def lin(x, layer):  # noqa: ANN001, ANN202 -- llama.linear's signature
        return F.linear(rounded(x, levels), layer.weight, layer.bias)

    def normed(x, norm, layer):  # noqa: ANN001, ANN202
        return lin(norm(x), layer)

    def gated(gate_up, layer):  # noqa: ANN001, ANN202
        half = gate_up.shape[-1] // 2
        return lin(F.silu(gate_up[..., :half]) * gate_up[..., half:], layer)

    saved = llama.linear, llama.normed_linear, llama.gated_linear
    llama.linear, llama.normed_linear, llama.gated_linear = lin, normed, gated
    try:
        out = []
        with Engine(loaded, max_batch=1, max_context=512, quiet=True) as engine:
            for ids in prompts:
                got: list[int] = []
                for ev in engine.stream(Request(prompt_ids=ids, params=SamplingParams(
                        temperature=0.0, max_tokens=max_tokens, ignore_eos=True))):
                    got += getattr(ev, "token_ids", [])
                out.append(got)
        return out
    finally:
        llama.linear, llama.normed_linear, llama.gated_linear = saved


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args(argv)
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
