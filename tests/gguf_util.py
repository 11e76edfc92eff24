"""Test helper: write a tiny Hugging Face checkpoint folder as a llama.cpp-style GGUF file.

It writes what llama.cpp's converter (convert_hf_to_gguf.py) writes for the llama (Llama,
Mistral, Mixtral), qwen2, qwen3, qwen3moe, smollm3, olmo2, gemma2, gemma3, phi3 and gpt2
architectures: `{arch}.*` hyperparameters (only those the converter writes: Gemma 2's
query_pre_attn_scalar, SmolLM3's no-RoPE layers or Qwen3-MoE's norm_topk_prob are left to
llama.cpp's defaults), GGUF tensor names from `gguf`'s name map, and the converter's tensor
changes: Q/K rows interleaved (llama, smollm3), experts stacked into one 3-D tensor per
projection, Gemma's norms stored +1 (and Gemma 3's embedding cut to the vocabulary), GPT-2's
Conv1D weights transposed, Llama-3 `rope_freqs` and Phi-3 LongRoPE factor tensors. 1-D tensors,
norms, routers and position embeddings stay F32. The tokenizer goes in as metadata (tokens, token
types, merges, `pre`, special ids, add_bos, chat template; scores for sentencepiece).

Shapes: quantized weights are cut into blocks along each row, so every row length (hidden_size,
intermediate_size, num_attention_heads * head_dim) must be a multiple of 32 for Q4_0, Q4_1, Q5_0,
Q5_1 and Q8_0, and of 256 for the K-quants. The `gguf` package cannot quantize K-quants: for
Q2_K..Q6_K, IQ4_NL and IQ4_XS the 2-D weights are replaced by random valid blocks (seeded), so
compare such a file with another GGUF reader (transformers), not with the checkpoint.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType
from gguf import TokenType
from safetensors.numpy import load_file

ARCHS = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama",
         "MixtralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
         "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3moe",
         "SmolLM3ForCausalLM": "smollm3", "Olmo2ForCausalLM": "olmo2",
         "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3",
         "Phi3ForCausalLM": "phi3", "GPT2LMHeadModel": "gpt2"}
PERMUTED = {"llama", "smollm3"}  # the converter's LlamaModel subclasses (undo_permute = True)
QUANTIZABLE = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"}
RANDOM_BLOCKS = {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"}
# Byte offsets of the float16 scale fields inside one block of each K-quant and IQ4 type
# (ggml-common.h).
_K_SCALE_OFFSETS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2),
                    "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,)}
_ARCH_ENUM = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}
_EXPERT = re.compile(r"(model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts)\.(\d+)\.(\w+)"
                     r"\.weight")

LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")
GPT4O_REGEX = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
               r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+"
               r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def hf_dir_to_gguf(hf_dir: str | Path, out_path: str | Path, qtype: str = "F32", *,
                   pre: str | None = None, write_merges: bool = True, seed: int = 0,
                   tensor_types: dict[str, str] | None = None,
                   metadata: dict[str, Any] | None = None,
                   extra_tensors: dict[str, np.ndarray] | None = None) -> Path:
    """Convert `hf_dir` (config.json, *.safetensors, tokenizer.json, tokenizer_config.json).

    `qtype` applies to 2-D and 3-D weights (1-D ones, norms, routers and position embeddings
    stay F32, as in llama.cpp); `tensor_types` overrides it per GGUF tensor name (any ggml type:
    those `gguf` cannot quantize get random blocks). `pre` overrides the inferred
    `tokenizer.ggml.pre`; `write_merges=False` drops the merges of a sentencepiece vocabulary so
    readers must rebuild them from the scores. `metadata` adds or replaces keys (ints as
    UINT32, floats as FLOAT32, lists as arrays) and `extra_tensors` adds tensors, to make files
    the converter would not.
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
    for key, value in (metadata or {}).items():
        writer.add_key_value(key, value, _value_type(value), sub_type=_value_type(value[0])
                             if isinstance(value, list) else None)
    for name, w in (extra_tensors or {}).items():
        writer.add_tensor(name, w)
    n_tokens = _write_tokenizer(writer, hf_dir, cfg, arch, pre, write_merges)
    _write_tensors(writer, hf_dir, cfg, arch, qtype, types, np.random.default_rng(seed), n_tokens)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


def _value_type(value: Any) -> gguf.GGUFValueType:
    for kind, vtype in ((bool, gguf.GGUFValueType.BOOL), (int, gguf.GGUFValueType.UINT32),
                        (float, gguf.GGUFValueType.FLOAT32), (str, gguf.GGUFValueType.STRING),
                        (list, gguf.GGUFValueType.ARRAY)):
        if isinstance(value, kind):
            return vtype
    raise TypeError(f"no GGUF type for {value!r}")


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


def _rope(cfg: dict[str, Any]) -> dict[str, Any]:
    """The converter's `rope_parameters` (a transformers-5 dict, or the older top-level keys)."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if "full_attention" not in params and "sliding_attention" not in params:
        for key in ("rope_theta", "partial_rotary_factor", "original_max_position_embeddings"):
            if key not in params and cfg.get(key) is not None:
                params[key] = cfg[key]
        if "rope_type" not in params and "type" in params:
            params["rope_type"] = params["type"]
        if cfg.get("rope_local_base_freq") is not None:
            params["sliding_attention"] = {"rope_theta": cfg["rope_local_base_freq"]}
    return params


def _full(params: dict[str, Any]) -> dict[str, Any]:
    return params.get("full_attention", params)


def _write_hparams(writer: gguf.GGUFWriter, cfg: dict[str, Any], arch: str) -> None:
    if arch == "gpt2":  # GPT2Model.set_gguf_parameters
        writer.add_block_count(cfg["n_layer"])
        writer.add_context_length(cfg.get("n_ctx", cfg["n_positions"]))
        writer.add_embedding_length(cfg["n_embd"])
        writer.add_feed_forward_length(4 * cfg["n_embd"])
        writer.add_head_count(cfg["n_head"])
        writer.add_layer_norm_eps(cfg["layer_norm_epsilon"])
        return
    params = _rope(cfg)
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim")
    if arch == "phi3":  # Phi3MiniModel.set_gguf_parameters: no TextModel keys
        rope_dims = int(params.get("partial_rotary_factor", 1.0) * cfg["hidden_size"]) // heads
        writer.add_context_length(cfg["max_position_embeddings"])
        writer.add_rope_scaling_orig_ctx_len(params["original_max_position_embeddings"])
        writer.add_embedding_length(cfg["hidden_size"])
        writer.add_feed_forward_length(cfg["intermediate_size"])
        writer.add_block_count(cfg["num_hidden_layers"])
        writer.add_head_count(heads)
        writer.add_head_count_kv(cfg["num_key_value_heads"])
        writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
        writer.add_rope_dimension_count(rope_dims)
        writer.add_rope_freq_base(_full(params)["rope_theta"])
        writer.add_sliding_window(cfg.get("sliding_window") or 0)
        if params.get("long_factor"):  # generate_extra_tensors: LongRoPE's attention factor
            scale = cfg["max_position_embeddings"] / params["original_max_position_embeddings"]
            orig = params["original_max_position_embeddings"]
            writer.add_rope_scaling_attn_factors(
                math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0)
        return
    if arch == "gemma2":  # Gemma2Model.set_gguf_parameters: no RoPE base, no pattern
        writer.add_context_length(cfg["max_position_embeddings"])
        writer.add_embedding_length(cfg["hidden_size"])
        writer.add_block_count(cfg["num_hidden_layers"])
        writer.add_feed_forward_length(cfg["intermediate_size"])
        writer.add_head_count(heads)
        writer.add_head_count_kv(cfg.get("num_key_value_heads") or heads)
        writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        writer.add_sliding_window(cfg["sliding_window"])
        return
    _text_model_hparams(writer, cfg, params)
    if arch in PERMUTED:  # LlamaModel.set_gguf_parameters
        writer.add_vocab_size(cfg["vocab_size"])
        writer.add_rope_dimension_count(head_dim or cfg["hidden_size"] // heads)
    if arch == "qwen3moe" and cfg.get("moe_intermediate_size") is not None:
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if arch == "gemma3":  # Gemma3Model.set_gguf_parameters, after TextModel's
        if _full(params).get("rope_theta") is None:  # (TextModel wrote the one there is)
            writer.add_rope_freq_base(1_000_000.0)
        if cfg.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        if cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern")) != 1:
            writer.add_sliding_window(cfg["sliding_window"])
    if arch == "olmo2" and "sliding_window" in cfg:
        writer.add_sliding_window(cfg["sliding_window"])
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])


def _text_model_hparams(writer: gguf.GGUFWriter, cfg: dict[str, Any],
                        params: dict[str, Any]) -> None:
    """TextModel.set_gguf_parameters: the keys every plain decoder gets."""
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg.get("max_position_embeddings", 2048))
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    if cfg.get("num_key_value_heads") is not None:
        writer.add_head_count_kv(cfg["num_key_value_heads"])
    full = _full(params)
    kind, factor = full.get("rope_type"), full.get("factor")
    if kind == "linear" and factor is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(factor)
    elif kind == "yarn" and factor is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(factor)
        writer.add_rope_scaling_orig_ctx_len(full["original_max_position_embeddings"])
        for key, add in (("attention_factor", writer.add_rope_scaling_yarn_attn_factor),
                         ("beta_fast", writer.add_rope_scaling_yarn_beta_fast),
                         ("beta_slow", writer.add_rope_scaling_yarn_beta_slow)):
            if full.get(key) is not None:
                add(full[key])
    if full.get("rope_theta") is not None:
        writer.add_rope_freq_base(full["rope_theta"])
    local = params.get("sliding_attention", {}).get("rope_theta")
    if local is not None:
        writer.add_rope_freq_base_swa(local)
    if cfg.get("rms_norm_eps") is not None:
        writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    experts = cfg.get("num_local_experts", cfg.get("num_experts"))
    if experts is not None:
        writer.add_expert_count(experts)
    if cfg.get("num_experts_per_tok") is not None:
        writer.add_expert_used_count(cfg["num_experts_per_tok"])
    if cfg.get("head_dim") is not None:
        writer.add_key_length(cfg["head_dim"])
        writer.add_value_length(cfg["head_dim"])


def _write_tensors(writer: gguf.GGUFWriter, hf_dir: Path, cfg: dict[str, Any], arch: str,
                   qtype: str, types: dict[str, str], rng: np.random.Generator,
                   n_tokens: int) -> None:
    state: dict[str, np.ndarray] = {}
    for part in sorted(hf_dir.glob("*.safetensors")):
        state.update(load_file(part))
    if cfg.get("tie_word_embeddings", arch == "gpt2") or arch == "gemma2":
        state.pop("lm_head.weight", None)
    blocks = cfg.get("num_hidden_layers", cfg.get("n_layer"))
    tmap = gguf.get_tensor_name_map(_ARCH_ENUM[arch], blocks)
    for name, w in _extra_tensors(cfg, arch):
        writer.add_tensor(name, w)
    experts: dict[str, dict[int, np.ndarray]] = {}
    for name, w in state.items():
        w = _modify(name, w.astype(np.float32), cfg, arch, n_tokens)
        match = _EXPERT.fullmatch(name)
        if match:  # stacked per (layer, projection) once every expert is in, as the converter
            group = experts.setdefault(f"{match[1]}.{match[4]}", {})
            group[int(match[3])] = w
            if len(group) < cfg.get("num_local_experts", cfg.get("num_experts")):
                continue
            w = np.stack([group[e] for e in sorted(group)])
            name = f"{match[1]}.{match[4]}.weight"
        base, _, suffix = name.rpartition(".")
        gname = tmap.get_name(base)
        assert gname is not None, name
        gname = f"{gname}.{suffix}"
        keep_f32 = w.ndim == 1 or gname.endswith("_norm.weight") or \
            gname.split(".")[-2] in ("ffn_gate_inp", "position_embd")
        _add(writer, gname, w, types.get(gname, "F32" if keep_f32 else qtype), rng)


def _modify(name: str, w: np.ndarray, cfg: dict[str, Any], arch: str,
            n_tokens: int) -> np.ndarray:
    """The converter's modify_tensors for one HF tensor (before experts are stacked)."""
    if arch in PERMUTED and name.endswith(("q_proj.weight", "q_proj.bias")):
        w = llama_permute(w, cfg["num_attention_heads"])
    elif arch in PERMUTED and name.endswith(("k_proj.weight", "k_proj.bias")):
        w = llama_permute(w, cfg["num_key_value_heads"])
    if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
        w = w + np.float32(1.0)
    if arch == "gemma3" and "embed_tokens.weight" in name:
        w = w[:n_tokens]  # the rows beyond the vocabulary are dropped
    if arch == "gpt2" and name.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight")):
        w = np.ascontiguousarray(w.T)
    return w


def _extra_tensors(cfg: dict[str, Any], arch: str) -> list[tuple[str, np.ndarray]]:
    """generate_extra_tensors: Llama-3's rope_freqs, Phi-3's LongRoPE factors."""
    if arch == "gpt2":
        return []
    params = _full(_rope(cfg))
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    kind = params.get("rope_type", "")
    if arch in PERMUTED and kind == "llama3":
        theta = params.get("rope_theta", 10000.0)
        return [("rope_freqs.weight", llama3_rope_factors(params, theta, head_dim))]
    if arch == "phi3" and params.get("long_factor"):
        return [("rope_factors_long.weight", np.array(params["long_factor"], np.float32)),
                ("rope_factors_short.weight", np.array(params["short_factor"], np.float32))]
    return []


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
    """Random quantized bytes for a (rows, cols) tensor, or a stack of them (experts: (n,
    rows, cols)); K-quants get finite, small scales."""
    block, size = gguf.GGML_QUANT_SIZES[QType[qtype]]
    *lead, cols = shape
    rows = int(np.prod(lead))
    assert cols % block == 0, f"{qtype} needs rows of a multiple of {block}, got {cols}"
    data = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for offset in _K_SCALE_OFFSETS.get(qtype, ()):
        scale = rng.uniform(1e-3, 1e-2, size=(rows, cols // block)).astype(np.float16)
        data[..., offset:offset + 2] = scale.view(np.uint8).reshape(rows, cols // block, 2)
    return data.reshape(*lead, cols // block * size)


def looks_special(text: str) -> bool:
    """The converter's does_token_look_special: added tokens it marks CONTROL though the
    tokenizer does not call them special (Gemma's <mask>, <unusedN>; any <|...|>)."""
    return text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or \
        (text.startswith("<|") and text.endswith("|>")) or \
        (text.startswith("<unused") and text.endswith(">"))


def _write_tokenizer(writer: gguf.GGUFWriter, hf_dir: Path, cfg: dict[str, Any], arch: str,
                     pre: str | None, write_merges: bool) -> int:
    """The vocabulary as metadata; returns the number of real tokens (Gemma 3 cuts to it)."""
    tj = json.loads((hf_dir / "tokenizer.json").read_text(encoding="utf-8"))
    tc_path = hf_dir / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text(encoding="utf-8")) if tc_path.exists() else {}
    model = tj["model"]
    added = {t["id"]: t for t in tj.get("added_tokens", [])}
    ids = {**model["vocab"], **{t["content"]: i for i, t in added.items()}}
    n = max(cfg["vocab_size"], max(ids.values()) + 1)
    if arch == "gemma3":  # the converter cuts the embedding to the tokenizer's pieces
        n = max(ids.values()) + 1
    tokens = [f"[PAD{i}]" for i in range(n)]
    types = [TokenType.UNUSED] * n
    for text, i in model["vocab"].items():
        tokens[i], types[i] = text, TokenType.NORMAL
    sentencepiece = bool(model.get("byte_fallback"))
    for i, t in added.items():
        if t["special"] or looks_special(t["content"]):
            tokens[i], types[i] = t["content"], TokenType.CONTROL
        else:  # user-defined pieces are stored pre-normalized: "\u2581" back to " "
            tokens[i], types[i] = t["content"].replace("\u2581", " "), TokenType.USER_DEFINED
    if sentencepiece:
        for i, text in enumerate(tokens):
            if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
                types[i] = TokenType.BYTE
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    if sentencepiece:  # llama.cpp's "llama" vocab: scores rank the pieces (merged later = lower)
        made_at = {a + b: rank for rank, (a, b) in enumerate(m.split(" ", 1) for m in merges)}
        scores = [-float(made_at.get(t, -1) + 1) for t in tokens]
        for i in added:  # _create_vocab_sentencepiece gives added tokens -1000
            scores[i] = -1000.0
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_scores(scores)
        writer.add_add_space_prefix(arch not in ("gemma2", "gemma3"))
        unk = model.get("unk_token")
        if unk in ids:
            writer.add_unk_token_id(ids[unk])
    else:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre or _infer_pre(tj))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if merges and (write_merges or not sentencepiece) and not arch.startswith("gemma"):
        writer.add_token_merges(merges)
    for key, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id),
                     ("pad", writer.add_pad_token_id)):
        text = tc.get(f"{key}_token")
        text = text.get("content") if isinstance(text, dict) else text
        token_id = ids.get(text) if text else cfg.get(f"{key}_token_id")
        if isinstance(token_id, list):
            token_id = token_id[0]
        if token_id is not None:
            add(token_id)
    for key, add in (("add_bos_token", writer.add_add_bos_token),
                     ("add_eos_token", writer.add_add_eos_token)):
        if key in tc:
            add(bool(tc[key]))
    if tc.get("chat_template"):
        writer.add_chat_template(tc["chat_template"])
    return n


def _infer_pre(tj: dict[str, Any]) -> str:
    """llama.cpp's name for the tokenizer.json's pre-tokenizer (it hashes a probe string)."""
    pt = tj.get("pre_tokenizer") or {}
    steps = pt.get("pretokenizers", [pt]) if pt.get("type") == "Sequence" else [pt]
    kinds = [s.get("type") for s in steps]
    if kinds == ["ByteLevel"]:
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits"):
        return "smollm"
    if kinds == ["Split", "ByteLevel"]:
        regex = steps[0].get("pattern", {}).get("Regex")
        named = {LLAMA3_REGEX: "llama-bpe", QWEN2_REGEX: "qwen2", GPT4O_REGEX: "gpt-4o"}
        if regex in named:
            return named[regex]
    raise ValueError(f"cannot name the pre-tokenizer {pt}; pass pre=...")


def q4_k_m_llama_tensors(layers: int, hidden: int, ffn: int, heads: int, kv_heads: int,
                         vocab: int, embedding: str = "Q6_K", head: str | None = None
                         ) -> list[tuple[str, tuple[int, ...], str]]:
    """(GGUF name, torch-order shape, type) of every tensor of a Llama laid out as llama.cpp's
    Q4_K_M lays it out: Q4_K q/k/o/gate/up, Q6_K v/down, F32 norms; the embedding in
    `embedding`, and an untied LM head in `head` (None: tied)."""
    kv = hidden // heads * kv_heads
    out = [("token_embd.weight", (vocab, hidden), embedding),
           ("output_norm.weight", (hidden,), "F32")]
    if head is not None:
        out.append(("output.weight", (vocab, hidden), head))
    for i in range(layers):
        out += [(f"blk.{i}.attn_norm.weight", (hidden,), "F32"),
                (f"blk.{i}.attn_q.weight", (hidden, hidden), "Q4_K"),
                (f"blk.{i}.attn_k.weight", (kv, hidden), "Q4_K"),
                (f"blk.{i}.attn_v.weight", (kv, hidden), "Q6_K"),
                (f"blk.{i}.attn_output.weight", (hidden, hidden), "Q4_K"),
                (f"blk.{i}.ffn_norm.weight", (hidden,), "F32"),
                (f"blk.{i}.ffn_gate.weight", (ffn, hidden), "Q4_K"),
                (f"blk.{i}.ffn_up.weight", (ffn, hidden), "Q4_K"),
                (f"blk.{i}.ffn_down.weight", (hidden, ffn), "Q6_K")]
    return out


def llama_writer(path: str | Path, name: str, layers: int, hidden: int, ffn: int, heads: int,
                 kv_heads: int, vocab: int, context: int = 4096, rope_base: float = 10000.0
                 ) -> gguf.GGUFWriter:
    """A GGUFWriter with a Llama's hyperparameters and a placeholder byte-level vocabulary of
    `vocab` tokens written in: the caller adds the tensors (or their infos) and closes it."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name(name)
    writer.add_context_length(context)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(rope_base)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([f"t{i}" for i in range(vocab)])
    writer.add_token_types([gguf.TokenType.NORMAL] * vocab)
    writer.add_token_merges([])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    return writer
