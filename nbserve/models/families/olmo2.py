"""OLMo 2: norms after attention and after the MLP (not before), and q/k RMSNorms over all
heads together."""

from __future__ import annotations

from typing import Any

from ..config import DecoderConfig
from ..decoder import build_decoder
from ..family import Family


def read_config(cfg: dict[str, Any], name: str) -> DecoderConfig:
    return DecoderConfig.from_hf(cfg, name, norm_layout="post", qk_norm="full",
                                 attention_bias=bool(cfg.get("attention_bias")))


FAMILY = Family(
    name="olmo2",
    hf_architectures=("Olmo2ForCausalLM",),
    model_types=("olmo2",),
    gguf_architectures={"olmo2": "Olmo2ForCausalLM"},
    read_config=read_config,
    build=build_decoder,
    description="OLMo 2",
)
