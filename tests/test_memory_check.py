"""A model that cannot fit is refused before anything is allocated (issue 42 item 2).

The large checkpoints here are Llama-8B-shaped (deeper where the machine has more RAM, so that
their float32 weights never fit): their headers are real, their tensor data a sparse hole, so
the files take almost nothing on disk. Each load runs in a child process watched from here:
it is killed if its resident memory passes a few GiB (what the load would do without the
check, until the machine ran out).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from gguf_util import llama_writer, q4_k_m_llama_tensors

from nbserve.loading import load
from nbserve.loading.memory_check import (
    StoredTensor,
    WeightForm,
    gguf_tensors,
    safetensors_tensors,
    weight_bytes,
)

ROOT = Path(__file__).resolve().parents[1]
GiB = 2**30
HIDDEN, FFN, HEADS, KV_HEADS, VOCAB = 4096, 14336, 32, 8, 49152  # Llama 3 8B's shape
RSS_CEILING = 3 * GiB  # a child above this is killed: the check did not stop the load
REFUSED = "does not fit: its weights need about"


def _mem_total() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _layers(bytes_per_weight: float = 4) -> int:
    """32 (an 8B) or more: enough that the weights, at `bytes_per_weight` (float32's 4, or
    about 0.6 for a Q4_K_M file served from its blocks), exceed 1.25x this machine's RAM."""
    per_layer = bytes_per_weight * (2 * HIDDEN * HIDDEN + 2 * HIDDEN * HIDDEN // HEADS
                                    * KV_HEADS + 3 * HIDDEN * FFN)
    return max(32, math.ceil(1.25 * _mem_total() / per_layer))


def write_sparse_llama_gguf(path: Path, layers: int) -> Path:
    """A Llama GGUF with real metadata (hyperparameters, a 49152-token vocabulary) and tensor
    infos, whose tensor data is a hole: the file's size is the model's, its blocks on disk
    almost none."""
    writer = llama_writer(path, "sparse-llama", layers, HIDDEN, FFN, HEADS, KV_HEADS, VOCAB,
                          context=8192, rope_base=500000.0)
    total = 0
    for name, shape, kind in q4_k_m_llama_tensors(layers, HIDDEN, FFN, HEADS, KV_HEADS, VOCAB,
                                                  embedding="Q4_K", head="Q6_K"):
        qtype = QType[kind]
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        row_bytes = shape[-1] // block * size
        nbytes = row_bytes * (shape[0] if len(shape) == 2 else 1)
        if kind == "F32":
            writer.add_tensor_info(name, shape, np.dtype(np.float32), nbytes)
        else:
            writer.add_tensor_info(name, (*shape[:-1], row_bytes), np.dtype(np.uint8), nbytes,
                                   raw_dtype=qtype)
        total += -(-nbytes // 32) * 32  # each tensor's data aligned to 32 bytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    start = -(-path.stat().st_size // 32) * 32
    os.truncate(path, start + total)  # the hole: never written
    return path


def write_sparse_llama_dir(root: Path, layers: int, tokenizer_from: Path) -> Path:
    """A Hugging Face Llama directory (config, the tiny model's tokenizer files, a bfloat16
    model.safetensors with a real header) whose tensor data is a hole."""
    root.mkdir(parents=True, exist_ok=True)
    kv = HIDDEN // HEADS * KV_HEADS
    (root / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": FFN, "num_hidden_layers": layers, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "vocab_size": VOCAB, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "max_position_embeddings": 8192, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16"}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / name, root / name)
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,),
              "lm_head.weight": (VOCAB, HIDDEN)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (HIDDEN,),
                       p + "self_attn.q_proj.weight": (HIDDEN, HIDDEN),
                       p + "self_attn.k_proj.weight": (kv, HIDDEN),
                       p + "self_attn.v_proj.weight": (kv, HIDDEN),
                       p + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
                       p + "post_attention_layernorm.weight": (HIDDEN,),
                       p + "mlp.gate_proj.weight": (FFN, HIDDEN),
                       p + "mlp.up_proj.weight": (FFN, HIDDEN),
                       p + "mlp.down_proj.weight": (HIDDEN, FFN)})
    header: dict[str, object] = {}
    offset = 0
    for name, shape in shapes.items():
        nbytes = 2 * math.prod(shape)
        header[name] = {"dtype": "BF16", "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    file = root / "model.safetensors"
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
    os.truncate(file, 8 + len(text) + offset)
    return root


@pytest.fixture(scope="module")
def big_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # served from its blocks, a Q4_K_M file takes about its size: deep enough not to fit
    return write_sparse_llama_gguf(tmp_path_factory.mktemp("big") / "llama-8b-Q4_K_M.gguf",
                                   _layers(0.55))


@pytest.fixture(scope="module")
def big_hf_dir(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> Path:
    return write_sparse_llama_dir(tmp_path_factory.mktemp("big") / "llama-8b", _layers(),
                                  tiny_llama_dir)


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run_watched(args: list[str], timeout: float = 300) -> tuple[int, str, int]:
    """Run a child process; kill it if its resident memory passes RSS_CEILING (or it outlives
    `timeout`: a hang). Returns (exit code, its output, its largest RSS seen)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    peak, deadline = 0, time.monotonic() + timeout
    try:
        while proc.poll() is None:
            peak = max(peak, _rss(proc.pid))
            if peak > RSS_CEILING or time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                why = f"grew to {peak / GiB:.1f} GiB resident" if peak > RSS_CEILING \
                    else f"ran past {timeout:.0f} s"
                printed = proc.stdout.read()[-3000:] if proc.stdout else ""
                shown = " ".join(a for a in args[1:] if "\n" not in a)
                pytest.fail(f"{shown}: the load {why} instead of being "
                            f"refused; it printed:\n{printed}")
            time.sleep(0.02)
        out = proc.stdout.read() if proc.stdout else ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, out, peak


# The child measures its own growth: resident memory before the call (imports done) against
# the process's peak after it.
CHILD = """
import os, sys
import nbserve, nbserve.loading, nbserve.serving.launch, nbserve.serving.app
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
before = rss()
try:
    if sys.argv[1] == "launch":
        nbserve.launch(sys.argv[2], port=None, ui=False)
    elif sys.argv[1] == "hub":  # a hub id whose download is the directory (no network here)
        import huggingface_hub
        huggingface_hub.snapshot_download = lambda repo_id, **kw: sys.argv[2]
        nbserve.loading.load("org/llama-8b", device="cpu", verbose=False)
    else:
        nbserve.loading.load(sys.argv[2], device="cpu", verbose=False)
    print("LOADED")
except Exception as exc:
    print("REFUSED", type(exc).__name__, exc)
with open("/proc/self/status") as f:  # VmHWM: this process's own peak. ru_maxrss would
    # count the parent's resident memory too: the spawn (vfork) borrowed pytest's pages
    peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
print("GROWTH", peak - before)
"""


@pytest.mark.slow  # a child process each, importing nbserve (and the server)
@pytest.mark.parametrize("how", ["load", "launch"])
@pytest.mark.parametrize("which", ["gguf", "hf_dir"])
def test_a_model_too_large_is_refused_before_its_memory_grows(how, which, request):
    """`nbserve.launch(path)` and the loader refuse an 8B-shaped Q4_K_M GGUF (or a bfloat16
    checkpoint directory) whose float32 weights cannot fit, naming the GiB needed and
    available and what to do, with the process's memory unchanged: nothing was read."""
    path = request.getfixturevalue("big_gguf" if which == "gguf" else "big_hf_dir")
    code, out, _ = run_watched([sys.executable, "-c", CHILD, how, str(path)])
    assert code == 0, out[-3000:]
    refused = [line for line in out.splitlines() if line.startswith("REFUSED")]
    assert refused, f"the load was not refused:\n{out[-3000:]}"
    line = refused[0]
    assert "ModelTooLargeError" in line and REFUSED in line, line
    assert "GiB is available" in line and "fewer parameters" in line, line
    assert "more memory" in line, line
    assert ("the file's own blocks" in line) if which == "gguf" else \
        ("dtype='bfloat16'" in line), line  # a quantized GGUF: served from its blocks
    growth = int(out.split("GROWTH")[1].split()[0])
    assert growth < 512 * 2**20, f"resident memory grew by {growth / 2**20:.0f} MiB: {line}"


@pytest.mark.slow
def test_a_hub_model_too_large_is_refused_once_downloaded(big_hf_dir):
    """A hub id: refused after the download (the files are there), before a tensor is read."""
    code, out, _ = run_watched([sys.executable, "-c", CHILD, "hub", str(big_hf_dir)])
    assert code == 0 and "ModelTooLargeError" in out and REFUSED in out, out[-3000:]
    assert int(out.split("GROWTH")[1].split()[0]) < 512 * 2**20


@pytest.mark.slow
@pytest.mark.parametrize("cli", ["nbserve serve", "app.py --model"])
def test_the_cli_refuses_a_model_too_large_with_the_message(cli, big_gguf):
    """`nbserve serve FILE` and `python app.py --model FILE` exit with the message and a
    non-zero code instead of loading until the machine runs out."""
    args = [sys.executable, "-m", "nbserve", "serve", str(big_gguf)] if cli == "nbserve serve" \
        else [sys.executable, str(ROOT / "app.py"), "--model", str(big_gguf)]
    code, out, _ = run_watched(args + ["--port", "0", "--no-ui"])
    assert code != 0, out[-3000:]
    assert f"nbserve: error: {big_gguf} {REFUSED}" in out, out[-3000:]
    assert "GiB is available" in out


def test_the_estimate_is_what_the_loader_builds(tiny_llama_dir, tmp_path):
    """weight_bytes follows the loader: a tiny GGUF's dense float32 weights are its
    parameters at 4 bytes, plus the copies for speed that a float32 load adds, and
    weights="blocks" adds exactly the Q8_0 blocks it makes."""
    from gguf_util import hf_dir_to_gguf

    path = hf_dir_to_gguf(tiny_llama_dir, tmp_path / "tiny.gguf", "F32")
    tensors = gguf_tensors(path)
    largest = max(t.numel for t in tensors) * 4
    dense = weight_bytes(tensors, WeightForm(torch.float32)) - largest
    loaded = load(str(path), device="cpu", dtype="float32", verbose=False).model
    assert dense == 4 * sum(p.numel() for p in loaded.parameters())
    speed = weight_bytes(tensors, WeightForm(torch.float32, "none", True)) - largest - dense
    assert speed > 0 and speed == loaded.derived_bytes()  # packed copies (or a head's)
    quantized = load(str(path), device="cpu", weights="blocks", exact=True, verbose=False).model
    blocks = weight_bytes(tensors, WeightForm(torch.float32, "blocks")) - largest - dense
    assert blocks == quantized.derived_bytes()


def test_safetensors_headers_are_read_without_the_data(big_hf_dir):
    tensors = safetensors_tensors([big_hf_dir / "model.safetensors"])
    head = next(t for t in tensors if t.name == "lm_head.weight")
    assert head == StoredTensor("lm_head.weight", (VOCAB, HIDDEN), "BF16", 2 * VOCAB * HIDDEN)
    assert sum(t.numel for t in tensors) > 7e9


def test_a_small_file_still_loads_and_answers(tiny_llama_dir, tmp_path):
    from gguf_util import hf_dir_to_gguf

    path = hf_dir_to_gguf(tiny_llama_dir, tmp_path / "tiny-q8.gguf", "Q8_0")
    loaded = load(str(path), device="cpu", verbose=False)
    assert loaded.name == "tiny-q8"
