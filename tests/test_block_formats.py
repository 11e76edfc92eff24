"""GGUF block types served from the file's own blocks (`execution.quant.GGMLBlocks`, a row of
`BLOCK_TYPES` and of `KINDS` each; the C kernels of cpu/kernels/gguf_blocks.c): a tiny Llama
written as K-quants (and Q5_0/Q5_1) loads with its matmul weights as those blocks, exactly the
float32 model's dequantized weights, and its prefill, decode steps and one-call decode stack
give the float32 model's logits up to rounding."""

from __future__ import annotations

import pytest
import torch
from gguf_util import hf_dir_to_gguf
from kernel_paths import NEEDS_COMPILER
from test_decode_stack import _decode
from test_quantized import _lone_steps
from tiny_models import make_tiny_hf_dir

import nbserve
from nbserve.execution.decode_stack import unfit_reason
from nbserve.execution.quant import GGMLBlocks

pytestmark = NEEDS_COMPILER
K_DIMS = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
          "num_key_value_heads": 2}  # rows of whole K-quant blocks (256 weights)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to float32 rounding at the logits' scale (random K-quant blocks make logits of
    up to about 2,000 here; a wrong weight moves them by far more than 1e-5 of that)."""
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q5_K", "Q3_K", "Q2_K", "Q5_0", "Q5_1"])
def test_a_gguf_is_served_from_its_own_blocks_of_every_type(qtype, tmp_path, monkeypatch):
    hf = make_tiny_hf_dir(tmp_path / "hf", "llama", **K_DIMS)
    path = hf_dir_to_gguf(hf, tmp_path / "m.gguf", qtype)
    full = nbserve.load(str(path), dtype="float32", verbose=False).model
    model = nbserve.load(str(path), weights="blocks", exact=True, verbose=False).model
    holders = model._named_holders()
    blocks = [holder.form.kernel.weight for holder, _ in holders]
    # every matmul weight of that type is the file's blocks (the tied head: the embedding's)
    assert sum(isinstance(b, GGMLBlocks) and b.kind == f"ggml:{qtype}" for b in blocks) \
        >= len(blocks) - 1
    assert model.weight_format == "quantized-exact"
    for (holder, names), (dense, _) in zip(holders, full._named_holders()):
        # the file's own weights, Q/K rows unpermuted, fused projections stacked
        assert torch.equal(holder.form.kernel.weight.dequantize(), dense.weight), names
    ids = [3, 17, 5, 9, 11, 2] * 3
    for got, want in zip(_lone_steps(model, ids), _lone_steps(full, ids)):
        _close(got, want)  # 18 rows: the panels; one: a row kernel
    assert unfit_reason(model) is None  # the decode stack runs the blocks in one call
    kv = torch.float32  # as the float32 model's (a quantized model's default cache is float16)
    one_by_one, _ = _decode(model, 6, stacked=False, kv_dtype=kv, monkeypatch=monkeypatch)
    stacked, served = _decode(model, 6, stacked=True, kv_dtype=kv, monkeypatch=monkeypatch)
    assert served == 6
    assert all(torch.equal(a, b) for a, b in zip(stacked, one_by_one))
    reference, _ = _decode(full, 6, stacked=False, kv_dtype=kv, monkeypatch=monkeypatch)
    for got, want in zip(stacked, reference):
        _close(got, want)
