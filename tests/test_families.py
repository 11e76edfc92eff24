"""Every native family computes what transformers computes: loaded from a HF folder, at prefill
and at each of 16 cached decode steps; a batch of 8 mixed-length requests equals each alone;
prompts past the sliding windows; an adopted transformers model runs on its own tensors."""

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
from family_models import CASES, WINDOW, WINDOWED, save_family_dir
from tiny_models import make_tiny_tokenizer

import nbserve
from nbserve.models import registry
from nbserve.models.adopt import take_over

_CACHE: dict[str, tuple[Path, transformers.PreTrainedModel, nbserve.LoadedModel]] = {}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")

    def get(case: str):
        if case not in _CACHE:
            path = save_family_dir(case, root / case)
            hf = transformers.AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.float32, attn_implementation="eager").eval()
            _CACHE[case] = (path, hf, nbserve.load(str(path), dtype="float32", verbose=False))
        return _CACHE[case]
    yield get
    _CACHE.clear()


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_and_16_decode_steps_match_transformers(case, family_dirs) -> None:
    _, hf, loaded = family_dirs(case)
    seq, steps = inputs(loaded.model.vocab_size, 1)
    check_steps(loaded.model, seq, steps, cached_reference(hf, seq, steps), case)


@pytest.mark.parametrize("case", list(CASES))
def test_a_batch_of_8_mixed_lengths_equals_each_alone(case, family_dirs) -> None:
    check_batch_equals_alone(family_dirs(case)[2].model, case)


@pytest.mark.parametrize("case", WINDOWED)
def test_ignoring_the_window_would_have_been_caught(case, family_dirs) -> None:
    """The comparison above has teeth: the same weights with the windows switched off give
    other logits past the window."""
    path, hf, _ = family_dirs(case)
    unwindowed = nbserve.load(str(path), dtype="float32", verbose=False).model
    assert any(w == WINDOW for w in unwindowed.config.layer_window)
    for layer in unwindowed.model.layers:
        layer.self_attn.window = None
    seq = torch.randint(3, unwindowed.vocab_size, (1, PROMPT_LEN),
                        generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(seq).logits[0]
    out = unwindowed.forward(seq, torch.arange(PROMPT_LEN)[None], torch.arange(4)[None],
                             unwindowed.make_paged_cache(4, 8))[0]
    assert (out[:WINDOW] - ref[:WINDOW]).abs().max() < 1e-4  # inside the window: the same
    assert (out[WINDOW:] - ref[WINDOW:]).abs().max() > 1e-3  # past it: not


@pytest.mark.parametrize("case", list(CASES))
def test_the_engine_serves_each_family_batched_like_alone(case, family_dirs) -> None:
    check_engine_batched_like_alone(family_dirs(case)[2])


@pytest.mark.parametrize("case", ["qwen3", "gemma3", "phi3-longrope", "olmo2", "gpt2"])
def test_an_adopted_transformers_model_runs_natively_on_its_own_tensors(case) -> None:
    from family_models import tiny_family_model

    hf = tiny_family_model(case, make_tiny_tokenizer().get_vocab_size())
    step = take_over(hf)
    assert step is not None, f"{case} fell back to the adapter"
    theirs = {p.untyped_storage().data_ptr() for p in hf.parameters()}
    assert {p.untyped_storage().data_ptr() for p in step.parameters()} <= theirs
    seq = torch.randint(3, step.vocab_size, (1, 20))
    with torch.no_grad():
        ref = hf(seq).logits[0]
    out = step.forward(seq, torch.arange(20)[None], torch.arange(4)[None],
                       step.make_paged_cache(4, 8))
    torch.testing.assert_close(out[0], ref, atol=1e-4, rtol=0)


def test_every_family_is_registered_with_its_gguf_name() -> None:
    archs = registry.native_architectures()
    for name in ("Qwen3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
                 "Phi3ForCausalLM", "GPT2LMHeadModel", "Olmo2ForCausalLM",
                 "SmolLM3ForCausalLM", "MistralForCausalLM"):
        assert name in archs
    gguf = registry.gguf_architectures()
    for name in ("qwen3", "gemma2", "gemma3", "phi3", "gpt2", "olmo2", "smollm3"):
        assert name in gguf


def test_a_fused_checkpoint_weight_keeps_its_own_quantized_blocks(family_dirs) -> None:
    """Phi-3's qkv_proj / gate_up_proj come fused: their blocks are found under the
    checkpoint's names (a GGUF's attn_qkv), not remade as Q8_0 from the floats."""
    from nbserve.cpu.kernels.build import kernels_available
    from nbserve.execution.quant import QuantBlocks

    if not kernels_available():
        pytest.skip("needs nbserve's C kernels (a C compiler)")
    path, _, _ = family_dirs("phi3-longrope")
    model = nbserve.load(str(path), dtype="float32", verbose=False).model
    att, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    own = {"model.layers.0.self_attn.qkv_proj.weight": QuantBlocks.from_float(att.qkv.weight),
           "model.layers.0.mlp.gate_up_proj.weight": QuantBlocks.from_float(mlp.gate_up.weight)}
    assert model.use_quantized_weights(own)
    assert att.qkv.form.blocks is own["model.layers.0.self_attn.qkv_proj.weight"]
    assert mlp.gate_up.form.blocks is own["model.layers.0.mlp.gate_up_proj.weight"]


def test_a_multimodal_gemma3_is_served_as_its_language_model(tmp_path) -> None:
    """Gemma 3 4B and up are Gemma3ForConditionalGeneration: the folder loads (vision tensors
    left out), and an adopted object shares its language model's tensors; both compute the
    text model's logits."""
    vocab = make_tiny_tokenizer().get_vocab_size()
    text = dict(CASES["gemma3"][2], vocab_size=vocab)
    cfg = transformers.Gemma3Config(
        text_config=text, vision_config=dict(hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=1, num_attention_heads=2,
                                             image_size=28, patch_size=14),
        mm_tokens_per_image=4, boi_token_index=vocab - 3, eoi_token_index=vocab - 2,
        image_token_index=vocab - 1)
    torch.manual_seed(0)
    hf = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    hf.save_pretrained(tmp_path)
    make_tiny_tokenizer().save(str(tmp_path / "tokenizer.json"))
    seq = torch.randint(3, vocab - 3, (1, PROMPT_LEN))
    with torch.no_grad():
        ref = hf(input_ids=seq).logits[0]
    loaded = nbserve.load(str(tmp_path), dtype="float32", verbose=False).model
    adopted = take_over(hf)
    assert adopted is not None
    theirs = {p.untyped_storage().data_ptr() for p in hf.parameters()}
    assert {p.untyped_storage().data_ptr() for p in adopted.parameters()} <= theirs
    for model in (loaded, adopted):
        out = model.forward(seq, torch.arange(PROMPT_LEN)[None], torch.arange(4)[None],
                            model.make_paged_cache(4, 8))[0]
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)


def test_dynamic_ntk_rope_past_the_trained_context_matches_transformers(tmp_path) -> None:
    """Dynamic NTK scaling changes the frequencies once a sequence passes
    max_position_embeddings (here 32: the 16 decode steps after a 24-token prompt cross it);
    each row is roped by its own length, as transformers' cached generation does."""
    from family_models import tiny_family_model

    CASES["llama-dynamic"] = (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                              dict(CASES["llama-linear"][2], max_position_embeddings=32,
                                   rope_scaling={"rope_type": "dynamic", "factor": 2.0}))
    try:
        hf = tiny_family_model("llama-dynamic", make_tiny_tokenizer().get_vocab_size())
    finally:
        del CASES["llama-dynamic"]
    hf.save_pretrained(tmp_path)
    make_tiny_tokenizer().save(str(tmp_path / "tokenizer.json"))
    model = nbserve.load(str(tmp_path), dtype="float32", verbose=False).model
    assert model.config.ropes[0].kind == "dynamic"
    seq, steps = inputs(model.vocab_size, 5)
    check_steps(model, seq, steps, cached_reference(hf, seq, steps), "dynamic")
