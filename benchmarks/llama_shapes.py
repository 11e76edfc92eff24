"""Llama-shaped random-weight GGUFs at the sizes people run (about 1.5B and 8B parameters), with
the default model's tokenizer and chat template, quantized by llama.cpp's own `llama-quantize`
(issue 42 item 4): the files serve_bench.py runs nbserve and llama-server on.

    python benchmarks/llama_shapes.py                 # 1.5B: F16, then Q4_K_M and Q6_K
    python benchmarks/llama_shapes.py --size 8b       # 8B: F16 (about 14.5 GB), then Q4_K_M
    python benchmarks/llama_shapes.py --size 8b --drop-f16   # delete the F16 once quantized

Shapes: 1.5b is hidden 1536, 28 layers, 12 heads, 2 KV heads, FFN 8960; 8b is hidden 4096,
32 layers, 32 heads, 8 KV heads, FFN 14336; both with SmolLM2's vocabulary (49152) and a tied
LM head. Every `tokenizer.*` key is copied from the default model's GGUF (found through
nbserve.loading.default), so prompts tokenize and chat as with the default model. Weights are
random normal with standard deviation 1/sqrt(row length), which keeps each matmul's output at
its input's scale, so activations stay finite through every layer; they are written tensor by
tensor (never the whole model in memory). Every file row length is a multiple of 256, so
llama-quantize makes real K-quant blocks (no fallback to Q5_0/Q8_0).

Files are cached under `$NBSERVE_BENCH_CACHE/shapes` (default ~/.cache/nbserve-bench/shapes),
outside the repository; an existing file is kept. llama-quantize comes from llama_server.py's
build (`python benchmarks/llama_server.py --build`). The paths are printed, one a line.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gguf
import numpy as np
from llama_server import cache_root, find_quantize

from nbserve.loading.default import default_model_path


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    quants: tuple[str, ...]  # llama-quantize types to make of the F16 file


SHAPES = {
    "1.5b": Shape(1536, 28, 12, 2, 8960, ("Q4_K_M", "Q6_K")),
    "8b": Shape(4096, 32, 32, 8, 14336, ("Q4_K_M",)),
}
CONTEXT = 32768
ROPE_THETA = 500000.0
SEED = 42


def shapes_dir() -> Path:
    return cache_root() / "shapes"


def tensors(shape: Shape, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """(GGUF name, numpy shape (rows, row length)) of every tensor, in llama.cpp's order."""
    kv = shape.hidden // shape.heads * shape.kv_heads
    h, f = shape.hidden, shape.ffn
    out: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (vocab, h))]
    for i in range(shape.layers):
        out += [(f"blk.{i}.attn_norm.weight", (h,)), (f"blk.{i}.attn_q.weight", (h, h)),
                (f"blk.{i}.attn_k.weight", (kv, h)), (f"blk.{i}.attn_v.weight", (kv, h)),
                (f"blk.{i}.attn_output.weight", (h, h)), (f"blk.{i}.ffn_norm.weight", (h,)),
                (f"blk.{i}.ffn_gate.weight", (f, h)), (f"blk.{i}.ffn_up.weight", (f, h)),
                (f"blk.{i}.ffn_down.weight", (h, f))]
    out.append(("output_norm.weight", (h,)))
    return out


def copy_tokenizer(writer: gguf.GGUFWriter, source: Path) -> int:
    """Copy every `tokenizer.*` key of `source` into `writer`; return the vocabulary size."""
    reader = gguf.GGUFReader(source)
    vocab = 0
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, vtype, sub_type=sub)
        if key == "tokenizer.ggml.tokens":
            vocab = len(value)
    if not vocab:
        raise ValueError(f"{source} has no tokenizer.ggml.tokens")
    return vocab


def write_f16(size: str, out: Path) -> Path:
    """Write the F16 file of `size`, one tensor at a time; return its path."""
    shape = SHAPES[size]
    tmp = out.with_suffix(".part")
    writer = gguf.GGUFWriter(tmp, "llama")
    writer.add_name(f"llama-shaped-{size}-random")
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(ROPE_THETA)
    writer.add_rope_dimension_count(shape.hidden // shape.heads)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    vocab = copy_tokenizer(writer, default_model_path())
    writer.add_vocab_size(vocab)
    plan = tensors(shape, vocab)
    for name, dims in plan:
        dtype = np.float32 if len(dims) == 1 else np.float16  # norms stay F32, as converted
        nbytes = int(np.prod(dims)) * np.dtype(dtype).itemsize
        writer.add_tensor_info(name, dims, np.dtype(dtype), nbytes)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(SEED)
    t0 = time.perf_counter()
    for n, (_, dims) in enumerate(plan):
        if len(dims) == 1:
            arr = np.ones(dims, dtype=np.float32)
        else:
            arr = rng.standard_normal(dims, dtype=np.float32)
            arr *= 1.0 / np.sqrt(dims[-1])
            arr = arr.astype(np.float16)
        writer.write_tensor_data(arr)
        if n % 40 == 0:
            print(f"  {out.name}: {n + 1}/{len(plan)} tensors, {time.perf_counter() - t0:.0f} s",
                  file=sys.stderr, flush=True)
    writer.close()
    tmp.rename(out)
    return out


def quantize(f16: Path, kind: str, out: Path, threads: int) -> Path:
    """`llama-quantize F16 OUT KIND THREADS` into a temporary name, then renamed."""
    tool = find_quantize()
    if tool is None:
        raise RuntimeError("llama-quantize is not built: python benchmarks/llama_server.py "
                           "--build (it builds beside llama-server)")
    tmp = out.with_suffix(".part")
    subprocess.run([str(tool), str(f16), str(tmp), kind, str(threads)], check=True,
                   stdout=subprocess.DEVNULL)
    tmp.rename(out)
    return out


def make(size: str, threads: int, drop_f16: bool = False) -> list[Path]:
    """The quantized files of `size` (and the F16 one, unless dropped), made where missing."""
    root = shapes_dir()
    root.mkdir(parents=True, exist_ok=True)
    f16 = root / f"llama-{size}-F16.gguf"
    made: list[Path] = []
    wanted = [root / f"llama-{size}-{kind}.gguf" for kind in SHAPES[size].quants]
    if not f16.is_file() and any(not w.is_file() for w in wanted):
        print(f"writing {f16}", file=sys.stderr, flush=True)
        write_f16(size, f16)
    for kind, out in zip(SHAPES[size].quants, wanted):
        if not out.is_file():
            t0 = time.perf_counter()
            quantize(f16, kind, out, threads)
            print(f"  {out.name}: quantized in {time.perf_counter() - t0:.0f} s",
                  file=sys.stderr, flush=True)
        made.append(out)
    if drop_f16 and f16.is_file():
        f16.unlink()
    elif f16.is_file():
        made.insert(0, f16)
    return made


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=sorted(SHAPES), action="append",
                   help="1.5b (default) and/or 8b")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="llama-quantize's threads")
    p.add_argument("--drop-f16", action="store_true", help="delete the F16 file once quantized")
    args = p.parse_args()
    for size in args.size or ["1.5b"]:
        for path in make(size, args.threads, args.drop_f16):
            print(path, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
