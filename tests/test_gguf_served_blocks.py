"""A quantized GGUF on CPU is served from its blocks by default, read as blocks and never built
in float32 (issue 42 items 2 and 3): its matmul weights and embedding stay on meta, the load's
peak resident memory stays near the file's size, greedy answers and logits over HTTP are the
float32 load's, and /stats reports the weight bytes as served."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from gguf_util import hf_dir_to_gguf, llama_writer, q4_k_m_llama_tensors, random_blocks
from kernel_paths import NEEDS_COMPILER
from server_util import greedy_completion
from test_gguf_families import CASES, make_case_dir
from test_quantized import _lone_steps
from tiny_models import make_tiny_hf_dir

import nbserve
from nbserve.execution.formats import BlockForm, PartsForm
from nbserve.execution.weights import count_parameters
from nbserve.models.dtypes import load_kwargs

pytestmark = NEEDS_COMPILER
K_DIMS = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
          "num_key_value_heads": 2}  # rows of whole K-quant blocks (256 weights)
MiB = 2**20


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * want.abs().max().item())


def test_a_quantized_gguf_is_served_from_its_blocks_by_default(tmp_path):
    hf = make_tiny_hf_dir(tmp_path / "hf", "llama", **K_DIMS)
    path = hf_dir_to_gguf(hf, tmp_path / "m.gguf", "Q4_K")
    model = nbserve.load(str(path), verbose=False).model  # no dtype: the file's blocks
    assert model.weight_format == "quantized"
    for holder, names in model._named_holders():
        assert isinstance(holder.form, BlockForm), names
        assert holder.weight.device.type == "meta", names  # never built in float32
    assert model.embedding_weight().device.type == "meta"  # looked up in its blocks
    assert model.default_kv_dtype == torch.float16
    full = nbserve.load(str(path), dtype="float32", verbose=False).model  # when asked
    assert full.weight_format == "float32" and not full.dense_released
    assert all(p.device.type == "cpu" for p in full.parameters())
    exact = nbserve.load(str(path), weights="blocks", exact=True, verbose=False).model
    assert exact.weight_format == "quantized-exact" and exact.dense_released
    for got, want in zip(_lone_steps(exact, [3, 17, 5, 9, 11, 2] * 3),
                         _lone_steps(full, [3, 17, 5, 9, 11, 2] * 3)):
        _close(got, want)
    assert count_parameters(model)[1] < os.path.getsize(path)  # the blocks, no float copy


def test_fused_parts_of_different_types_are_served_as_they_are(tmp_path):
    """Gemma 3's files fuse Q5_0 q and k with a Q8_0 v: each part's kernel gives its slice
    (no Q8_0 made from float32); the same logits as the float32 load."""
    hf = make_tiny_hf_dir(tmp_path / "hf", "llama")
    path = hf_dir_to_gguf(hf, tmp_path / "m.gguf", "Q5_0",
                          tensor_types={f"blk.{i}.attn_v.weight": "Q8_0" for i in range(2)})
    model = nbserve.load(str(path), weights="blocks", exact=True, verbose=False).model
    qkv = model.model.layers[0].self_attn.qkv
    assert isinstance(qkv.form, PartsForm) and qkv.weight.device.type == "meta"
    assert [p.blocks.kind for p in qkv.form.parts] == ["ggml:Q5_0", "ggml:Q5_0", "q8"]
    full = nbserve.load(str(path), dtype="float32", verbose=False).model
    ids = [3, 17, 5, 9, 11, 2] * 3
    for got, want in zip(_lone_steps(model, ids), _lone_steps(full, ids)):
        _close(got, want)
    model.restore_dense_weights()  # read back out of the parts: the file's values
    assert torch.equal(model.model.layers[0].self_attn.qkv.weight,
                       full.model.layers[0].self_attn.qkv.weight)


def test_greedy_answers_over_http_equal_the_float32_load(tmp_path):
    """Served from its K-quant blocks (exact arithmetic) a model answers as its float32 load,
    token for token, with the same logprobs up to rounding; /stats reports each one's weight
    bytes as served."""
    hf = make_tiny_hf_dir(tmp_path / "hf", "llama", **K_DIMS)
    path = hf_dir_to_gguf(hf, tmp_path / "m.gguf", "Q6_K")
    answers, stats = {}, {}
    for dtype in ("quantized-exact", "float32"):
        loaded = nbserve.load(str(path), verbose=False, **load_kwargs(dtype))
        answers[dtype], stats[dtype] = greedy_completion(loaded)
        model = loaded.model
        assert stats[dtype]["weight_bytes"] == count_parameters(model)[1]
        assert stats[dtype]["weight_format"] == dtype
    blocks, full = answers["quantized-exact"], answers["float32"]
    assert blocks["logprobs"]["tokens"] == full["logprobs"]["tokens"]
    assert blocks["text"] == full["text"]
    np.testing.assert_allclose(blocks["logprobs"]["token_logprobs"],
                               full["logprobs"]["token_logprobs"], atol=1e-3)
    assert stats["quantized-exact"]["weight_bytes"] < stats["float32"]["weight_bytes"] / 4


# ----------------------------------------------------------------------------- the load's peak

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS, VOCAB = 1024, 4096, 16, 4, 32, 32000


def write_random_kquant_llama(path, layers: int = LAYERS):
    """A Llama GGUF of about 340 MB with real data: random valid K-quant blocks laid out as a
    Q4_K_M file (Q4_K q/k/o/gate/up, Q6_K v/down and the tied embedding, F32 norms), written
    with gguf's writer tensor by tensor."""
    rng = np.random.default_rng(0)
    writer = llama_writer(path, "random-kquant-llama", layers, HIDDEN, FFN, HEADS, KV_HEADS,
                          VOCAB)
    shapes = q4_k_m_llama_tensors(layers, HIDDEN, FFN, HEADS, KV_HEADS, VOCAB)
    for name, shape, kind in shapes:
        if kind == "F32":
            writer.add_tensor(name, np.ones(shape, np.float32))
        else:
            writer.add_tensor(name, random_blocks(shape, kind, rng), raw_dtype=QType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# The child reports its resident memory after its imports and its peak (VmHWM) after the load.
CHILD = """
import sys
import torch, nbserve, nbserve.loading
def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))
before = status("VmRSS:")
if sys.argv[1] != "-":
    model = nbserve.loading.load(sys.argv[1], device="cpu", verbose=False).model
    print("FORMAT", model.weight_format)
print("BEFORE", before)
print("PEAK", status("VmHWM:"))
"""


def _child(arg: str) -> dict[str, str]:
    out = subprocess.run([sys.executable, "-c", CHILD, arg], capture_output=True, text=True,
                         timeout=600, check=True)
    return dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)


@pytest.mark.slow  # writes a 340 MB file and loads it in a child process
def test_a_quantized_load_peaks_near_the_file_size(tmp_path):
    """The loading process's peak resident memory is at most the file's size + 15%, over what
    it holds once torch and nbserve are imported (about 250 MiB here, measured by the child
    itself), plus 48 MiB for the tokenizer, the kernels' library and the parsed header.
    Before, the weights were dequantized to float32 first: about 1.9 GB for this file."""
    path = write_random_kquant_llama(tmp_path / "random-q4_k_m.gguf")
    size = os.path.getsize(path)
    assert size > 300 * MiB
    bare = _child("-")  # what a bare import costs: the allowance for torch itself
    assert int(bare["PEAK"]) < 600 * MiB, bare
    report = _child(str(path))
    assert report["FORMAT"] == "quantized"
    growth = int(report["PEAK"]) - int(report["BEFORE"])
    assert growth <= size * 1.15 + 48 * MiB, \
        f"load peak {growth / MiB:.0f} MiB over the imports, file {size / MiB:.0f} MiB"


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_a_large_tensor_read_in_chunks_gives_the_same_blocks(tmp_path, monkeypatch, qtype):
    """A tensor larger than a chunk (the real Gemma 3's 178 MB Q8_0 embedding) is read and
    converted chunk by chunk into its blocks: the same blocks as read whole."""
    hf = make_tiny_hf_dir(tmp_path / "hf", "llama", **K_DIMS)
    path = hf_dir_to_gguf(hf, tmp_path / "m.gguf", qtype)
    whole = nbserve.load(str(path), weights="blocks", exact=True, verbose=False).model
    monkeypatch.setattr("nbserve.loading.gguf.CHUNK_BYTES", 1000)  # a few rows a chunk
    chunked = nbserve.load(str(path), weights="blocks", exact=True, verbose=False).model
    assert torch.equal(chunked._embedding_blocks.dequantize(),
                       whole._embedding_blocks.dequantize())
    for (a, names), (b, _) in zip(chunked._named_holders(), whole._named_holders()):
        assert torch.equal(a.form.dense(), b.form.dense()), names


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("families")
    return {case: make_case_dir(case, root / case) for case in CASES}


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_family_served_from_its_blocks_computes_its_float32_load(family_dirs, tmp_path,
                                                                       case):
    """Each family's Q8_0 GGUF, served from its blocks by default, gives the logits of its
    float32 load, and the weights read as blocks were never built in float32, a mixture's
    stacked experts too (tests/test_gguf_served_experts.py; they were dequantized before).
    The exception as before: GPT-2's file (its Conv1D blocks run along the other axis) loads
    as float32 by default, as blocks when asked."""
    path = hf_dir_to_gguf(family_dirs[case], tmp_path / "m.gguf", "Q8_0")
    asked = "blocks" if case == "gpt2" else "auto"
    served = nbserve.load(str(path), weights=asked, verbose=False).model
    full = nbserve.load(str(path), weights="dense", verbose=False).model
    assert served.weight_format == "quantized" and full.weight_format == "float32"
    if case == "gpt2":
        assert nbserve.load(str(path), verbose=False).model.weight_format == "float32"
    on_meta = [n for n, p in served.named_parameters() if p.device.type == "meta"]
    assert on_meta, case  # GPT-2's: released once its blocks serve
    built = [n for n, p in served.named_parameters() if p.device.type != "meta"]
    assert not [n for n in built if ".experts." in n], case
    ids = [1, 5, 70, 300, 12, 2, 9, 40, 41, 42, 43, 44, 45, 46, 47, 48, 7]
    for got, want in zip(_lone_steps(served, ids), _lone_steps(full, ids)):
        torch.testing.assert_close(got, want, rtol=0.02, atol=0.02 * want.abs().max().item())


def test_the_memory_estimate_is_what_a_served_load_holds(tmp_path):
    """memory_check's estimate for a quantized GGUF on CPU is the blocks as stored and the
    float tensors (norms) in float32, plus the load's temporary (the largest tensor twice):
    exactly what the served model holds, and far below its float32 load's."""
    from nbserve.loading.memory_check import gguf_tensors, load_form, weight_bytes

    hf = make_tiny_hf_dir(tmp_path / "hf", "llama", **K_DIMS)
    path = hf_dir_to_gguf(hf, tmp_path / "m.gguf", "Q4_K")
    tensors = gguf_tensors(path)
    cpu = torch.device("cpu")
    estimate = weight_bytes(tensors, load_form(torch.float32, "quantized", True, cpu, True))
    held = count_parameters(nbserve.load(str(path), verbose=False).model)[1]
    kept = [t.nbytes if len(t.shape) == 2 else t.numel * 4 for t in tensors]
    assert estimate == held + 2 * max(kept)
    assert estimate < weight_bytes(tensors, load_form(torch.float32, None, False, cpu)) / 3


# ----------------------------------------------------------------------------- the IQ4 types

def test_an_iq4_file_loads_as_blocks_and_computes_its_float32_load(tmp_path):
    """An IQ4_XS file (IQ4_NL where a row is not whole 256-weight blocks: llama.cpp's
    fallback) loads as its blocks by default, with the float32 load's logits (issue 42: it
    was refused at read time although the kernels serve both types)."""
    hf = make_tiny_hf_dir(tmp_path / "hf", "llama", **K_DIMS)
    path = hf_dir_to_gguf(hf, tmp_path / "m.gguf", "IQ4_XS",
                          tensor_types={f"blk.{i}.ffn_down.weight": "IQ4_NL" for i in range(2)})
    model = nbserve.load(str(path), verbose=False).model
    kinds = set()
    for holder, names in model._named_holders():
        assert isinstance(holder.form, BlockForm), names
        assert holder.weight.device.type == "meta", names
        kinds.add(holder.form.blocks.kind)
    assert kinds == {"ggml:IQ4_XS", "ggml:IQ4_NL"}
    full = nbserve.load(str(path), dtype="float32", verbose=False).model
    ids = [3, 17, 5, 9, 11, 2] * 3
    exact = nbserve.load(str(path), weights="blocks", exact=True, verbose=False).model
    for got, want in zip(_lone_steps(exact, ids), _lone_steps(full, ids)):
        _close(got, want)


def test_a_type_not_served_is_refused_naming_the_served_types(tmp_path):
    """An IQ2_XXS tensor is refused at read time with the list of served types (never
    dequantized to float32 in silence)."""
    hf = make_tiny_hf_dir(tmp_path / "hf", "llama", **K_DIMS)
    path = hf_dir_to_gguf(hf, tmp_path / "m.gguf", "Q4_K",
                          tensor_types={"blk.0.attn_q.weight": "IQ2_XXS"})
    with pytest.raises(ValueError, match="IQ2_XXS") as refused:
        nbserve.load(str(path), verbose=False)
    message = str(refused.value)
    for served in ("F32", "F16", "BF16", "Q4_0", "Q8_0", "Q4_K", "Q6_K", "IQ4_NL", "IQ4_XS"):
        assert served in message, served
