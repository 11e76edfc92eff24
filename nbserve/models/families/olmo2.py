"""OLMo 2: norms after attention and after the MLP (not before), and q/k RMSNorms over all
heads together."""

from __future__ import annotations

from typing import Any

from ..config import DecoderConfig
from ..decoder import build_decoder
from ..family import ATTENTION, MLP, QK_NORMS, Family, GGUFKeys, GGUFLayout


def read_config(cfg: dict[str, Any], name: str) -> DecoderConfig:
    return DecoderConfig.from_hf(cfg, name, norm_layout="post", qk_norm="full",
                                 attention_bias=bool(cfg.get("attention_bias")))


def read_gguf_keys(keys: GGUFKeys, cfg: dict[str, Any]) -> None:
    if keys.has("attention.sliding_window"):
        keys.refuse("attention.sliding_window", "sliding-window layers (OLMo 3), not OLMo 2")


FAMILY = Family(
    name="olmo2",
    hf_architectures=("Olmo2ForCausalLM",),
    model_types=("olmo2",),
    gguf=(GGUFLayout("olmo2", "olmo2", "Olmo2ForCausalLM", (
        "post_attention_layernorm", "post_feedforward_layernorm") + ATTENTION + QK_NORMS + MLP,
        read_keys=read_gguf_keys),),
    read_config=read_config,
    build=build_decoder,
    description="OLMo 2",
)
