"""Per GGUF architecture: metadata -> config.json keys, GGUF tensors -> HF names and values.

llama.cpp's converter (convert_hf_to_gguf.py) writes each architecture its own way: which
hyperparameters it keeps, which it leaves to llama.cpp's defaults (Gemma 2's softcaps and
sliding pattern, SmolLM3's no-RoPE layers, Qwen3-MoE's normalized top-k), and what it does to
tensors (Q/K rows interleaved for llama and smollm3, Gemma's norms stored +1, GPT-2's Conv1D
weights transposed, experts stacked into one 3-D tensor per projection). This module undoes
that, so a file reads as the Hugging Face checkpoint it came from. GGUF tensor names come from
the `gguf` package's own map (`gguf.get_tensor_name_map`), asked with each layout's HF names.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGUFReader, ReaderTensor, TokenType
from gguf.quants import dequantize

# Tensors that only carry configuration (folded into rope_scaling), never served as weights.
CONFIG_ONLY = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}
# Control tokens that end a turn although the file does not name them eos/eot (as llama.cpp does).
END_OF_TURN_TEXTS = {"<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>",
                     "<|endoftext|>", "<|end_of_text|>", "<EOT>"}


class Meta:
    """Metadata values by key, decoded on first use (token lists are large)."""

    def __init__(self, reader: GGUFReader) -> None:
        self._fields = reader.fields
        self._cache: dict[str, Any] = {}

    def get(self, key: str, default: Any = None) -> Any:
        if key not in self._fields:
            return default
        if key not in self._cache:
            self._cache[key] = self._fields[key].contents()
        return self._cache[key]

    def __contains__(self, key: str) -> bool:
        return key in self._fields


def f32(value: float) -> float:
    """A float32 from the file as the short decimal it was written from (1e-06, not 9.99e-07)."""
    return float(str(np.float32(value)))


# --- layouts: the HF modules of each model type, and what the converter did to them ----------

_ATTN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
_QK_NORM = ("self_attn.q_norm", "self_attn.k_norm")
_MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_NORMS = ("input_layernorm", "post_attention_layernorm")
_GEMMA_NORMS = _NORMS + ("pre_feedforward_layernorm", "post_feedforward_layernorm")
_TOP = ("model.embed_tokens", "model.norm", "lm_head")


@dataclass(frozen=True, slots=True)
class Layout:
    """One HF model type's tensor names. `{xid}` in a block module marks one of a stack of
    experts (GGUF keeps them as one 3-D tensor, first axis the expert)."""

    model_type: str
    hf_architecture: str
    top: tuple[str, ...]
    block_prefix: str
    block: tuple[str, ...]
    permuted_qk: bool = False  # llama.cpp's RoPE row order (LlamaModel.permute in the converter)
    norm_shift: float = 0.0  # added to every `*norm.weight` by the converter (Gemma: 1)
    conv1d: tuple[str, ...] = ()  # Conv1D weights (in, out) the converter transposed (GPT-2)


_L = "model.layers.{bid}."
LAYOUTS = {
    "llama": Layout("llama", "LlamaForCausalLM", _TOP, _L, _NORMS + _ATTN + _MLP,
                    permuted_qk=True),
    "mixtral": Layout("mixtral", "MixtralForCausalLM", _TOP, _L, _NORMS + _ATTN + (
        "block_sparse_moe.gate", "block_sparse_moe.experts.{xid}.w1",
        "block_sparse_moe.experts.{xid}.w2", "block_sparse_moe.experts.{xid}.w3"),
        permuted_qk=True),
    "qwen2": Layout("qwen2", "Qwen2ForCausalLM", _TOP, _L, _NORMS + _ATTN + _MLP),
    "qwen3": Layout("qwen3", "Qwen3ForCausalLM", _TOP, _L, _NORMS + _ATTN + _QK_NORM + _MLP),
    "qwen3_moe": Layout("qwen3_moe", "Qwen3MoeForCausalLM", _TOP, _L, _NORMS + _ATTN + _QK_NORM + (
        "mlp.gate", "mlp.experts.{xid}.gate_proj", "mlp.experts.{xid}.up_proj",
        "mlp.experts.{xid}.down_proj")),
    "smollm3": Layout("smollm3", "SmolLM3ForCausalLM", _TOP, _L, _NORMS + _ATTN + _MLP,
                      permuted_qk=True),
    "olmo2": Layout("olmo2", "Olmo2ForCausalLM", _TOP, _L, (
        "post_attention_layernorm", "post_feedforward_layernorm") + _ATTN + _QK_NORM + _MLP),
    "gemma2": Layout("gemma2", "Gemma2ForCausalLM", _TOP, _L, _GEMMA_NORMS + _ATTN + _MLP,
                     norm_shift=1.0),
    "gemma3_text": Layout("gemma3_text", "Gemma3ForCausalLM", _TOP, _L,
                          _GEMMA_NORMS + _ATTN + _QK_NORM + _MLP, norm_shift=1.0),
    "phi3": Layout("phi3", "Phi3ForCausalLM", _TOP, _L, _NORMS + (
        "self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")),
    "gpt2": Layout("gpt2", "GPT2LMHeadModel", (
        "transformer.wte", "transformer.wpe", "transformer.ln_f", "lm_head"),
        "transformer.h.{bid}.", ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc",
                                 "mlp.c_proj"),
        conv1d=("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")),
}
# GGUF architecture -> the layout of its dense files (llama with experts reads as Mixtral).
GGUF_LAYOUTS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe",
                "smollm3": "smollm3", "olmo2": "olmo2", "gemma2": "gemma2",
                "gemma3": "gemma3_text", "phi3": "phi3", "gpt2": "gpt2"}


def layout_of(arch: str, expert_count: int) -> Layout | None:
    """The layout a file of GGUF architecture `arch` reads as; None if nbserve has none."""
    if arch == "llama" and expert_count:
        return LAYOUTS["mixtral"]
    name = GGUF_LAYOUTS.get(arch)
    return LAYOUTS[name] if name else None


@functools.cache
def _gguf_to_hf(arch: str, model_type: str) -> tuple[dict[str, str], dict[str, str]]:
    """(top-level, per-block) GGUF name -> HF module, from `gguf`'s name map for `arch`."""
    layout = LAYOUTS[model_type]
    tmap = gguf.get_tensor_name_map({v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch], 1)
    top: dict[str, str] = {}
    for module in layout.top:
        name = tmap.get_name(module)
        if name is None:  # Gemma 2 has no output tensor: its head is always the embedding
            continue
        top[name] = module
    block: dict[str, str] = {}
    for module in layout.block:
        name = tmap.get_name(layout.block_prefix.format(bid=0) + module.replace(".{xid}", ""))
        if name is None or not name.startswith("blk.0.") or name[6:] in block:
            raise RuntimeError(f"gguf's {arch} name map has no own name for {module!r}")
        block[name[6:]] = module
    return top, block


@dataclass(frozen=True, slots=True)
class Rule:
    """How one GGUF tensor becomes HF tensors: `hf_names` holds one name, or one per expert
    (the tensor is a stack along its first axis)."""

    hf_names: tuple[str, ...]
    heads: int = 0  # undo llama.cpp's Q/K row interleave with this many heads
    shift: float = 0.0  # subtract what the converter added
    transpose: bool = False  # back to a Conv1D (in, out) weight

    def apply(self, w: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        if self.heads:
            w = unpermute_qk(w, self.heads)
        if self.shift:
            w = w - self.shift
        if self.transpose:
            w = w.T.contiguous()
        if len(self.hf_names) == 1:
            yield self.hf_names[0], w
        else:
            yield from zip(self.hf_names, w.unbind(0))


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order: per head it stores rows (0, D/2, 1, D/2+1, ...)."""
    rows = w.shape[0]  # (H*D, ...) -> (H, D/2, 2, ...) -> (H, 2, D/2, ...)
    return (w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2)
            .reshape(w.shape))


def tensor_rule(t: ReaderTensor, arch: str, cfg: dict[str, Any]) -> Rule | None:
    """The rule for GGUF tensor `t` of a file read as `cfg`; None if the layout has no such
    tensor."""
    layout = LAYOUTS[cfg["model_type"]]
    top, block = _gguf_to_hf(arch, layout.model_type)
    base, _, suffix = t.name.rpartition(".")
    parts = base.split(".")
    if base in top:
        module = top[base]
    elif len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in block \
            and int(parts[1]) < cfg.get("num_hidden_layers", cfg.get("n_layer", 0)):
        module = layout.block_prefix.format(bid=parts[1]) + block[parts[2]]
    else:
        return None
    names: tuple[str, ...] = (f"{module}.{suffix}",)
    if "{xid}" in module:
        if len(t.shape) != 3:
            return None
        names = tuple(f"{module.format(xid=e)}.{suffix}" for e in range(int(t.shape[2])))
    heads = 0
    if layout.permuted_qk and parts[-1] in ("attn_q", "attn_k"):
        heads = cfg["num_attention_heads"] if parts[-1] == "attn_q" else cfg["num_key_value_heads"]
    shift = layout.norm_shift if f"{module}.{suffix}".endswith("norm.weight") else 0.0
    transpose = suffix == "weight" and any(module.endswith("." + c) for c in layout.conv1d)
    return Rule(names, heads, shift, transpose)


# --- metadata -> config.json keys -------------------------------------------------------------


class _Keys:
    """`{arch}.*` metadata with the refusals every reader needs (missing, per-layer arrays)."""

    def __init__(self, meta: Meta, arch: str, path: Path) -> None:
        self.meta, self.arch, self.path = meta, arch, path

    def key(self, name: str) -> str:
        return f"{self.arch}.{name}"

    def has(self, name: str) -> bool:
        return self.key(name) in self.meta

    def raw(self, name: str, default: Any = None) -> Any:
        return self.meta.get(self.key(name), default)

    def _scalar(self, name: str, default: Any) -> Any:
        value = self.raw(name, default)
        if isinstance(value, list):
            raise ValueError(f"{self.path} gives {self.key(name)} per layer ({value[:4]}...); "
                             "nbserve reads one value for all layers")
        return value

    def need(self, name: str) -> Any:
        value = self._scalar(name, None)
        if value is None:
            raise ValueError(f"{self.path} lacks the metadata key {self.key(name)}; "
                             "is it a complete file?")
        return value

    def int(self, name: str, default: int | None = None) -> int | None:
        value = self._scalar(name, default)
        return None if value is None else int(value)

    def float(self, name: str, default: float | None = None) -> float | None:
        value = self._scalar(name, default)
        return None if value is None else f32(value)

    def refuse(self, name: str, why: str) -> None:
        raise ValueError(f"{self.path} has {self.key(name)} = {self.raw(name)!r}: {why}")


# Keys that change the computation in ways no supported layout has: refused when present with
# a value other than the neutral one (None: any value).
_UNSUPPORTED: dict[str, Any] = {
    "attention.scale": None, "logit_scale": None, "embedding_scale": None,
    "residual_scale": None, "attention.clamp_kqv": None, "attention.max_alibi_bias": 0.0,
    "use_parallel_residual": False, "attention.causal": True, "rope.dimension_sections": None,
    "expert_shared_count": 0, "expert_shared_feed_forward_length": 0, "expert_group_count": 0,
    "leading_dense_block_count": 0, "expert_weights_scale": 1.0, "router_logit_softcapping": 0.0,
    "interleave_moe_layer_step": None, "attention.shared_kv_layers": 0,
    "nextn_predict_layers": 0, "rope.scaling.yarn_log_multiplier": 0.0,
}


def hf_config(meta: Meta, arch: str, hf_architecture: str, by_name: dict[str, ReaderTensor],
              path: Path) -> dict[str, Any]:
    """config.json-style dict from `{arch}.*` keys, tensor shapes and special-token ids, with
    the keys the model type's config.json holds."""
    keys = _Keys(meta, arch, path)
    experts = int(keys.raw("expert_count") or 0)
    layout = layout_of(arch, experts)
    if layout is None:
        raise ValueError(f"{path}: nbserve has no reader for GGUF architecture {arch!r}")
    for name, neutral in _UNSUPPORTED.items():
        if keys.has(name) and (neutral is None or keys.raw(name) != neutral):
            keys.refuse(name, "nbserve's model does not compute this")
    if "token_embd.weight" not in by_name:
        raise ValueError(f"{path} has no token_embd.weight tensor; is it a complete model file?")
    if layout.model_type == "gpt2":
        cfg = _gpt2(keys, by_name)
    else:
        cfg = _decoder(keys, layout, by_name)
        _SPECIFIC.get(layout.model_type, lambda k, c, b: None)(keys, cfg, by_name)
    arch_name = hf_architecture if layout.model_type != "mixtral" else layout.hf_architecture
    return {"architectures": [arch_name], "model_type": layout.model_type, **cfg,
            **_special_ids(meta)}


def _rows(by_name: dict[str, ReaderTensor], name: str) -> int:
    return int(by_name[name].shape[1])  # GGUF shapes are (ne0, ne1): ne1 counts rows


def _decoder(keys: _Keys, layout: Layout, by_name: dict[str, ReaderTensor]) -> dict[str, Any]:
    """The keys every RoPE decoder here shares (Llama's config.json names)."""
    hidden, heads = int(keys.need("embedding_length")), int(keys.need("attention.head_count"))
    head_dim = keys.int("attention.key_length") or hidden // heads
    value_dim = keys.int("attention.value_length") or head_dim
    if value_dim != head_dim:
        keys.refuse("attention.value_length", f"values of another size than keys ({head_dim})")
    for name in ("attention.key_length_swa", "attention.value_length_swa"):
        if keys.has(name) and keys.int(name) != head_dim:
            keys.refuse(name, "sliding-window layers with another head size")
    rope_dim = keys.int("rope.dimension_count")
    if rope_dim is not None and rope_dim != head_dim and layout.model_type != "phi3":
        keys.refuse("rope.dimension_count", f"RoPE over part of the {head_dim} head dimensions, "
                                            f"which {layout.hf_architecture} does not do")
    if keys.has("rope.dimension_count_swa") and keys.int("rope.dimension_count_swa") != rope_dim:
        keys.refuse("rope.dimension_count_swa", "another RoPE size in sliding-window layers")
    theta = keys.float("rope.freq_base", 10000.0)
    assert theta is not None
    return {
        "vocab_size": _rows(by_name, "token_embd.weight"),
        "hidden_size": hidden,
        "intermediate_size": int(keys.need("feed_forward_length")),
        "num_hidden_layers": int(keys.need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": keys.int("attention.head_count_kv") or heads,
        "head_dim": head_dim,
        "max_position_embeddings": keys.int("context_length", 2048),
        "rms_norm_eps": f32(keys.need("attention.layer_norm_rms_epsilon")),
        "rope_theta": theta,
        "rope_scaling": rope_scaling(keys, by_name.get("rope_freqs.weight"), theta, head_dim),
        "tie_word_embeddings": "output.weight" not in by_name,
        "attention_bias": "blk.0.attn_q.bias" in by_name or "blk.0.attn_qkv.bias" in by_name,
    }


def _no_sliding_window(cfg: dict[str, Any]) -> None:
    cfg.update(use_sliding_window=False, sliding_window=None,
               layer_types=["full_attention"] * cfg["num_hidden_layers"])


def _qwen3(keys: _Keys, cfg: dict[str, Any], by_name: dict[str, ReaderTensor]) -> None:
    _no_sliding_window(cfg)


def _moe(keys: _Keys, cfg: dict[str, Any], by_name: dict[str, ReaderTensor]) -> tuple[int, int]:
    """(experts, experts per token), every layer checked to route (no dense layers between)."""
    experts, used = keys.int("expert_count") or 0, keys.int("expert_used_count") or 0
    if not experts or not used:
        raise ValueError(f"{keys.path} lacks {keys.key('expert_count')} or "
                         f"{keys.key('expert_used_count')}; is it a complete file?")
    dense = [i for i in range(cfg["num_hidden_layers"]) if f"blk.{i}.ffn_gate_inp.weight"
             not in by_name]
    if dense:
        raise ValueError(f"{keys.path}: layers {dense} have no router (blk.N.ffn_gate_inp); "
                         "nbserve reads files whose every layer routes to experts")
    gating = keys.int("expert_gating_func", int(gguf.ExpertGatingFuncType.SOFTMAX))
    if gating != gguf.ExpertGatingFuncType.SOFTMAX:
        keys.refuse("expert_gating_func", "experts weighted otherwise than by a softmax")
    return experts, used


def _qwen3_moe(keys: _Keys, cfg: dict[str, Any], by_name: dict[str, ReaderTensor]) -> None:
    experts, used = _moe(keys, cfg, by_name)
    # llama.cpp always renormalizes the top-k weights of qwen3moe (norm_topk_prob: true in
    # every Qwen3-MoE), and routes in every layer; the converter writes neither.
    norm = keys.raw("expert_weights_norm", True)
    gate = by_name.get("blk.0.ffn_gate_exps.weight")
    size = keys.int("expert_feed_forward_length") or (int(gate.shape[1]) if gate else None)
    if size is None:
        raise ValueError(f"{keys.path} lacks {keys.key('expert_feed_forward_length')}")
    cfg.update(num_experts=experts, num_experts_per_tok=used, moe_intermediate_size=size,
               norm_topk_prob=bool(norm), decoder_sparse_step=1, mlp_only_layers=[])
    _no_sliding_window(cfg)


def _mixtral(keys: _Keys, cfg: dict[str, Any], by_name: dict[str, ReaderTensor]) -> None:
    experts, used = _moe(keys, cfg, by_name)
    if not keys.raw("expert_weights_norm", True):
        keys.refuse("expert_weights_norm", "Mixtral renormalizes the top-k expert weights")
    cfg.update(num_local_experts=experts, num_experts_per_tok=used, sliding_window=None,
               intermediate_size=keys.int("expert_feed_forward_length")
               or cfg["intermediate_size"])


def _smollm3(keys: _Keys, cfg: dict[str, Any], by_name: dict[str, ReaderTensor]) -> None:
    # llama.cpp skips RoPE in every 4th layer of smollm3 (n_no_rope_layer_step = 4), as the
    # HF default no_rope_layers does; the converter writes no key for it.
    n = cfg["num_hidden_layers"]
    cfg.update(no_rope_layers=[int((i + 1) % 4 != 0) for i in range(n)],
               no_rope_layer_interval=4, mlp_bias=False)
    _no_sliding_window(cfg)


def _olmo2(keys: _Keys, cfg: dict[str, Any], by_name: dict[str, ReaderTensor]) -> None:
    if keys.has("attention.sliding_window"):
        keys.refuse("attention.sliding_window", "sliding-window layers (OLMo 3), not OLMo 2")


def _layer_types(keys: _Keys, n_layers: int, default_period: int) -> tuple[list[str], int | None]:
    """Sliding/full per layer as llama.cpp reads `attention.sliding_window_pattern` (an array
    of bools, or a period whose last layer is full), and the period when there is one."""
    value = keys.raw("attention.sliding_window_pattern", default_period)
    if isinstance(value, list):
        if len(value) != n_layers:
            keys.refuse("attention.sliding_window_pattern", f"not one flag per layer ({n_layers})")
        sliding = [bool(v) for v in value]
        period = next((p for p in range(1, n_layers + 1) if sliding == [
            i % p < p - 1 for i in range(n_layers)]), None)
    else:
        period = int(value)
        sliding = [period == 0 or i % period < period - 1 for i in range(n_layers)]
    return ["sliding_attention" if s else "full_attention" for s in sliding], period


def _attention_scalar(cfg: dict[str, Any], n_layers_27b: int) -> int:
    """Gemma's query_pre_attn_scalar as llama.cpp takes it (no key is written): hidden / heads
    for the 27B models, the head size for the others."""
    if cfg["num_hidden_layers"] == n_layers_27b:
        return cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["head_dim"]


def _gemma(keys: _Keys, cfg: dict[str, Any]) -> None:
    cfg.update(hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh")


def _gemma2(keys: _Keys, cfg: dict[str, Any], by_name: dict[str, ReaderTensor]) -> None:
    _gemma(keys, cfg)
    layer_types, _ = _layer_types(keys, cfg["num_hidden_layers"], 2)
    cfg.update(
        sliding_window=keys.int("attention.sliding_window", 4096), layer_types=layer_types,
        attn_logit_softcapping=keys.float("attn_logit_softcapping"),
        final_logit_softcapping=keys.float("final_logit_softcapping"),
        query_pre_attn_scalar=_attention_scalar(cfg, 46))
    if keys.float("rope.freq_base_swa", cfg["rope_theta"]) != cfg["rope_theta"]:
        keys.refuse("rope.freq_base_swa", "another RoPE base in Gemma 2's sliding layers")


def _gemma3(keys: _Keys, cfg: dict[str, Any], by_name: dict[str, ReaderTensor]) -> None:
    _gemma(keys, cfg)
    if keys.has("attn_logit_softcapping"):
        keys.refuse("attn_logit_softcapping", "Gemma 3 has no attention softcapping")
    window = keys.int("attention.sliding_window") or 0
    if window:
        layer_types, period = _layer_types(keys, cfg["num_hidden_layers"], 6)
    else:
        layer_types, period = ["full_attention"] * cfg["num_hidden_layers"], 1
    cfg.update(
        sliding_window=window or None, layer_types=layer_types, attn_logit_softcapping=None,
        final_logit_softcapping=keys.float("final_logit_softcapping"),
        rope_local_base_freq=keys.float("rope.freq_base_swa", 10000.0),
        query_pre_attn_scalar=_attention_scalar(cfg, 62))
    if period is not None:
        cfg["sliding_window_pattern"] = period


def _phi3(keys: _Keys, cfg: dict[str, Any], by_name: dict[str, ReaderTensor]) -> None:
    rope_dim = keys.int("rope.dimension_count") or cfg["head_dim"]
    orig = keys.int("rope.scaling.original_context_length") or cfg["max_position_embeddings"]
    cfg.update(partial_rotary_factor=rope_dim / cfg["head_dim"],
               original_max_position_embeddings=orig,
               sliding_window=keys.int("attention.sliding_window") or None,
               rope_scaling=_longrope(keys, by_name, cfg["max_position_embeddings"], orig,
                                      rope_dim))


def _longrope(keys: _Keys, by_name: dict[str, ReaderTensor], n_ctx: int, orig: int,
              rope_dim: int) -> dict[str, Any] | None:
    """Phi-3's LongRoPE: the long/short factor tensors the converter writes (no type key)."""
    long, short = by_name.get("rope_factors_long.weight"), by_name.get("rope_factors_short.weight")
    if long is None and short is None:
        return None
    if long is None or short is None:
        raise ValueError(f"{keys.path} has only one of rope_factors_long/short")
    factors = [[f32(x) for x in dequantize(t.data, t.tensor_type).reshape(-1)]
               for t in (long, short)]
    if any(len(f) != rope_dim // 2 for f in factors):
        raise ValueError(f"{keys.path}: rope_factors_long/short are not {rope_dim // 2} long")
    out: dict[str, Any] = {"rope_type": "longrope", "long_factor": factors[0],
                           "short_factor": factors[1]}
    scale = n_ctx / orig  # the attention factor HF derives by default; kept only if another
    default = math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0
    attn = keys.float("rope.scaling.attn_factor")
    if attn is not None and not math.isclose(attn, default, rel_tol=1e-6):
        out["attention_factor"] = attn
    return out


_SPECIFIC: dict[str, Callable[[_Keys, dict[str, Any], dict[str, ReaderTensor]], None]] = {
    "qwen3": _qwen3, "qwen3_moe": _qwen3_moe, "mixtral": _mixtral, "smollm3": _smollm3,
    "olmo2": _olmo2, "gemma2": _gemma2, "gemma3_text": _gemma3, "phi3": _phi3,
}


def _gpt2(keys: _Keys, by_name: dict[str, ReaderTensor]) -> dict[str, Any]:
    """GPT-2's own config.json names (n_embd, n_head, ...)."""
    hidden = int(keys.need("embedding_length"))
    heads = int(keys.need("attention.head_count"))
    if (keys.int("attention.head_count_kv") or heads) != heads:
        keys.refuse("attention.head_count_kv", "GPT-2 has as many K/V heads as query heads")
    ff = int(keys.need("feed_forward_length"))
    return {
        "vocab_size": _rows(by_name, "token_embd.weight"),
        "n_embd": hidden, "n_layer": int(keys.need("block_count")), "n_head": heads,
        "n_positions": _rows(by_name, "position_embd.weight") if "position_embd.weight"
        in by_name else keys.int("context_length", 1024),
        "n_inner": None if ff == 4 * hidden else ff,
        "layer_norm_epsilon": f32(keys.need("attention.layer_norm_epsilon")),
        "activation_function": "gelu_new",
        "tie_word_embeddings": "output.weight" not in by_name,
    }


def _special_ids(meta: Meta) -> dict[str, Any]:
    """bos, eos (with the control tokens that end a turn, as llama.cpp stops on them) and pad."""
    tokens = meta.get("tokenizer.ggml.tokens") or []
    types = meta.get("tokenizer.ggml.token_type") or []
    eos = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    eos += [i for i, (tok, ty) in enumerate(zip(tokens, types))
            if ty == TokenType.CONTROL and tok in END_OF_TURN_TEXTS]
    pad = meta.get("tokenizer.ggml.padding_token_id")
    return {"bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": list(dict.fromkeys(int(i) for i in eos if i is not None)),
            "pad_token_id": None if pad is None else int(pad)}


def rope_scaling(keys: _Keys, freqs: ReaderTensor | None, theta: float,
                 head_dim: int) -> dict[str, Any] | None:
    """HF rope_scaling from `rope.scaling.*` keys or, for Llama 3, the `rope_freqs` factors."""
    kind = keys.raw("rope.scaling.type")
    if kind and kind != "none":  # linear / yarn: passed on; the model config decides support
        out: dict[str, Any] = {"rope_type": kind,
                               "factor": keys.float("rope.scaling.factor", 1.0)}
        orig = keys.int("rope.scaling.original_context_length")
        if orig:
            out["original_max_position_embeddings"] = orig
        for key, hf in (("yarn_attn_factor", "attention_factor"), ("yarn_beta_fast", "beta_fast"),
                        ("yarn_beta_slow", "beta_slow"), ("yarn_ext_factor",
                                                          "extrapolation_factor")):
            if keys.has(f"rope.scaling.{key}"):
                out[hf] = keys.float(f"rope.scaling.{key}")
        return out
    if freqs is None:
        return None
    # llama.cpp stores Llama-3 scaling as one factor per frequency: 1 (kept), `factor` (slowed)
    # and a blend between. Recover (factor, low/high_freq_factor) with the original context set
    # to 8192: only the ratios matter, and 8192 is what every Llama 3.x uses.
    factors = dequantize(freqs.data, freqs.tensor_type).astype(np.float64).reshape(-1)
    if np.allclose(factors, 1.0):
        return None
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    factor, orig, low, high = f32(factors.max()), 8192, 1.0, 4.0  # Llama 3.x defaults
    mid = (factors > 1 + 1e-6) & (factors < factor - 1e-6)
    if mid.sum() >= 2:  # blend = a*x + b with x = orig / wavelen: solve for the two factors
        smooth = (1 / factors[mid] - 1 / factor) / (1 - 1 / factor)
        a, b = np.polyfit(orig * inv[mid] / (2 * math.pi), smooth, 1)
        low, high = f32(-b / a), f32((1 - b) / a)
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
               "high_freq_factor": high, "original_max_position_embeddings": orig}
    if len(factors) == len(inv) and np.allclose(_llama3_factors(inv, scaling), factors,
                                                rtol=1e-4, atol=1e-5):
        return scaling
    raise ValueError(f"{keys.path} has a rope_freqs tensor that is not Llama-3 RoPE scaling; "
                     "nbserve cannot serve this model's positional encoding")


def _llama3_factors(inv: np.ndarray, sc: dict[str, Any]) -> np.ndarray:
    """Per-frequency divisors of Llama-3 scaling (llama.cpp's rope_freqs) for checking a fit."""
    wavelen = 2 * math.pi / inv
    orig, low, high = sc["original_max_position_embeddings"], sc["low_freq_factor"], \
        sc["high_freq_factor"]
    smooth = (orig / wavelen - low) / (high - low)
    blend = 1 / ((1 - smooth) / sc["factor"] + smooth)
    return np.where(wavelen < orig / high, 1.0, np.where(wavelen > orig / low, sc["factor"], blend))
