"""Phi-3 and Phi-4-mini: Llama's layout with q/k/v and gate/up fused in the checkpoint
(`qkv_proj`, `gate_up_proj`: the decoder takes them as its fused projections, no copy),
partial rotary (Phi-4-mini rotates 3/4 of each head), LongRoPE scaling, and a sliding window
on every layer where the config sets one."""

from __future__ import annotations

from typing import Any

from ..config import DecoderConfig
from ..decoder import build_decoder
from ..family import Family


def read_config(cfg: dict[str, Any], name: str) -> DecoderConfig:
    n = cfg["num_hidden_layers"]
    return DecoderConfig.from_hf(cfg, name, layer_window=[cfg.get("sliding_window")] * n,
                                 attention_bias=bool(cfg.get("attention_bias")))


FAMILY = Family(
    name="phi3",
    hf_architectures=("Phi3ForCausalLM",),
    model_types=("phi3",),
    gguf_architectures={"phi3": "Phi3ForCausalLM"},
    read_config=read_config,
    build=build_decoder,
    description="Phi-3, Phi-4-mini",
)
