"""Phi-3 and Phi-4-mini: Llama's layout with q/k/v and gate/up fused in the checkpoint
(`qkv_proj`, `gate_up_proj`: the decoder takes them as its fused projections, no copy),
partial rotary (Phi-4-mini rotates 3/4 of each head), LongRoPE scaling, and a sliding window
on every layer where the config sets one."""

from __future__ import annotations

import math
from typing import Any

from ..config import DecoderConfig
from ..decoder import build_decoder
from ..family import NORMS, Family, GGUFKeys, GGUFLayout


def read_config(cfg: dict[str, Any], name: str) -> DecoderConfig:
    n = cfg["num_hidden_layers"]
    return DecoderConfig.from_hf(cfg, name, layer_window=[cfg.get("sliding_window")] * n,
                                 attention_bias=bool(cfg.get("attention_bias")))


def read_gguf_keys(keys: GGUFKeys, cfg: dict[str, Any]) -> None:
    rope_dim = keys.get_int("rope.dimension_count") or cfg["head_dim"]
    orig = keys.get_int("rope.scaling.original_context_length") or cfg["max_position_embeddings"]
    cfg.update(partial_rotary_factor=rope_dim / cfg["head_dim"],
               original_max_position_embeddings=orig,
               sliding_window=keys.get_int("attention.sliding_window") or None,
               rope_scaling=_longrope(keys, cfg["max_position_embeddings"], orig, rope_dim))


def _longrope(keys: GGUFKeys, n_ctx: int, orig: int, rope_dim: int) -> dict[str, Any] | None:
    """Phi-3's LongRoPE: the long/short factor tensors the converter writes (no type key)."""
    names = ("rope_factors_long.weight", "rope_factors_short.weight")
    present = [keys.tensor_shape(n) is not None for n in names]
    if not any(present):
        return None
    if not all(present):
        raise ValueError(f"{keys.path} has only one of rope_factors_long/short")
    factors = [keys.tensor_values(n) for n in names]
    if any(len(f) != rope_dim // 2 for f in factors):
        raise ValueError(f"{keys.path}: rope_factors_long/short are not {rope_dim // 2} long")
    out: dict[str, Any] = {"rope_type": "longrope", "long_factor": factors[0],
                           "short_factor": factors[1]}
    scale = n_ctx / orig  # the attention factor HF derives by default; kept only if another
    default = math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0
    attn = keys.get_float("rope.scaling.attn_factor")
    if attn is not None and not math.isclose(attn, default, rel_tol=1e-6):
        out["attention_factor"] = attn
    return out


FAMILY = Family(
    name="phi3",
    hf_architectures=("Phi3ForCausalLM",),
    model_types=("phi3",),
    gguf=(GGUFLayout("phi3", "phi3", "Phi3ForCausalLM", NORMS + (
        "self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"),
        partial_rotary=True, read_keys=read_gguf_keys),),
    read_config=read_config,
    build=build_decoder,
    description="Phi-3, Phi-4-mini",
)
