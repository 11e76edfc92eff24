"""Mixture-of-experts families (Qwen3-MoE, Mixtral) compute what transformers computes: loaded
from a HF folder in either tensor layout (per-expert hub names, transformers 5's stacked
tensors), at prefill and at each of 16 cached decode steps; a batch of 8 mixed-length requests
equals each alone (model and engine); an adopted transformers model runs on its own tensors;
the experts run grouped by expert over their own 3-D weights, only where tokens went."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from family_checks import (
    PROMPT_LEN,
    cached_reference,
    check_batch_equals_alone,
    check_engine_batched_like_alone,
    check_steps,
    inputs,
)
from moe_models import CASES, NUM_EXPERTS, TOP_K, save_moe_dir, tiny_moe_model
from safetensors import safe_open
from tiny_models import make_tiny_tokenizer

import nbserve
from nbserve.models import moe, registry
from nbserve.models.adopt import take_over
from nbserve.models.moe import SparseMoE, stack_experts

_CACHE: dict[tuple[str, str], tuple[Path, nbserve.LoadedModel]] = {}
_HF: dict[str, transformers.PreTrainedModel] = {}


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    """get(case, layout) -> (folder, nbserve's model of it); ref(case) -> transformers' model
    loaded from the legacy (hub-named) folder."""
    root = tmp_path_factory.mktemp("moe")

    def get(case: str, layout: str = "legacy"):
        if (case, layout) not in _CACHE:
            path = save_moe_dir(case, root / f"{case}-{layout}", layout)
            _CACHE[case, layout] = (path, nbserve.load(str(path), dtype="float32",
                                                       verbose=False))
        return _CACHE[case, layout]

    def ref(case: str):
        if case not in _HF:
            _HF[case] = transformers.AutoModelForCausalLM.from_pretrained(
                get(case)[0], dtype=torch.float32, attn_implementation="eager").eval()
        return _HF[case]
    yield get, ref
    _CACHE.clear()
    _HF.clear()


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_and_16_decode_steps_match_transformers(case, moe_dirs) -> None:
    get, ref = moe_dirs
    model = get(case)[1].model
    seq, steps = inputs(model.vocab_size, 1)
    check_steps(model, seq, steps, cached_reference(ref(case), seq, steps), case)


@pytest.mark.parametrize("case", list(CASES))
def test_sparse_and_dense_layers_are_where_transformers_puts_them(case, moe_dirs) -> None:
    get, ref = moe_dirs
    model, hf = get(case)[1].model, ref(case)
    ours = [isinstance(layer.mlp, SparseMoE) for layer in model.model.layers]
    theirs = [hasattr(layer.mlp, "experts") for layer in hf.model.layers]
    assert ours == theirs
    assert any(ours)
    if case == "qwen3-moe":
        assert ours == [True, False, True]  # mlp_only_layers=[1]
    if case == "qwen3-moe-norm-window":
        assert ours == [False, True, False, True]  # decoder_sparse_step=2


@pytest.mark.parametrize("case", list(CASES))
def test_transformers_5_stacked_tensors_load_and_equal(case, moe_dirs) -> None:
    """A folder of transformers 5's stacked expert tensors loads as the per-expert one does;
    transformers reads both folders as the same tensors (so both writers are right)."""
    get, ref = moe_dirs
    legacy_path, legacy = get(case, "legacy")
    fused_path, fused = get(case, "fused")
    with safe_open(str(legacy_path / "model.safetensors"), "pt") as f:
        legacy_names = list(f.keys())
    with safe_open(str(fused_path / "model.safetensors"), "pt") as f:
        fused_names = list(f.keys())
    assert any(".experts.0." in n for n in legacy_names)
    assert not any("gate_up_proj" in n for n in legacy_names)
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in fused_names)
    hf_fused = transformers.AutoModelForCausalLM.from_pretrained(
        fused_path, dtype=torch.float32, attn_implementation="eager").eval()
    hf_legacy = dict(ref(case).named_parameters())
    for name, p in hf_fused.named_parameters():
        assert torch.equal(p, hf_legacy[name]), name
    seq, steps = inputs(legacy.model.vocab_size, 4)
    ours = dict(legacy.model.named_parameters())
    for name, p in fused.model.named_parameters():
        assert torch.equal(p, ours[name]), name
    check_steps(fused.model, seq, steps, cached_reference(ref(case), seq, steps), f"{case} fused")


@pytest.mark.parametrize("case", list(CASES))
def test_a_batch_of_8_mixed_lengths_equals_each_alone(case, moe_dirs) -> None:
    check_batch_equals_alone(moe_dirs[0](case)[1].model, case)


@pytest.mark.parametrize("case", list(CASES))
def test_the_engine_serves_batched_like_alone(case, moe_dirs) -> None:
    check_engine_batched_like_alone(moe_dirs[0](case)[1])


@pytest.mark.parametrize("case", list(CASES))
def test_an_adopted_transformers_model_runs_on_its_own_tensors(case) -> None:
    hf = tiny_moe_model(case, make_tiny_tokenizer().get_vocab_size())
    step = take_over(hf)
    assert step is not None, f"{case} fell back to the adapter"
    theirs = {p.untyped_storage().data_ptr() for p in hf.parameters()}
    assert {p.untyped_storage().data_ptr() for p in step.parameters()} <= theirs
    hf_params = dict(hf.named_parameters())
    for name, p in step.named_parameters():
        if ".experts." in name or name.endswith("mlp.gate.weight"):
            assert p.data_ptr() == hf_params[name].data_ptr(), name  # the very tensor
    assert any(isinstance(layer.mlp, SparseMoE) for layer in step.model.layers)
    seq, steps = inputs(step.vocab_size, 3)
    check_steps(step, seq, steps, cached_reference(hf, seq, steps), f"{case} adopted")


def _hf_routing(hf, seq: torch.Tensor) -> list[torch.Tensor]:
    """Per sparse layer, how many (token, choice) pairs transformers routes to each expert."""
    with torch.no_grad():
        logits = hf(seq, output_router_logits=True).router_logits
    return [torch.bincount(torch.topk(torch.softmax(lg.float(), -1), TOP_K, -1).indices.view(-1),
                           minlength=NUM_EXPERTS) for lg in logits]


@pytest.mark.parametrize("case", ["qwen3-moe", "mixtral-window"])
def test_experts_run_grouped_over_their_own_weights(case, moe_dirs, monkeypatch) -> None:
    """One grouped matmul per projection and sparse layer, over the layer's own 3-D weights
    (no per-token copy), on N * top_k rows (not N * experts), grouped as transformers routes."""
    get, ref = moe_dirs
    model = get(case)[1].model
    calls: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    real = moe.grouped_linear

    def spy(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        calls.append((x.shape[0], weight, ends.clone()))
        return real(x, weight, ends)

    monkeypatch.setattr(moe, "grouped_linear", spy)
    seq = inputs(model.vocab_size, 5)[0]
    out = model.forward(seq, torch.arange(PROMPT_LEN)[None], torch.arange(4)[None],
                        model.make_paged_cache(4, 8))
    with torch.no_grad():
        torch.testing.assert_close(out[0], ref(case)(seq).logits[0], atol=1e-4, rtol=0)
    sparse = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoE)]
    assert len(calls) == 2 * len(sparse)
    routed = _hf_routing(ref(case), seq)
    for i, block in enumerate(sparse):
        for (rows, weight, ends), param in zip(calls[2 * i:2 * i + 2],
                                               (block.experts.gate_up_proj,
                                                block.experts.down_proj)):
            assert rows == PROMPT_LEN * TOP_K
            assert weight.shape == param.shape and weight.data_ptr() == param.data_ptr()
            counts = torch.diff(ends.long(), prepend=ends.new_zeros(1).long())
            assert torch.equal(counts, routed[i])


@pytest.mark.parametrize("case", ["qwen3-moe", "mixtral-window"])
def test_without_grouped_mm_only_experts_with_tokens_run(case, moe_dirs, monkeypatch) -> None:
    """The per-expert path (torch without grouped_mm, or where it refuses) runs one matmul
    pair per expert that got tokens, over a view of that expert's weights, and computes the
    same logits."""
    get, ref = moe_dirs
    model = get(case)[1].model
    sparse = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoE)]
    storages = {b.experts.gate_up_proj.untyped_storage().data_ptr() for b in sparse} | \
        {b.experts.down_proj.untyped_storage().data_ptr() for b in sparse}
    calls: list[torch.Tensor] = []
    real = moe.expert_linear

    def spy(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        assert weight.dim() == 2 and weight.untyped_storage().data_ptr() in storages
        calls.append(weight)
        return real(x, weight)

    monkeypatch.setattr(moe, "expert_linear", spy)
    for block in sparse:
        monkeypatch.setattr(block.experts, "grouped", False)
    for n in (1, PROMPT_LEN):  # one token: top_k of the experts run, the others do not
        calls.clear()
        seq = inputs(model.vocab_size, 6)[0][:, :n]
        out = model.forward(seq, torch.arange(n)[None], torch.arange(4)[None],
                            model.make_paged_cache(4, 8))
        with torch.no_grad():
            torch.testing.assert_close(out[0], ref(case)(seq).logits[0], atol=1e-4, rtol=0)
        hit = [int((c > 0).sum()) for c in _hf_routing(ref(case), seq)]
        assert len(calls) == 2 * sum(hit)
        if n == 1:
            assert hit == [TOP_K] * len(sparse)


@pytest.mark.parametrize("case", ["qwen3-moe", "mixtral-window"])
def test_a_bfloat16_sparse_block_matches_transformers(case) -> None:
    """The 16-bit path (what CUDA runs): the sparse block of an adopted bfloat16 model against
    transformers' on the same input."""
    hf = tiny_moe_model(case, make_tiny_tokenizer().get_vocab_size()).to(torch.bfloat16)
    step = take_over(hf)
    assert step is not None
    i = next(i for i, layer in enumerate(step.model.layers) if isinstance(layer.mlp, SparseMoE))
    x = torch.randn(1, 40, 64, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    with torch.no_grad():
        theirs = hf.model.layers[i].mlp(x)
        ours = step.model.layers[i].mlp(x, None)
    assert ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours.float(), theirs.float(), atol=2e-2 * theirs.abs().max().item(),
                               rtol=0)


def test_per_expert_tensors_are_stacked_and_checked() -> None:
    """stack_experts: gate rows then up rows (transformers 5's order); a missing expert, a
    shape unlike the other experts' and an expert out of range are errors."""
    gen = torch.Generator().manual_seed(0)
    names = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
    mats = {(e, p): torch.randn(3, 2, generator=gen) for e in range(2) for p in names}
    tensors = [(f"model.layers.1.mlp.experts.{e}.{p}.weight", t) for (e, p), t in mats.items()]
    tensors.append(("model.layers.1.mlp.gate.weight", torch.zeros(2, 2)))
    out = dict(stack_experts(tensors, 2, names))
    assert set(out) == {"model.layers.1.mlp.gate.weight", "model.layers.1.mlp.experts.gate_up_proj",
                        "model.layers.1.mlp.experts.down_proj"}
    gate_up = out["model.layers.1.mlp.experts.gate_up_proj"]
    assert gate_up.shape == (2, 6, 2)
    assert torch.equal(gate_up[1, :3], mats[1, "gate_proj"])
    assert torch.equal(gate_up[1, 3:], mats[1, "up_proj"])
    assert torch.equal(out["model.layers.1.mlp.experts.down_proj"][0], mats[0, "down_proj"])
    with pytest.raises(ValueError, match="layer 1 lacks 1 expert tensors"):
        dict(stack_experts(tensors[1:], 2, names))
    odd = [(n, t[:, :1]) if ".1.up_proj" in n else (n, t) for n, t in tensors]
    with pytest.raises(ValueError, match=r"experts\.1\.up_proj.*shape \(3, 1\)"):
        dict(stack_experts(odd, 2, names))
    with pytest.raises(ValueError, match="expert 2 of a model with 2"):
        dict(stack_experts([("model.layers.0.mlp.experts.2.up_proj.weight", torch.zeros(1))],
                           2, names))


def test_the_families_are_registered() -> None:
    archs = registry.native_architectures()
    assert "Qwen3MoeForCausalLM" in archs and "MixtralForCausalLM" in archs
    gguf = registry.gguf_architectures()
    assert gguf["qwen3moe"] == "Qwen3MoeForCausalLM"
    assert gguf["llama"] == "LlamaForCausalLM"  # Mixtral files read as Mixtral by expert count
