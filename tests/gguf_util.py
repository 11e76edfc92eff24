"""Test helper: write a tiny Hugging Face checkpoint folder as a llama.cpp-style GGUF file.

It writes what llama.cpp's converter writes for the llama and qwen2 architectures: `{arch}.*`
hyperparameters, GGUF tensor names, the Q/K rows interleaved (llama only), 1-D tensors in F32,
a `rope_freqs.weight` tensor for Llama-3 RoPE scaling, and the tokenizer as metadata (tokens,
token types, merges, `pre`, special ids, add_bos, chat template; scores for sentencepiece).

Shapes: quantized weights are cut into blocks along each row, so every row length (hidden_size,
intermediate_size, num_attention_heads * head_dim) must be a multiple of 32 for Q4_0, Q4_1, Q5_0,
Q5_1 and Q8_0, and of 256 for the K-quants. The `gguf` package cannot quantize K-quants: for
Q2_K..Q6_K the 2-D weights are replaced by random valid blocks (seeded), so compare such a file
with another GGUF reader (transformers), not with the checkpoint.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType
from gguf import TokenType
from safetensors.numpy import load_file

ARCHS = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
QUANTIZABLE = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"}
RANDOM_BLOCKS = {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}
# Byte offsets of the float16 scale fields inside one block of each K-quant (ggml-common.h).
_K_SCALE_OFFSETS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2),
                    "Q6_K": (208,)}

_BLOCK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down"}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
           "output_norm.weight", "lm_head.weight": "output.weight"}

LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")


def hf_dir_to_gguf(hf_dir: str | Path, out_path: str | Path, qtype: str = "F32", *,
                   pre: str | None = None, write_merges: bool = True, seed: int = 0,
                   tensor_types: dict[str, str] | None = None) -> Path:
    """Convert `hf_dir` (config.json, *.safetensors, tokenizer.json, tokenizer_config.json).

    `qtype` applies to 2-D weights (1-D ones stay F32, as in llama.cpp); `tensor_types` overrides
    it per GGUF tensor name (any ggml type: those `gguf` cannot quantize get random blocks).
    `pre` overrides the inferred `tokenizer.ggml.pre`; `write_merges=False` drops the merges of a
    sentencepiece vocabulary so readers must rebuild them from the scores.
    """
    hf_dir, out_path = Path(hf_dir), Path(out_path)
    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = ARCHS[cfg["architectures"][0]]
    if qtype not in QUANTIZABLE | RANDOM_BLOCKS:
        raise ValueError(f"qtype {qtype!r} not in {sorted(QUANTIZABLE | RANDOM_BLOCKS)}")
    types = dict(tensor_types or {})
    writer = gguf.GGUFWriter(out_path, arch)
    writer.add_name(hf_dir.name)
    _write_hparams(writer, cfg, arch)
    _write_tokenizer(writer, hf_dir, cfg, pre, write_merges)
    _write_tensors(writer, hf_dir, cfg, arch, qtype, types, np.random.default_rng(seed))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


def llama_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order: within each head, rows (0, D/2, 1, D/2+1, ...)."""
    return (w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def llama3_rope_factors(rope: dict[str, Any], theta: float, head_dim: int) -> np.ndarray:
    """The `rope_freqs.weight` llama.cpp writes for Llama-3 scaling: one divisor per frequency."""
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    orig = rope["original_max_position_embeddings"]
    out = []
    for freq in inv:
        wavelen = 2 * math.pi / freq
        if wavelen < orig / high:
            out.append(1.0)
        elif wavelen > orig / low:
            out.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    params = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta") or params.get("rope_theta") or 10000.0
    scaling = cfg.get("rope_scaling") or (params if params.get("rope_type", "default") != "default"
                                          else None)
    return float(theta), scaling


def _write_hparams(writer: gguf.GGUFWriter, cfg: dict[str, Any], arch: str) -> None:
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    writer.add_context_length(cfg.get("max_position_embeddings", 2048))
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(cfg.get("num_key_value_heads") or heads)
    writer.add_layer_norm_rms_eps(cfg.get("rms_norm_eps", 1e-6))
    theta, scaling = _rope(cfg)
    writer.add_rope_freq_base(theta)
    if arch == "llama":
        writer.add_vocab_size(cfg["vocab_size"])
        writer.add_rope_dimension_count(head_dim)
    if "head_dim" in cfg:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if scaling and scaling.get("rope_type", scaling.get("type")) == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(scaling["factor"])


def _write_tensors(writer: gguf.GGUFWriter, hf_dir: Path, cfg: dict[str, Any], arch: str,
                   qtype: str, types: dict[str, str], rng: np.random.Generator) -> None:
    state: dict[str, np.ndarray] = {}
    for part in sorted(hf_dir.glob("*.safetensors")):
        state.update(load_file(part))
    if cfg.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    theta, scaling = _rope(cfg)
    if scaling and scaling.get("rope_type") == "llama3":
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(scaling, theta, head_dim))
    for name, w in state.items():
        w = w.astype(np.float32)
        if arch == "llama" and ".self_attn.q_proj." in name:
            w = llama_permute(w, heads)
        elif arch == "llama" and ".self_attn.k_proj." in name:
            w = llama_permute(w, kv_heads)
        gname = _gguf_name(name)
        _add(writer, gname, w, types.get(gname, qtype if w.ndim == 2 else "F32"), rng)


def _gguf_name(hf_name: str) -> str:
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)  # model.layers.{i}.{module}.{weight|bias}
    module, _, kind = rest.rpartition(".")
    return f"blk.{layer}.{_BLOCK[module]}.{kind}"


def _add(writer: gguf.GGUFWriter, name: str, w: np.ndarray, qtype: str,
         rng: np.random.Generator) -> None:
    if qtype == "F32":
        writer.add_tensor(name, w)
    elif qtype == "F16":
        writer.add_tensor(name, w.astype(np.float16))
    elif qtype in QUANTIZABLE:
        writer.add_tensor(name, gguf.quants.quantize(w, QType[qtype]), raw_dtype=QType[qtype])
    else:
        writer.add_tensor(name, random_blocks(w.shape, qtype, rng), raw_dtype=QType[qtype])


def random_blocks(shape: tuple[int, ...], qtype: str, rng: np.random.Generator) -> np.ndarray:
    """Random quantized bytes for a (rows, cols) tensor; K-quants get finite, small scales."""
    block, size = gguf.GGML_QUANT_SIZES[QType[qtype]]
    rows, cols = shape
    assert cols % block == 0, f"{qtype} needs rows of a multiple of {block}, got {cols}"
    data = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for offset in _K_SCALE_OFFSETS.get(qtype, ()):
        scale = rng.uniform(1e-3, 1e-2, size=(rows, cols // block)).astype(np.float16)
        data[..., offset:offset + 2] = scale.view(np.uint8).reshape(rows, cols // block, 2)
    return data.reshape(rows, cols // block * size)


def _write_tokenizer(writer: gguf.GGUFWriter, hf_dir: Path, cfg: dict[str, Any],
                     pre: str | None, write_merges: bool) -> None:
    tj = json.loads((hf_dir / "tokenizer.json").read_text(encoding="utf-8"))
    tc_path = hf_dir / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text(encoding="utf-8")) if tc_path.exists() else {}
    model = tj["model"]
    added = {t["id"]: t for t in tj.get("added_tokens", [])}
    ids = {**model["vocab"], **{t["content"]: i for i, t in added.items()}}
    n = max(cfg["vocab_size"], max(ids.values()) + 1)
    tokens = [f"[PAD{i}]" for i in range(n)]
    types = [TokenType.UNUSED] * n
    for text, i in model["vocab"].items():
        tokens[i], types[i] = text, TokenType.NORMAL
    sentencepiece = bool(model.get("byte_fallback"))
    for i, t in added.items():
        tokens[i] = t["content"]
        types[i] = TokenType.CONTROL if t["special"] else TokenType.USER_DEFINED
    if sentencepiece:
        for i, text in enumerate(tokens):
            if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
                types[i] = TokenType.BYTE
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    if sentencepiece:  # llama.cpp's "llama" vocab: scores rank the pieces (merged later = lower)
        made_at = {a + b: rank for rank, (a, b) in enumerate(m.split(" ", 1) for m in merges)}
        writer.add_tokenizer_model("llama")
        writer.add_token_scores([-float(made_at.get(t, -1) + 1) for t in tokens])
        writer.add_add_space_prefix(True)
        unk = model.get("unk_token")
        if unk in ids:
            writer.add_unk_token_id(ids[unk])
    else:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre or _infer_pre(tj))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if merges and (write_merges or not sentencepiece):
        writer.add_token_merges(merges)
    for key, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id)):
        text = tc.get(f"{key}_token")
        text = text.get("content") if isinstance(text, dict) else text
        token_id = ids.get(text) if text else cfg.get(f"{key}_token_id")
        if isinstance(token_id, list):
            token_id = token_id[0]
        if token_id is not None:
            add(token_id)
    if "add_bos_token" in tc:
        writer.add_add_bos_token(bool(tc["add_bos_token"]))
    if tc.get("chat_template"):
        writer.add_chat_template(tc["chat_template"])


def _infer_pre(tj: dict[str, Any]) -> str:
    """llama.cpp's name for the tokenizer.json's pre-tokenizer (it hashes a probe string)."""
    pt = tj.get("pre_tokenizer") or {}
    steps = pt.get("pretokenizers", [pt]) if pt.get("type") == "Sequence" else [pt]
    kinds = [s.get("type") for s in steps]
    if kinds == ["ByteLevel"]:
        return "gpt2"
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits"):
        return "smollm"
    if kinds == ["Split", "ByteLevel"]:
        regex = steps[0].get("pattern", {}).get("Regex")
        if regex == LLAMA3_REGEX:
            return "llama-bpe"
        if regex == QWEN2_REGEX:
            return "qwen2"
    raise ValueError(f"cannot name the pre-tokenizer {pt}; pass pre=...")
