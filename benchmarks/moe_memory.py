"""Resident memory of a quantized mixture-of-experts GGUF served on CPU (issue 42 item 1).

Writes a random-weight Mixtral-shaped file laid out as llama.cpp's Q4_K_M lays one out (Q4_K
q/k/o and expert gate/up stacks, Q6_K v and expert down stacks, Q6_K embedding, F32 norms and
routers), then loads it with `nbserve.load` in a child process and prints the child's resident
memory once torch and nbserve are imported, its peak during the load (VmHWM), what stays
resident after the load, the weight bytes nbserve reports, and one-stream decode tokens/s.
Run it from two checkouts (same `--file`) to compare loaders.

    python benchmarks/moe_memory.py                  # writes /tmp/moe-q4_k_m.gguf (~170 MB)
    python benchmarks/moe_memory.py --file F.gguf    # an existing file
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

MiB = 2**20

CHILD = """
import sys, time
import torch, nbserve
from nbserve.execution.weights import count_parameters
def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))
before = status("VmRSS:")
loaded = nbserve.load(sys.argv[1], verbose=False)
model = loaded.model
peak, after = status("VmHWM:"), status("VmRSS:")
cache = model.make_cache(1, 128)
ids = torch.tensor([[1, 2, 3, 4]])
model.forward(ids, torch.arange(4)[None], torch.tensor([0]), cache)
t0, n = time.perf_counter(), 32
for i in range(n):
    model.forward(torch.tensor([[5]]), torch.tensor([[4 + i]]), torch.tensor([0]), cache,
                  contiguous_from=0)
tps = n / (time.perf_counter() - t0)
print("FORMAT", model.weight_format)
print("WEIGHT_BYTES", count_parameters(model)[1])
print("BEFORE", before)
print("PEAK", peak)
print("AFTER", after)
print("TPS", f"{tps:.1f}")
"""


def write_moe_file(path: Path, layers: int, hidden: int, ffn: int, experts: int,
                   vocab: int) -> Path:
    """A Mixtral GGUF (architecture llama with an expert count) of random valid K-quant
    blocks, written tensor by tensor."""
    from gguf import GGMLQuantizationType as QType
    from gguf_util import llama_writer, random_blocks

    heads, kv_heads = 16, 4
    rng = np.random.default_rng(0)
    writer = llama_writer(path, "random-moe-q4_k_m", layers, hidden, ffn, heads, kv_heads, vocab)
    writer.add_expert_count(experts)
    writer.add_expert_used_count(2)
    kv = hidden // heads * kv_heads
    shapes = [("token_embd.weight", (vocab, hidden), "Q6_K"),
              ("output_norm.weight", (hidden,), "F32")]
    for i in range(layers):
        shapes += [(f"blk.{i}.attn_norm.weight", (hidden,), "F32"),
                   (f"blk.{i}.attn_q.weight", (hidden, hidden), "Q4_K"),
                   (f"blk.{i}.attn_k.weight", (kv, hidden), "Q4_K"),
                   (f"blk.{i}.attn_v.weight", (kv, hidden), "Q6_K"),
                   (f"blk.{i}.attn_output.weight", (hidden, hidden), "Q4_K"),
                   (f"blk.{i}.ffn_norm.weight", (hidden,), "F32"),
                   (f"blk.{i}.ffn_gate_inp.weight", (experts, hidden), "F32"),
                   (f"blk.{i}.ffn_gate_exps.weight", (experts, ffn, hidden), "Q4_K"),
                   (f"blk.{i}.ffn_up_exps.weight", (experts, ffn, hidden), "Q4_K"),
                   (f"blk.{i}.ffn_down_exps.weight", (experts, hidden, ffn), "Q6_K")]
    for name, shape, kind in shapes:
        if kind == "F32":
            writer.add_tensor(name, rng.normal(0, 0.02, shape).astype(np.float32)
                              if len(shape) > 1 else np.ones(shape, np.float32))
        else:
            writer.add_tensor(name, random_blocks(shape, kind, rng), raw_dtype=QType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--file", type=Path, default=Path("/tmp/moe-q4_k_m.gguf"))
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args()
    if not args.file.exists():
        write_moe_file(args.file, args.layers, args.hidden, args.ffn, args.experts, args.vocab)
    out = subprocess.run([sys.executable, "-c", CHILD, str(args.file)], capture_output=True,
                         text=True, check=True, cwd=ROOT, timeout=1800)
    got = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
    before = int(got["BEFORE"])
    print(f"file {os.path.getsize(args.file) / MiB:.0f} MiB, served as {got['FORMAT']}, "
          f"weight bytes {int(got['WEIGHT_BYTES']) / MiB:.0f} MiB")
    print(f"resident over the imports: load peak {(int(got['PEAK']) - before) / MiB:.0f} MiB, "
          f"after the load {(int(got['AFTER']) - before) / MiB:.0f} MiB; "
          f"one-stream decode {got['TPS']} tok/s")


if __name__ == "__main__":
    main()
