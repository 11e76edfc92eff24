"""A quantized GGUF's mixture-of-experts layers are served from the file's blocks (issue 42 item
1): the stacked expert tensors (`blk.N.ffn_{gate,up,down}_exps`) are read as blocks, each
expert's matrices a row range of them, and never dequantized to float32 (before, every GGUF's
experts were: a Qwen3-30B-A3B Q4_K_M, 17 GB, needed about 120 GB and was refused). The logits
are the float32 load's, greedy answers over HTTP the same tokens, the weight bytes and the fit
estimate count the experts at their block size, and `.to()` / `state_dict()` read the experts
back out of their blocks."""

from __future__ import annotations

import os

import pytest
import torch
from gguf import GGUFReader
from gguf_util import hf_dir_to_gguf
from kernel_paths import NEEDS_COMPILER
from server_util import greedy_completion
from test_gguf_families import make_case_dir
from test_quantized import _lone_steps

import nbserve
from nbserve.execution.formats import BlockForm, PartsForm
from nbserve.execution.weights import count_parameters
from nbserve.models import moe
from nbserve.models.families import mixtral, qwen3_moe
from nbserve.models.moe import SparseMoE

pytestmark = NEEDS_COMPILER
IDS = [1, 5, 70, 300, 12, 2, 9, 40, 41, 42, 43, 44, 45, 46, 47, 48, 7]
ROLES = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * want.abs().max().item())


def _same_logits(model, full) -> None:
    for got, want in zip(_lone_steps(model, IDS), _lone_steps(full, IDS)):
        _close(got, want)


def _experts(model) -> list:
    return [layer.mlp.experts for layer in model.model.layers if isinstance(layer.mlp, SparseMoE)]


def _expert_file_bytes(path) -> int:
    return sum(int(t.n_bytes) for t in GGUFReader(path).tensors
               if t.name.split(".")[-2] in ROLES)


def _served_from_blocks(model, path) -> None:
    """Every expert served from its blocks, its parameters on meta (never built in float32),
    and the blocks exactly the file's bytes of the stacks."""
    experts = _experts(model)
    assert experts and model.block_experts() == experts
    for e in experts:
        assert e.released and e.forms is not None
        assert e.gate_up_proj.device.type == "meta" and e.down_proj.device.type == "meta"
    on_cpu = [n for n, p in model.named_parameters() if p.device.type != "meta"]
    assert not [n for n in on_cpu if ".experts." in n], on_cpu
    assert sum(e.nbytes for e in experts) == _expert_file_bytes(path)


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("moe")
    return {case: make_case_dir(case, root / case) for case in ("qwen3_moe", "mixtral")}


@pytest.mark.parametrize("case", ["qwen3_moe", "mixtral"])
def test_a_q8_0_files_experts_are_served_from_their_blocks(moe_dirs, tmp_path, case):
    """Q8_0: served by default and exactly (exact=True) with the float32 load's logits; each
    expert's gate|up is one row range of its layer's one buffer (read so: no copy)."""
    path = hf_dir_to_gguf(moe_dirs[case], tmp_path / "m.gguf", "Q8_0")
    full = nbserve.load(str(path), dtype="float32", verbose=False).model
    assert not full.block_experts() and not full.dense_released
    for kwargs in ({}, {"weights": "blocks", "exact": True}):
        model = nbserve.load(str(path), verbose=False, **kwargs).model
        assert model.weight_format == ("quantized-exact" if kwargs else "quantized")
        _served_from_blocks(model, path)
    for e in _experts(model):
        gate_up, down = e.forms
        assert all(isinstance(f, BlockForm) and f.blocks.kind == "q8" for f in gate_up + down)
        assert len({f.blocks.codes.untyped_storage().data_ptr() for f in gate_up}) == 1
    _same_logits(model, full)
    served, dense = count_parameters(model)[1], count_parameters(full)[1]
    assert served < os.path.getsize(path) and served < dense / 3


def _kquant_moe_dir(path):
    """A tiny Qwen3-MoE whose expert rows are whole K-quant blocks (256 weights)."""
    return make_case_dir("qwen3_moe", path, overrides=dict(
        hidden_size=256, head_dim=64, moe_intermediate_size=256, intermediate_size=256))


@pytest.mark.parametrize("types", [("Q4_K", "Q4_K", "Q6_K"), ("Q4_K", "Q5_0", "Q5_K")])
def test_k_quant_experts_are_served_from_their_blocks(tmp_path, types):
    """A Q4_K_M-like file (Q4_K gate and up, Q6_K down): each expert's gate|up one Q4_K
    form; gate and up of different types: each expert's a `PartsForm` of the two, as read.
    The float32 load's logits either way."""
    hf = _kquant_moe_dir(tmp_path / "hf")
    path = hf_dir_to_gguf(hf, tmp_path / "m.gguf", "Q8_0", tensor_types={
        f"blk.{i}.{role}.weight": kind for i in range(2) for role, kind in zip(ROLES, types)})
    model = nbserve.load(str(path), weights="blocks", exact=True, verbose=False).model
    _served_from_blocks(model, path)
    gate, up, down = (f"ggml:{t}" for t in types)
    for e in _experts(model):
        gate_up, downs = e.forms
        assert all(f.blocks.kind == down for f in downs)
        for f in gate_up:
            if gate == up:
                assert isinstance(f, BlockForm) and f.blocks.kind == gate
            else:
                assert isinstance(f, PartsForm)
                assert [p.blocks.kind for p in f.parts] == [gate, up]
    full = nbserve.load(str(path), dtype="float32", verbose=False).model
    _same_logits(model, full)


def test_k_quant_experts_round_decode_rows_to_8_bits_and_not_prompts(tmp_path, monkeypatch):
    """As a dense layer's kernels: a Q4_K/Q6_K MoE's experts multiply decode rows (one
    position a sequence) with 8-bit inputs (the default) and a prompt chunk's positions without
    them, the product of a load with NBSERVE_ROUND8=0 (before, the experts' rows came flattened
    and a prompt took 8-bit inputs too)."""
    from nbserve.cpu.kernels.blocks import BlockType, blocks_rounded8
    from nbserve.cpu.kernels.build import quant_kernels

    if not blocks_rounded8(BlockType.Q4_K, quant_kernels()):
        pytest.skip("this build has no 8-bit row kernels")
    hf = _kquant_moe_dir(tmp_path / "hf")
    path = hf_dir_to_gguf(hf, tmp_path / "m.gguf", "Q8_0", tensor_types={
        f"blk.{i}.{role}.weight": kind for i in range(2)
        for role, kind in zip(ROLES, ("Q4_K", "Q4_K", "Q6_K"))})
    monkeypatch.setenv("NBSERVE_ROUND16", "1")  # the same 16-bit choice for both loads
    monkeypatch.delenv("NBSERVE_ROUND8", raising=False)
    rounded = nbserve.load(str(path), verbose=False).model
    monkeypatch.setenv("NBSERVE_ROUND8", "0")
    sixteen = nbserve.load(str(path), verbose=False).model
    mlp, mlp16 = (next(m for m in model.modules() if isinstance(m, SparseMoE))
                  for model in (rounded, sixteen))
    x = torch.randn(1, 12, 256, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        assert torch.equal(mlp(x), mlp16(x))  # a prompt chunk: no 8-bit inputs
        decode = x.reshape(12, 1, 256)
        assert not torch.equal(mlp(decode), mlp16(decode))  # decode rows: 8-bit


def test_greedy_answers_over_http_equal_the_float32_load(moe_dirs, tmp_path):
    """Served from its experts' blocks (exact arithmetic), a Qwen3-MoE answers as its float32
    load token for token; /stats reports the weight bytes as served, the experts at their
    blocks' size."""
    path = hf_dir_to_gguf(moe_dirs["qwen3_moe"], tmp_path / "m.gguf", "Q8_0")
    answers, stats = {}, {}
    for name, kwargs in (("blocks", {"weights": "blocks", "exact": True}),
                         ("float32", {"dtype": "float32"})):
        loaded = nbserve.load(str(path), verbose=False, **kwargs)
        answers[name], stats[name] = greedy_completion(loaded)
        assert stats[name]["weight_bytes"] == count_parameters(loaded.model)[1]
    assert answers["blocks"]["logprobs"]["tokens"] == answers["float32"]["logprobs"]["tokens"]
    assert answers["blocks"]["text"] == answers["float32"]["text"]
    assert stats["blocks"]["weight_bytes"] < stats["float32"]["weight_bytes"] / 3


def test_the_fit_estimate_counts_the_experts_at_their_block_size(moe_dirs, tmp_path):
    """memory_check's estimate for a served MoE file is its blocks as stored (the expert
    stacks too, which it counted in float32 before) plus the load's temporary: exactly what
    the served model holds, plus the largest tensor twice."""
    from nbserve.loading.memory_check import gguf_tensors, load_form, weight_bytes

    path = hf_dir_to_gguf(moe_dirs["qwen3_moe"], tmp_path / "m.gguf", "Q8_0")
    tensors = gguf_tensors(path)
    assert any(len(t.shape) == 3 for t in tensors)
    cpu = torch.device("cpu")
    estimate = weight_bytes(tensors, load_form(torch.float32, "quantized", True, cpu, True))
    held = count_parameters(nbserve.load(str(path), verbose=False).model)[1]
    kept = [t.nbytes if t.stored == "Q8_0" else t.numel * 4 for t in tensors]
    assert estimate == sum(kept) + 2 * max(kept) == held + 2 * max(kept)
    assert estimate < weight_bytes(tensors, load_form(torch.float32, None, False, cpu)) / 3


def test_state_dict_and_to_read_the_experts_back_out_of_their_blocks(moe_dirs, tmp_path):
    """`state_dict()` gives the float32 experts (the file's values, as the float32 load's)
    and the model stays served from its blocks; `.float()` (a move) keeps it so; a move to
    bfloat16 builds the experts from the blocks in bfloat16, served as plain tensors."""
    path = hf_dir_to_gguf(moe_dirs["mixtral"], tmp_path / "m.gguf", "Q8_0")
    model = nbserve.load(str(path), verbose=False).model
    full = nbserve.load(str(path), dtype="float32", verbose=False).model
    state, want = model.state_dict(), full.state_dict()
    names = [n for n in want if ".experts." in n]
    assert names
    for name in names:
        assert torch.equal(state[name], want[name]), name
    _served_from_blocks(model, path)
    before = _lone_steps(model, IDS)
    model.float()
    _served_from_blocks(model, path)
    for got, was in zip(_lone_steps(model, IDS), before):
        assert torch.equal(got, was)
    model.to(torch.bfloat16)
    assert not model.dense_released
    for e, f in zip(_experts(model), _experts(full)):
        assert not e.released and e.gate_up_proj.dtype == torch.bfloat16
        assert torch.equal(e.gate_up_proj, f.gate_up_proj.to(torch.bfloat16))
    pre, _ = _lone_steps(model, IDS)
    assert torch.isfinite(pre).all()


def test_a_served_moe_model_still_copies_to_another_device(moe_dirs, tmp_path):
    """Pool's replicas: the experts are read back out of their blocks for the copy (whose
    parameters are then the real tensors, not placeholders), and released again here."""
    from nbserve.pool.setup import replicate

    path = hf_dir_to_gguf(moe_dirs["qwen3_moe"], tmp_path / "m.gguf", "Q8_0")
    loaded = nbserve.load(str(path), verbose=False)
    copy = replicate(loaded, "meta").model
    for e in _experts(copy):
        assert e.gate_up_proj.device.type == "meta" and e.gate_up_proj.shape[0] == 4
        assert not e.released
    assert not copy.dense_released
    _served_from_blocks(loaded.model, path)


def test_every_moe_familys_expert_names_are_known():
    """The decoder finds each expert's blocks by the names its family gives the matrices."""
    for family in (qwen3_moe, mixtral):
        assert family.PROJECTIONS.items() <= moe.EXPERT_ROLES.items()
