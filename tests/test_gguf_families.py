"""GGUF files of every family read back as the Hugging Face checkpoint they were converted from.

For each architecture a tiny random transformers model is saved as a HF folder, written as GGUF
the way llama.cpp's converter writes it (gguf_util.py), and read with read_gguf: the config
holds the config.json keys with the same values (compared through the transformers config
class, which normalizes old and new spellings), every tensor has its HF name and value, a
transformers model loaded from (hf_config, tensors) computes the original's logits, and the
rebuilt tokenizer encodes like the original tokenizer.json. Also: a Gemma-style SentencePiece
vocabulary, quantized experts, and the refusals of what nbserve would misread.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import transformers
from family_checks import cached_reference, check_steps, inputs
from gguf_util import GPT4O_REGEX, LLAMA3_REGEX, QWEN2_REGEX, hf_dir_to_gguf
from safetensors.torch import load_file, save_file
from tiny_models import (
    IM_END_ID,
    IM_START_ID,
    SMOLLM2_TEMPLATE,
    make_byte_fallback_tokenizer,
    make_tiny_tokenizer,
)
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    processors,
    trainers,
)
from tokenizers import pre_tokenizers as pre
from transformers.tokenization_utils_base import generate_merges

from nbserve.loading.gguf import read_gguf, read_quant_blocks
from nbserve.models import registry
from nbserve.models.families import gemma
from nbserve.models.family import GGUFKeys

TEXTS = [
    "Hello, world! What's the capital of France? I'LL say it's Paris.",
    "café naïve Ångström façade, e\u0301 composed",
    "你好，世界！今天天气很好。こんにちは",
    "Emoji: 😀 🎉 👍🏽 👨‍👩‍👧 🇫🇷",
    "Numbers 1234567 and 3.14159, 2024-11-30 CamelCaseWords don't",
    "  leading spaces\ttabs\r\n\nnew lines   ",
    "",
]

_COMMON: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
    bos_token_id=IM_START_ID, eos_token_id=IM_END_ID, pad_token_id=None,
    initializer_range=0.1, tie_word_embeddings=False)
_GEMMA_IDS = dict(bos_token_id=2, eos_token_id=1, pad_token_id=0)


def _longrope(n: int) -> dict[str, Any]:
    return {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(n)],
            "long_factor": [1.5 + 0.2 * i for i in range(n)]}


# case -> (config class, config kwargs, tokenizer style, GGUF architecture). Every value here is
# one the GGUF format carries (e.g. Gemma's query_pre_attn_scalar = head_dim, as llama.cpp
# assumes for all but the 27B models; Qwen3-MoE's norm_topk_prob = True, as llama.cpp computes).
CASES: dict[str, tuple[Any, dict[str, Any], str, str]] = {
    "qwen3": (transformers.Qwen3Config, _COMMON | dict(head_dim=32), "qwen2", "qwen3"),
    "qwen3_yarn": (transformers.Qwen3Config, _COMMON | dict(rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
        "qwen2", "qwen3"),
    "qwen3_moe": (transformers.Qwen3MoeConfig, _COMMON | dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        tie_word_embeddings=True), "qwen2", "qwen3moe"),
    "mixtral": (transformers.MixtralConfig, _COMMON | dict(
        num_local_experts=4, num_experts_per_tok=2, intermediate_size=64,
        rope_theta=1e6), "spm", "llama"),
    "gemma2": (transformers.Gemma2Config, _COMMON | _GEMMA_IDS | dict(
        num_hidden_layers=3, sliding_window=8, query_pre_attn_scalar=16,
        attn_logit_softcapping=5.0, final_logit_softcapping=3.0, tie_word_embeddings=True),
        "gemma", "gemma2"),
    "gemma3": (transformers.Gemma3TextConfig, _COMMON | _GEMMA_IDS | dict(
        num_hidden_layers=7, sliding_window=8, query_pre_attn_scalar=16,
        final_logit_softcapping=3.0, tie_word_embeddings=True, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 20000.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}}),
        "gemma", "gemma3"),
    "phi3": (transformers.Phi3Config, _COMMON | dict(
        partial_rotary_factor=0.5, original_max_position_embeddings=32,
        rope_scaling=_longrope(4), sliding_window=48), "gpt-4o", "phi3"),
    "phi4_mini": (transformers.Phi3Config, _COMMON | dict(
        partial_rotary_factor=0.75, tie_word_embeddings=True), "gpt-4o", "phi3"),
    "gpt2": (transformers.GPT2Config, dict(
        n_embd=64, n_layer=2, n_head=4, n_positions=256, bos_token_id=IM_START_ID,
        eos_token_id=IM_END_ID, initializer_range=0.1), "gpt-2", "gpt2"),
    "olmo2": (transformers.Olmo2Config, _COMMON, "dbrx", "olmo2"),
    "smollm3": (transformers.SmolLM3Config, _COMMON | dict(
        num_hidden_layers=4, tie_word_embeddings=True, rope_theta=2e6), "llama-bpe", "smollm3"),
}
_DECODER_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                 "rms_norm_eps", "tie_word_embeddings", "bos_token_id", "rope_parameters")
# Config keys compared per case (besides _DECODER_KEYS): transformers attribute names.
KEYS = {
    "qwen3": ("head_dim", "attention_bias", "use_sliding_window", "sliding_window",
              "layer_types"),
    "qwen3_yarn": ("head_dim",),
    "qwen3_moe": ("head_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"),
    "mixtral": ("num_local_experts", "num_experts_per_tok", "sliding_window"),
    "gemma2": ("head_dim", "sliding_window", "layer_types", "attn_logit_softcapping",
               "final_logit_softcapping", "query_pre_attn_scalar", "hidden_activation",
               "pad_token_id"),
    "gemma3": ("head_dim", "sliding_window", "layer_types", "final_logit_softcapping",
               "attn_logit_softcapping", "query_pre_attn_scalar", "hidden_activation",
               "pad_token_id"),
    "phi3": ("partial_rotary_factor", "original_max_position_embeddings", "sliding_window"),
    "phi4_mini": ("partial_rotary_factor", "sliding_window"),
    "gpt2": ("vocab_size", "n_embd", "n_layer", "n_head", "n_positions", "n_inner",
             "layer_norm_epsilon", "activation_function", "bos_token_id", "tie_word_embeddings"),
    "olmo2": ("attention_bias",),
    "smollm3": ("no_rope_layers", "no_rope_layer_interval", "use_sliding_window",
                "layer_types"),
}
# Pre-tokenizer names the helper cannot infer from tokenizer.json (OLMo 2's is "dbrx", a
# cl100k vocabulary split like Llama 3's).
_PRE = {"dbrx": "dbrx"}
# --- tokenizers -------------------------------------------------------------------------------

_GEMMA_CORPUS = """\
Hello, world! What is the capital of France? The capital of France is Paris.
The quick brown fox jumps over the lazy dog. It was the best of times.
def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i)
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14159
Café, naïve, résumé, façade. 你好，世界！
<h1>Title</h1> some text in a heading, and more text.
"""
GEMMA_SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
# Added tokens Gemma's tokenizer does not call special (llama.cpp's converter makes <mask>,
# [@BOS@] and <unusedN> control tokens anyway), and user-defined pieces.
GEMMA_NOT_SPECIAL = ["<mask>", "[@BOS@]", "<unused0>", "<unused1>"]
GEMMA_USER = ["<h1>", "</h1>"]


def make_gemma_tokenizer() -> Tokenizer:
    """A Gemma-layout SentencePiece vocabulary as HF's GemmaConverter writes tokenizer.json:
    spaces replaced by "\u2581" (no dummy prefix), no pre-splitting, BPE with byte fallback
    and merges generated from the piece scores, specials and <bos> added by the post-processor."""
    alphabet = ["\u2581", "\n", *map(chr, range(33, 127)), "é", "好"]
    trainer = trainers.BpeTrainer(vocab_size=420, initial_alphabet=alphabet,
                                  limit_alphabet=len(alphabet), show_progress=False)
    base = Tokenizer(models.BPE())
    base.normalizer = normalizers.Replace(" ", "\u2581")
    base.pre_tokenizer = pre.Metaspace(replacement="\u2581", prepend_scheme="never")
    base.train_from_iterator(_GEMMA_CORPUS.splitlines(keepends=True) * 3, trainer)
    trained = json.loads(base.to_str())["model"]["vocab"]
    pieces = GEMMA_SPECIAL + GEMMA_NOT_SPECIAL + GEMMA_USER + [f"<0x{b:02X}>" for b in range(256)]
    scores = {p: 0.0 for p in pieces}
    for piece, rank in sorted(trained.items(), key=lambda kv: kv[1]):
        scores.setdefault(piece, -float(rank))
    vocab = {p: i for i, p in enumerate(scores)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=generate_merges(vocab, scores),
                               unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre.Split(" ", "merged_with_previous")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse()])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in GEMMA_SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t in GEMMA_NOT_SPECIAL + GEMMA_USER])
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", 2)])
    return tok


def styled_tokenizer(style: str) -> tuple[Tokenizer, dict[str, Any]]:
    """(tokenizer.json, tokenizer_config extras) of a tokenizer splitting text like `style`."""
    if style == "gemma":
        return make_gemma_tokenizer(), {"bos_token": "<bos>", "eos_token": "<eos>",
                                        "pad_token": "<pad>", "unk_token": "<unk>",
                                        "add_bos_token": True, "add_eos_token": False}
    if style == "spm":  # Llama 2 / Mistral / Mixtral: <s> added by the post-processor
        tok = make_byte_fallback_tokenizer()
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
        return tok, {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                     "add_bos_token": True}
    tok = make_tiny_tokenizer()
    regex = {"qwen2": QWEN2_REGEX, "llama-bpe": LLAMA3_REGEX, "dbrx": LLAMA3_REGEX,
             "gpt-4o": GPT4O_REGEX}
    if style in regex:
        tok.pre_tokenizer = pre.Sequence([pre.Split(Regex(regex[style]), "isolated"),
                                          pre.ByteLevel(add_prefix_space=False, use_regex=False)])
    if style == "qwen2":
        tok.normalizer = normalizers.NFC()
    if style in ("llama-bpe", "dbrx"):  # Llama-3 style vocabularies: whole words first
        tok.model.ignore_merges = True
    return tok, {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": False}


def make_case_dir(case: str, path: Path, seed: int = 0, vocab_extra: int = 0,
                  overrides: dict[str, Any] | None = None) -> Path:
    """A random tiny model of `case` (its config with `overrides`) and its styled tokenizer,
    saved as a HF folder (norm weights perturbed so Gemma's +1 and every norm is checked on
    non-trivial values)."""
    config_cls, kwargs, style, _ = CASES[case]
    tok, tc = styled_tokenizer(style)
    config = config_cls(vocab_size=tok.get_vocab_size() + vocab_extra,
                        **(kwargs | (overrides or {})))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 1:
                    p.add_(torch.randn_like(p) * 0.1)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": SMOLLM2_TEMPLATE, **tc}))
    return path


@pytest.fixture(scope="module")
def case_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {case: make_case_dir(case, root / case) for case in CASES}


def _logits(model_dir: Path, ids: list[int]) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


# --- every family: config, tensors, logits, tokenizer -----------------------------------------


@pytest.mark.parametrize("case", sorted(CASES))
def test_gguf_reads_as_the_checkpoint(case_dirs, tmp_path, case):
    hf = case_dirs[case]
    ckpt = read_gguf(hf_dir_to_gguf(hf, tmp_path / "m.gguf", pre=_PRE.get(CASES[case][2])))
    src = json.loads((hf / "config.json").read_text())
    cfg = ckpt.hf_config
    assert cfg["architectures"] == src["architectures"] and cfg["model_type"] == src["model_type"]

    # The config: config.json's keys, equal once transformers has read both dicts.
    original = transformers.AutoConfig.from_pretrained(hf)
    rebuilt = type(original)(**cfg)
    keys = KEYS[case] + (_DECODER_KEYS if case != "gpt2" else ())
    for key in keys:
        assert getattr(rebuilt, key) == getattr(original, key), key
        assert key in cfg or key == "rope_parameters", key  # spelled as config.json spells it
    eos = src["eos_token_id"]
    assert cfg["eos_token_id"][0] == (eos[0] if isinstance(eos, list) else eos)

    # The tensors: the safetensors' names, values equal in float32 (Gemma's norms came back
    # from w + 1: equal once 1 is added again, as Gemma's RMSNorm does, and within 1 ulp of 1).
    want = load_file(hf / "model.safetensors")
    got = dict(ckpt.tensors)
    assert sorted(got) == sorted(want) and len(ckpt.tensors) == len(want)
    shifted = case.startswith("gemma")
    for name, w in want.items():
        assert got[name].shape == w.shape, name
        if shifted and name.endswith("norm.weight"):
            assert torch.equal(got[name] + 1, w + 1), name
            torch.testing.assert_close(got[name], w, atol=2.0 ** -23, rtol=0, msg=name)
        else:
            assert torch.equal(got[name], w), name

    # A transformers model from (hf_config, tensors) computes the original's logits.
    rebuilt_dir = tmp_path / "rebuilt"
    rebuilt_dir.mkdir()
    (rebuilt_dir / "config.json").write_text(json.dumps(cfg))
    save_file(got, str(rebuilt_dir / "model.safetensors"))
    ids = [1, 5, 70, 300, 12, 2, 9, 40, 41, 42, 43, 44, 45, 46, 47, 48, 7]
    torch.testing.assert_close(_logits(rebuilt_dir, ids), _logits(hf, ids))

    # The tokenizer: the same ids as tokenizer.json, specials included.
    original_tok = Tokenizer.from_file(str(hf / "tokenizer.json"))
    for text in TEXTS:
        assert ckpt.tokenizer.encode(text).ids == original_tok.encode(text).ids, text


@pytest.mark.parametrize("case", sorted(CASES))
def test_load_gguf_computes_the_checkpoint(case_dirs, tmp_path, case):
    """The family nbserve registers for the file serves it: logits as transformers'."""
    family = registry.for_class_name(json.loads(
        (case_dirs[case] / "config.json").read_text())["architectures"][0])
    if family is None:
        pytest.skip(f"no nbserve family serves {case} yet")
    from nbserve.loading.gguf import load_gguf

    loaded = load_gguf(hf_dir_to_gguf(case_dirs[case], tmp_path / "m.gguf"))
    # prefill and 16 cached decode steps against transformers' own cached generation
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        case_dirs[case], dtype=torch.float32, attn_implementation="eager").eval()
    seq, steps = inputs(loaded.model.vocab_size, 4)
    check_steps(loaded.model, seq, steps, cached_reference(hf, seq, steps), f"{case} gguf")


# --- the Gemma vocabulary ---------------------------------------------------------------------

GEMMA_TEXTS = TEXTS + [
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n4<end_of_turn>\n",
    "<h1>Title</h1>\n\nsome  text   with    runs of spaces",
    " one leading space, trailing one ",
    "<mask> and <unused0> stay single tokens; [@BOS@] too",
    "tabs\tand\ttab\t\tpairs, \u00e9\u00e9 and \u597d\u597d and unseen \u00df\u00f8",
    "\n\n\n",
]


def test_gemma_sentencepiece_vocabulary(tmp_path):
    hf = make_case_dir("gemma2", tmp_path / "hf")
    path = hf_dir_to_gguf(hf, tmp_path / "m.gguf")
    reader = gguf.GGUFReader(str(path))
    fields = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    # what llama.cpp's converter writes for Gemma: a "llama" vocabulary without dummy prefix,
    # no merges, <mask>/<unusedN> as control tokens, user-defined pieces and byte pieces
    assert fields["tokenizer.ggml.model"] == "llama" and not fields[
        "tokenizer.ggml.add_space_prefix"]
    assert "tokenizer.ggml.merges" not in fields and fields["tokenizer.ggml.add_bos_token"]
    types = dict(zip(fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"]))
    assert {types[t] for t in GEMMA_SPECIAL + GEMMA_NOT_SPECIAL} == {gguf.TokenType.CONTROL}
    assert {types[t] for t in GEMMA_USER} == {gguf.TokenType.USER_DEFINED}
    assert types["<0x0A>"] == gguf.TokenType.BYTE

    ckpt = read_gguf(path)
    original = Tokenizer.from_file(str(hf / "tokenizer.json"))
    assert ckpt.add_bos_token and ckpt.bos_token == "<bos>" and ckpt.eos_token == "<eos>"
    assert ckpt.eos_token_ids == [1, original.token_to_id("<end_of_turn>")]
    for text in GEMMA_TEXTS:
        want = original.encode(text)
        assert ckpt.tokenizer.encode(text).ids == want.ids, text
        assert ckpt.tokenizer.encode(text, add_special_tokens=False).ids == \
            original.encode(text, add_special_tokens=False).ids, text
        assert ckpt.tokenizer.decode(want.ids, skip_special_tokens=False) == \
            original.decode(want.ids, skip_special_tokens=False), text
    turn = original.encode("<start_of_turn>user\nhi<end_of_turn>", add_special_tokens=False).ids
    assert turn[0] == original.token_to_id("<start_of_turn>")
    assert ckpt.tokenizer.decode(turn, skip_special_tokens=True) == \
        original.decode(turn, skip_special_tokens=True) == "user\nhi"


def test_gemma3_embedding_is_cut_to_the_vocabulary(tmp_path):
    """The converter drops Gemma 3's embedding rows past the vocabulary (the real models have
    262208 rows for 262144 tokens): the file reads with vocab_size = its token count."""
    hf = make_case_dir("gemma3", tmp_path / "hf", vocab_extra=5)
    ckpt = read_gguf(hf_dir_to_gguf(hf, tmp_path / "m.gguf"))
    want = load_file(hf / "model.safetensors")["model.embed_tokens.weight"]
    n = Tokenizer.from_file(str(hf / "tokenizer.json")).get_vocab_size()
    assert want.shape[0] == n + 5 and ckpt.hf_config["vocab_size"] == n
    assert torch.equal(dict(ckpt.tensors)["model.embed_tokens.weight"], want[:n])


@pytest.mark.parametrize("layers,hidden,heads,head_dim,scalar,period", [
    (42, 3584, 16, 256, 256, 46),  # gemma-2-9b's config.json
    (46, 4608, 32, 128, 144, 46),  # gemma-2-27b
    (26, 1152, 4, 256, 256, 62),  # gemma-3-1b
    (62, 5376, 32, 128, 168, 62),  # gemma-3-27b
])
def test_gemma_query_scalar_as_llama_cpp_takes_it(layers, hidden, heads, head_dim, scalar,
                                                  period):
    cfg = {"num_hidden_layers": layers, "hidden_size": hidden, "num_attention_heads": heads,
           "head_dim": head_dim}
    assert gemma.attention_scalar(cfg, period) == scalar


def test_sliding_pattern_given_per_layer(case_dirs, tmp_path):
    """A `sliding_window_pattern` array (as newer converters write for OLMo 3 and others)
    names each layer's kind; a period is read as llama.cpp reads it (last layer of each full)."""
    path = hf_dir_to_gguf(case_dirs["gemma2"], tmp_path / "a.gguf",
                          metadata={"gemma2.attention.sliding_window_pattern": [True, True, False]})
    cfg = read_gguf(path).hf_config
    assert cfg["layer_types"] == ["sliding_attention", "sliding_attention", "full_attention"]
    path = hf_dir_to_gguf(case_dirs["gemma3"], tmp_path / "b.gguf",
                          metadata={"gemma3.attention.sliding_window_pattern": 3})
    cfg = read_gguf(path).hf_config
    assert cfg["layer_types"] == ["sliding_attention", "sliding_attention", "full_attention"] * 2 \
        + ["sliding_attention"] and cfg["sliding_window_pattern"] == 3


# --- experts, quantized -----------------------------------------------------------------------


@pytest.mark.parametrize("case", ["qwen3_moe", "mixtral"])
def test_quantized_experts(case_dirs, tmp_path, case):
    hf = case_dirs[case]
    path = hf_dir_to_gguf(hf, tmp_path / "m.gguf", "Q8_0")
    stacked = [t for t in gguf.GGUFReader(str(path)).tensors if t.name.endswith("_exps.weight")]
    assert stacked and all(len(t.shape) == 3 and t.tensor_type == gguf.GGMLQuantizationType.Q8_0
                           for t in stacked)
    got = dict(read_gguf(path).tensors)
    blocks = read_quant_blocks(path)
    qt = gguf.GGMLQuantizationType.Q8_0
    for name, w in load_file(hf / "model.safetensors").items():
        if w.ndim == 1 or ".gate." in name:  # norms and routers stay F32
            assert torch.equal(got[name], w), name
            continue
        exact = gguf.quants.dequantize(gguf.quants.quantize(w.numpy(), qt), qt)
        torch.testing.assert_close(got[name], torch.from_numpy(exact), atol=1e-6, rtol=0)
        assert blocks[name].shape == tuple(w.shape), name
    experts = [n for n in got if ".experts." in n]
    assert len(experts) == 2 * 3 * 4 and set(experts) <= set(blocks)


# --- refusals ---------------------------------------------------------------------------------


def _bare(path: Path, arch: str) -> Path:
    writer = gguf.GGUFWriter(path, arch)
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file,
                 writer.write_tensors_to_file, writer.close):
        step()
    return path


def test_unknown_architecture_lists_the_served_ones(tmp_path):
    with pytest.raises(ValueError, match=r"architecture 'mamba'; nbserve reads") as info:
        read_gguf(_bare(tmp_path / "m.gguf", "mamba"))
    for arch in registry.gguf_architectures():
        assert f" {arch}," in str(info.value) or f" {arch} (" in str(info.value), arch


@pytest.mark.parametrize("case,key,value,match", [
    ("qwen3", "qwen3.rope.dimension_count", 8, r"qwen3\.rope\.dimension_count.*part of the 32"),
    ("qwen3", "qwen3.attention.value_length", 16, r"qwen3\.attention\.value_length"),
    ("qwen3", "qwen3.attention.head_count_kv", [2, 1], r"qwen3\.attention\.head_count_kv per l"),
    ("qwen3", "qwen3.logit_scale", 0.5, r"qwen3\.logit_scale"),
    ("qwen3_moe", "qwen3moe.expert_gating_func", 2, r"qwen3moe\.expert_gating_func"),
    ("olmo2", "olmo2.attention.sliding_window", 16, r"olmo2\.attention\.sliding_window.*OLMo 3"),
    ("gemma3", "gemma3.attn_logit_softcapping", 50.0, r"gemma3\.attn_logit_softcapping"),
])
def test_refuses_what_it_would_misread(case_dirs, tmp_path, case, key, value, match):
    path = hf_dir_to_gguf(case_dirs[case], tmp_path / "m.gguf", metadata={key: value})
    with pytest.raises(ValueError, match=match):
        read_gguf(path)


def test_refuses_a_stray_tensor(case_dirs, tmp_path):
    path = hf_dir_to_gguf(case_dirs["gemma2"], tmp_path / "m.gguf",
                          extra_tensors={"output.weight": np.zeros((4, 64), np.float32)})
    with pytest.raises(ValueError, match=r"unexpected tensor 'output.weight'.*'gemma2'"):
        read_gguf(path)


# --- a family's GGUF identity lives in its family file ------------------------------------------


def test_a_registered_familys_gguf_layout_is_what_the_loader_reads(case_dirs, tmp_path,
                                                                   monkeypatch):
    """A family registered with its own `GGUFLayout` for an architecture is read through that
    layout: its key reader and its tensor names, nothing repeated in loading/."""
    registry.families()
    monkeypatch.setattr(registry, "_FAMILIES", list(registry._FAMILIES))
    qwen3 = next(f for f in registry.families() if f.name == "qwen3")
    (layout,) = qwen3.gguf
    seen: list[int] = []

    def read_keys(keys: GGUFKeys, cfg: dict[str, Any]) -> None:
        assert layout.read_keys is not None
        layout.read_keys(keys, cfg)
        seen.append(keys.get_int("block_count"))
        cfg["rope_theta"] = 12345.0

    registry.register(dataclasses.replace(
        qwen3, gguf=(dataclasses.replace(layout, read_keys=read_keys),)))
    ckpt = read_gguf(hf_dir_to_gguf(case_dirs["qwen3"], tmp_path / "m.gguf"))
    assert seen == [ckpt.hf_config["num_hidden_layers"]]
    assert ckpt.hf_config["rope_theta"] == 12345.0
    assert registry.gguf_layout("qwen3") is not layout

    # a family that stops declaring the architecture: files of it are refused, listed as unread
    registry.register(dataclasses.replace(qwen3, gguf=()))
    assert "qwen3" not in registry.gguf_architectures()
    with pytest.raises(ValueError, match=r"architecture 'qwen3'; nbserve reads"):
        read_gguf(hf_dir_to_gguf(case_dirs["qwen3"], tmp_path / "n.gguf"))


def test_a_gguf_llama_with_experts_reads_as_mixtral() -> None:
    layouts = {(arch, n): registry.gguf_layout(arch, n)
               for arch, n in (("llama", 0), ("llama", 8), ("qwen3moe", 8), ("mamba", 0))}
    names = {k: None if v is None else v.hf_architecture for k, v in layouts.items()}
    assert names == {("llama", 0): "LlamaForCausalLM", ("llama", 8): "MixtralForCausalLM",
                     ("qwen3moe", 8): "Qwen3MoeForCausalLM", ("mamba", 0): None}
