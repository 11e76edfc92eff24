"""Qwen3 (dense): Qwen2's layout with an RMSNorm over each q and k head (no q/k/v bias).
Its chat template's `enable_thinking` switch comes through `chat_template_kwargs`."""

from __future__ import annotations

from typing import Any

from ..config import DecoderConfig
from ..decoder import build_decoder
from ..family import (
    ATTENTION,
    MLP,
    NORMS,
    QK_NORMS,
    Family,
    GGUFKeys,
    GGUFLayout,
    no_sliding_window,
)
from .llama import qwen_windows


def read_config(cfg: dict[str, Any], name: str) -> DecoderConfig:
    return DecoderConfig.from_hf(cfg, name, layer_window=qwen_windows(cfg), qk_norm="head",
                                 attention_bias=bool(cfg.get("attention_bias")))


def read_gguf_keys(keys: GGUFKeys, cfg: dict[str, Any]) -> None:
    no_sliding_window(cfg)


FAMILY = Family(
    name="qwen3",
    hf_architectures=("Qwen3ForCausalLM",),
    model_types=("qwen3",),
    gguf=(GGUFLayout("qwen3", "qwen3", "Qwen3ForCausalLM", NORMS + ATTENTION + QK_NORMS + MLP,
                     read_keys=read_gguf_keys),),
    read_config=read_config,
    build=build_decoder,
    description="Qwen3",
)
