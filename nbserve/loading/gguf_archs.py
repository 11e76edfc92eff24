"""GGUF metadata -> config.json keys, GGUF tensors -> HF names and values.

llama.cpp's converter (convert_hf_to_gguf.py) writes each architecture its own way: which
hyperparameters it keeps, which it leaves to llama.cpp's defaults (Gemma 2's softcaps and
sliding pattern, SmolLM3's no-RoPE layers, Qwen3-MoE's normalized top-k), and what it does to
tensors (Q/K rows interleaved for llama and smollm3, Gemma's norms stored +1, GPT-2's Conv1D
weights transposed, experts stacked into one 3-D tensor per projection). Each family file
declares that for its architectures (`models.family.GGUFLayout`, found through
`models.registry.gguf_layout`); this module applies it, with the keys and refusals every
architecture shares, so a file reads as the Hugging Face checkpoint it came from. GGUF tensor
names come from the `gguf` package's own map (`gguf.get_tensor_name_map`), asked with each
layout's HF names.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import gguf
import numpy as np
import torch
from gguf import GGUFReader, ReaderTensor, TokenType
from gguf.quants import dequantize

from ..models.family import GGUFLayout
from ..models.rope import unpermute_qk

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


# --- tensors: GGUF names -> HF names, with what the converter did undone -----------------------


@functools.cache
def _gguf_to_hf(layout: GGUFLayout) -> tuple[dict[str, str], dict[str, str]]:
    """(top-level, per-block) GGUF name -> HF module, from `gguf`'s name map for the layout's
    architecture."""
    arch = layout.architecture
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


def tensor_rule(t: ReaderTensor, layout: GGUFLayout, cfg: dict[str, Any]) -> Rule | None:
    """The rule for GGUF tensor `t` of a file read as `cfg` through `layout`; None if the
    layout has no such tensor."""
    return name_rule(t.name, tuple(int(n) for n in t.shape), layout, cfg)


def name_rule(name: str, shape: tuple[int, ...], layout: GGUFLayout, cfg: dict[str, Any]
              ) -> Rule | None:
    """`tensor_rule` of a tensor named `name` of GGUF shape `shape` (a LoRA file's tensors
    are named after the base tensor they update)."""
    top, block = _gguf_to_hf(layout)
    base, _, suffix = name.rpartition(".")
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
        if len(shape) != 3:
            return None
        names = tuple(f"{module.format(xid=e)}.{suffix}" for e in range(shape[2]))
    heads = 0
    if layout.permuted_qk and parts[-1] in ("attn_q", "attn_k"):
        heads = cfg["num_attention_heads"] if parts[-1] == "attn_q" else cfg["num_key_value_heads"]
    shift = layout.norm_shift if f"{module}.{suffix}".endswith("norm.weight") else 0.0
    transpose = suffix == "weight" and any(module.endswith("." + c) for c in layout.conv1d)
    return Rule(names, heads, shift, transpose)


# --- metadata -> config.json keys -------------------------------------------------------------


class _Keys:
    """`{arch}.*` metadata with the refusals every reader needs (missing, per-layer arrays),
    and the tensors' shapes: what a family's reader sees of a file (`models.family.GGUFKeys`)."""

    def __init__(self, meta: Meta, arch: str, path: Path,
                 by_name: dict[str, ReaderTensor]) -> None:
        self.meta, self.arch, self.path, self.by_name = meta, arch, path, by_name

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

    def get_int(self, name: str, default: int | None = None) -> int | None:
        value = self._scalar(name, default)
        return None if value is None else int(value)

    def get_float(self, name: str, default: float | None = None) -> float | None:
        value = self._scalar(name, default)
        return None if value is None else f32(value)

    def refuse(self, name: str, why: str) -> NoReturn:
        raise ValueError(f"{self.path} has {self.key(name)} = {self.raw(name)!r}: {why}")

    def tensor_shape(self, name: str) -> tuple[int, ...] | None:
        t = self.by_name.get(name)
        return None if t is None else tuple(int(n) for n in t.shape)

    def tensor_values(self, name: str) -> list[float]:
        t = self.by_name[name]
        return [f32(x) for x in dequantize(t.data, t.tensor_type).reshape(-1)]


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


def hf_config(meta: Meta, layout: GGUFLayout, by_name: dict[str, ReaderTensor],
              path: Path) -> dict[str, Any]:
    """config.json-style dict from `{arch}.*` keys, tensor shapes and special-token ids, with
    the keys the model type's config.json holds (the family's `read_keys` adds its own)."""
    keys = _Keys(meta, layout.architecture, path, by_name)
    for name, neutral in _UNSUPPORTED.items():
        if keys.has(name) and (neutral is None or keys.raw(name) != neutral):
            keys.refuse(name, "nbserve's model does not compute this")
    if "token_embd.weight" not in by_name:
        raise ValueError(f"{path} has no token_embd.weight tensor; is it a complete model file?")
    cfg = _decoder(keys, layout, by_name) if layout.decoder_keys else {}
    if layout.read_keys is not None:
        layout.read_keys(keys, cfg)
    return {"architectures": [layout.hf_architecture], "model_type": layout.model_type, **cfg,
            **_special_ids(meta)}


def _rows(by_name: dict[str, ReaderTensor], name: str) -> int:
    return int(by_name[name].shape[1])  # GGUF shapes are (ne0, ne1): ne1 counts rows


def _decoder(keys: _Keys, layout: GGUFLayout, by_name: dict[str, ReaderTensor]) -> dict[str, Any]:
    """The keys every RoPE decoder here shares (Llama's config.json names)."""
    hidden, heads = int(keys.need("embedding_length")), int(keys.need("attention.head_count"))
    head_dim = keys.get_int("attention.key_length") or hidden // heads
    value_dim = keys.get_int("attention.value_length") or head_dim
    if value_dim != head_dim:
        keys.refuse("attention.value_length", f"values of another size than keys ({head_dim})")
    for name in ("attention.key_length_swa", "attention.value_length_swa"):
        if keys.has(name) and keys.get_int(name) != head_dim:
            keys.refuse(name, "sliding-window layers with another head size")
    rope_dim = keys.get_int("rope.dimension_count")
    if rope_dim is not None and rope_dim != head_dim and not layout.partial_rotary:
        keys.refuse("rope.dimension_count", f"RoPE over part of the {head_dim} head dimensions, "
                                            f"which {layout.hf_architecture} does not do")
    swa_dim = keys.get_int("rope.dimension_count_swa", rope_dim)
    if keys.has("rope.dimension_count_swa") and swa_dim != rope_dim:
        keys.refuse("rope.dimension_count_swa", "another RoPE size in sliding-window layers")
    theta = keys.get_float("rope.freq_base", 10000.0)
    assert theta is not None
    return {
        "vocab_size": _rows(by_name, "token_embd.weight"),
        "hidden_size": hidden,
        "intermediate_size": int(keys.need("feed_forward_length")),
        "num_hidden_layers": int(keys.need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": keys.get_int("attention.head_count_kv") or heads,
        "head_dim": head_dim,
        "max_position_embeddings": keys.get_int("context_length", 2048),
        "rms_norm_eps": f32(keys.need("attention.layer_norm_rms_epsilon")),
        "rope_theta": theta,
        "rope_scaling": rope_scaling(keys, by_name.get("rope_freqs.weight"), theta, head_dim),
        "tie_word_embeddings": "output.weight" not in by_name,
        "attention_bias": "blk.0.attn_q.bias" in by_name or "blk.0.attn_qkv.bias" in by_name,
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
                               "factor": keys.get_float("rope.scaling.factor", 1.0)}
        orig = keys.get_int("rope.scaling.original_context_length")
        if orig:
            out["original_max_position_embeddings"] = orig
        for key, hf in (("yarn_attn_factor", "attention_factor"), ("yarn_beta_fast", "beta_fast"),
                        ("yarn_beta_slow", "beta_slow"), ("yarn_ext_factor",
                                                          "extrapolation_factor")):
            if keys.has(f"rope.scaling.{key}"):
                out[hf] = keys.get_float(f"rope.scaling.{key}")
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
