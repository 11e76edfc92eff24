"""nbserve's Llama-family model computes what transformers computes, at prefill and cached
decode."""

from __future__ import annotations

import pytest
import torch
import transformers

from nbserve.execution.step_inputs import StepInputs
from nbserve.models.attention import Attention
from nbserve.models.decoder import build_llama
from nbserve.models.dtypes import load_kwargs
from nbserve.models.families.llama import read_config as read_llama
from nbserve.models.rope import apply_rope

VOCAB = 300


def _hf_model(arch: str) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    if arch == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common,
                                                                      tie_word_embeddings=False))
    if arch == "mistral":
        return transformers.MistralForCausalLM(transformers.MistralConfig(**common,
                                                                          sliding_window=None))
    extra = {}
    if arch == "llama3":
        extra = dict(rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**common, tie_word_embeddings=True, **extra))


@pytest.mark.parametrize("arch", ["llama", "llama3", "qwen2", "mistral"])
def test_prefill_and_16_decode_steps_match_transformers(arch: str) -> None:
    hf = _hf_model(arch).eval()
    cfg_dict = hf.config.to_dict() | {"architectures": [type(hf).__name__]}
    model = build_llama(read_llama(cfg_dict), hf.state_dict().items())
    cache = model.make_cache(3, 128)
    slot = torch.tensor([1])
    seq = torch.randint(0, VOCAB, (1, 20))
    with torch.no_grad():
        ref = hf(seq).logits
    out = model.forward(seq, torch.arange(20)[None], slot, cache)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)
    for _ in range(16):
        nxt = torch.randint(0, VOCAB, (1, 1))
        seq = torch.cat([seq, nxt], dim=1)
        with torch.no_grad():
            ref = hf(seq).logits[:, -1]
        pos = torch.tensor([[seq.shape[1] - 1]])
        out = model.forward(nxt, pos, slot, cache)[:, -1]
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)


def test_batched_decode_with_different_lengths_matches_single_rows() -> None:
    hf = _hf_model("llama").eval()
    cfg = read_llama(hf.config.to_dict() | {"architectures": ["LlamaForCausalLM"]})
    model = build_llama(cfg, hf.state_dict().items())
    cache = model.make_cache(4, 128)
    prompts = [torch.randint(0, VOCAB, (1, n)) for n in (5, 17, 9)]
    slots = [3, 0, 2]  # scattered slots: the gather path
    for p, s in zip(prompts, slots):
        model.forward(p, torch.arange(p.shape[1])[None], torch.tensor([s]), cache)
    nxt = torch.randint(0, VOCAB, (3, 1))
    pos = torch.tensor([[p.shape[1]] for p in prompts])
    batched = model.forward(nxt, pos, torch.tensor(slots), cache)[:, 0]
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ref = hf(torch.cat([p, nxt[i:i + 1]], 1)).logits[0, -1]
        torch.testing.assert_close(batched[i], ref, atol=1e-4, rtol=0)


def test_unsupported_architecture_lists_the_supported_ones() -> None:
    from nbserve.models import registry
    with pytest.raises(ValueError, match="unsupported architecture 'BloomForCausalLM'.*"
                       "LlamaForCausalLM.*Qwen2ForCausalLM.*Qwen3ForCausalLM"):
        registry.read_config({"architectures": ["BloomForCausalLM"], "model_type": "bloom"}, "x")


def test_missing_and_misshapen_tensors_are_named() -> None:
    hf = _hf_model("llama")
    cfg = read_llama(hf.config.to_dict() | {"architectures": ["LlamaForCausalLM"]})
    sd = hf.state_dict()
    partial = {k: v for k, v in sd.items() if "layers.1.mlp.up_proj" not in k}
    with pytest.raises(ValueError, match="lacks 1 tensors.*up_proj"):
        build_llama(cfg, partial.items())
    bad = dict(sd)
    bad["model.norm.weight"] = torch.ones(3)
    with pytest.raises(ValueError, match="model.norm.weight.*shape"):
        build_llama(cfg, bad.items())


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("fmt", ["hf_dir", "gguf"])
def test_loaded_files_match_transformers_at_prefill_and_16_cached_steps(
        arch, fmt, tiny_llama_dir, tiny_qwen2_dir, tmp_path):
    """The real formats end to end: saved HF directory and its GGUF conversion, through
    nbserve.load, against transformers on the same directory."""
    from gguf_util import hf_dir_to_gguf

    import nbserve

    src = tiny_llama_dir if arch == "llama" else tiny_qwen2_dir
    path = src if fmt == "hf_dir" else hf_dir_to_gguf(src, tmp_path / f"{arch}.gguf", "F32")
    loaded = nbserve.load(str(path), device="cpu", dtype="float32", verbose=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    ids = loaded.tokenizer.encode("Hello there, how are you today?")
    seq = torch.tensor([ids])
    cache = loaded.model.make_cache(2, 128)
    slot = torch.tensor([1])
    with torch.no_grad():
        ref = hf(seq).logits
    out = loaded.model.forward(seq, torch.arange(len(ids))[None], slot, cache)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)
    for _ in range(16):
        nxt = out[:, -1].argmax(-1, keepdim=True)  # (1, 1): follow the model's greedy path
        seq = torch.cat([seq, nxt], dim=1)
        with torch.no_grad():
            ref = hf(seq).logits[:, -1:]
        out = loaded.model.forward(nxt, torch.tensor([[seq.shape[1] - 1]]), slot, cache)
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v with biases
def test_fused_projections_keep_names_values_and_memory(arch: str) -> None:
    hf = _hf_model(arch).eval()
    cfg = read_llama(hf.config.to_dict() | {"architectures": [type(hf).__name__]})
    fused = build_llama(cfg, hf.state_dict().items())
    plain = build_llama(cfg, hf.state_dict().items(), fuse=False)
    att = fused.model.layers[0].self_attn
    assert att.qkv is not None and plain.model.layers[0].self_attn.qkv is None
    # every parameter is a view into the fused buffer: no second copy
    base = att.qkv.weight.data_ptr()
    assert att.q_proj.weight.data_ptr() == base
    assert att.k_proj.weight.data_ptr() == base + att.q_proj.weight.numel() * 4
    sd_f, sd_p = fused.state_dict(), plain.state_dict()
    assert sd_f.keys() == sd_p.keys()
    for name in sd_p:
        assert torch.equal(sd_f[name], sd_p[name]), name
    seq = torch.randint(0, VOCAB, (2, 7))
    outs = [m.forward(seq, torch.arange(7).expand(2, 7), torch.tensor([0, 1]),
                      m.make_cache(2, 32)) for m in (fused, plain)]
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


def test_rope_by_roll_is_rotate_half_bit_for_bit() -> None:
    torch.manual_seed(0)
    x, angles = torch.randn(3, 5, 12, 64), torch.randn(3, 5, 1, 32)
    cos = torch.cat((angles.cos(), angles.cos()), -1)
    sin = torch.cat((angles.sin(), angles.sin()), -1)
    x1, x2 = x.chunk(2, -1)
    reference = x * cos + torch.cat((-x2, x1), -1) * sin  # transformers' rotate_half form
    sin_signed = torch.cat((-angles.sin(), angles.sin()), -1)
    assert torch.equal(apply_rope(x, cos, sin_signed), reference)


@pytest.mark.parametrize("dtype,kernels", [("float32", "1"), ("float32", "0"), ("mixed16", "1"),
                                           ("quantized", "1")])
def test_a_lone_decode_step_takes_the_short_path_to_the_same_values(tiny_llama_dir, dtype,
                                                                     kernels, monkeypatch) -> None:
    """Bit for bit: in torch; and with nbserve's C kernels (float32, quantized), where the lone
    step's attention and a batch of one's run the same paged-attention kernel."""
    import nbserve
    from nbserve.execution.holders import runs_on_kernel
    from nbserve.models.decoder import DecoderLayer, DecoderModel, kernels_available

    if dtype == "quantized" and not kernels_available():
        pytest.skip("weights='blocks' needs nbserve's C kernels (a C compiler)")
    monkeypatch.setenv("NBSERVE_KERNELS", kernels)
    model = nbserve.load(str(tiny_llama_dir), verbose=False, **load_kwargs(dtype)).model
    in_c = runs_on_kernel(model.model.layers[0].self_attn.qkv)
    assert in_c == (dtype != "mixed16" and kernels == "1" and kernels_available())
    caches = [model.make_cache(3, 64), model.make_cache(3, 64)]
    prompt = torch.tensor([[3, 17, 5, 9, 11, 2]])
    for cache in caches:
        model.forward(prompt, torch.arange(6)[None], torch.tensor([2]), cache)
    lone_calls = []  # the short path: the layers' lone steps, or all of them in one C call
    real, real_stack = DecoderLayer.lone_step, DecoderModel._stacked_lone_step
    monkeypatch.setattr(DecoderLayer, "lone_step",
                        lambda self, *a: lone_calls.append(1) or real(self, *a))

    def stack(self, *a):
        out = real_stack(self, *a)
        lone_calls.extend([1] * (self.config.num_hidden_layers if out is not None else 0))
        return out
    monkeypatch.setattr(DecoderModel, "_stacked_lone_step", stack)
    token = torch.tensor([[7]])
    for pos in range(6, 11):
        short = model.forward(token, torch.tensor([[pos]]), torch.tensor([2]), caches[0],
                              logit_index=torch.zeros(1, dtype=torch.long), max_pos=pos,
                              contiguous_from=2)
        assert len(lone_calls) == model.config.num_hidden_layers * (pos - 5)
        general = model.forward(token, torch.tensor([[pos]]), torch.tensor([2]), caches[1],
                                logit_index=torch.zeros(1, dtype=torch.long))
        assert len(lone_calls) == model.config.num_hidden_layers * (pos - 5)  # not taken
        assert short.shape == general.shape == (1, model.vocab_size)
        assert torch.equal(short, general)  # in C both run the same paged kernel
        token = short.argmax(-1, keepdim=True)
    for a, b in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v):
        assert torch.equal(a, b)  # rope and the cache writes are the same ops, rounded the same
    no_index = model.forward(token, torch.tensor([[11]]), torch.tensor([2]), caches[0],
                             max_pos=11, contiguous_from=2)
    assert no_index.shape == (1, 1, model.vocab_size)  # (B, T, V) as the general path gives


def test_decode_attention_with_scale_and_mask_in_one_matmul_keeps_the_values() -> None:
    torch.manual_seed(0)
    cfg = read_llama({"architectures": ["LlamaForCausalLM"], "hidden_size": 48,
                               "num_attention_heads": 6, "num_key_value_heads": 2,
                               "intermediate_size": 64, "num_hidden_layers": 1,
                               "vocab_size": 32, "max_position_embeddings": 64})
    att = Attention(cfg, 0)
    b, d, hkv, g = 5, cfg.head_dim, 2, 3
    positions = torch.tensor([[3], [9], [0], [12], [7]])
    from nbserve.execution.kv_cache import PagedKVCache

    rows = PagedKVCache(1, 8, 64, hkv, d, "cpu", torch.float32, rows=8)
    step = StepInputs(positions, rows.row_tables(torch.arange(b)), 12, rows, kernel=False)
    cache_k = torch.randn(8, hkv, 64, d)
    cache_v = torch.randn(8, hkv, 64, d)
    keys, values = cache_k[:b, :, :13], cache_v[:b, :, :13]  # strided views, as the cache gives
    q = torch.randn(b, 1, hkv * g + hkv, d)[:, :, :hkv * g]  # a slice, as the fused qkv gives
    got = att._decode_attention(q, keys, values, step.decode_bias(hkv, g, q.dtype))
    qg = q.reshape(b, hkv, g, d)  # the former formulation: matmul, scale, masked fill
    scores = torch.matmul(qg, keys.transpose(-1, -2)) * (d ** -0.5)
    scores = scores.masked_fill(~step.mask, float("-inf"))
    want = torch.matmul(torch.softmax(scores, dim=-1), values).reshape(b, 1, hkv * g * d)
    assert torch.equal(got, want)
