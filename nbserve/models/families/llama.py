"""Llama 2/3, Mistral, Qwen2/2.5, SmolLM/SmolLM2: the decoder with its defaults.

Mistral's `sliding_window` applies to every layer; Qwen2's only with `use_sliding_window`, to
the layers from `max_window_layers` on (as transformers reads them).
"""

from __future__ import annotations

from typing import Any

from ..config import DecoderConfig, layer_types_of
from ..decoder import build_decoder
from ..family import ATTENTION, MLP, NORMS, Family, GGUFLayout

ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                 "Qwen2ForCausalLM": "qwen2"}


def architecture_of(cfg: dict[str, Any], by_type: dict[str, str]) -> str:
    """config.json's first `architectures` entry, else the one its `model_type` names."""
    archs = cfg.get("architectures") or []
    return archs[0] if archs else by_type.get(cfg.get("model_type", ""), "")


def qwen_windows(cfg: dict[str, Any]) -> list[int | None]:
    """Per-layer windows of a Qwen2/Qwen3 config: `layer_types` when given, else the layers
    from `max_window_layers` on when `use_sliding_window`."""
    n = cfg["num_hidden_layers"]
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    types = layer_types_of(cfg, n)
    if types is not None:
        return [window if t == "sliding_attention" else None for t in types]
    first = cfg.get("max_window_layers", n)
    return [window if i >= first else None for i in range(n)]


def read_config(cfg: dict[str, Any], name: str = "model") -> DecoderConfig:
    arch = architecture_of(cfg, {v: k for k, v in ARCHITECTURES.items()})
    n = cfg["num_hidden_layers"]
    if arch == "MistralForCausalLM":
        windows: list[int | None] = [cfg.get("sliding_window")] * n
    elif arch == "Qwen2ForCausalLM":
        windows = qwen_windows(cfg)
    else:
        windows = [None] * n
    return DecoderConfig.from_hf(
        cfg, name, layer_window=windows,
        attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias")),
        mlp_bias=bool(cfg.get("mlp_bias")))


FAMILY = Family(
    name="llama",
    hf_architectures=tuple(ARCHITECTURES),
    model_types=tuple(ARCHITECTURES.values()),
    gguf=(GGUFLayout("llama", "llama", "LlamaForCausalLM",  # GGUF "llama" covers Mistral
                     NORMS + ATTENTION + MLP, permuted_qk=True),
          GGUFLayout("qwen2", "qwen2", "Qwen2ForCausalLM", NORMS + ATTENTION + MLP)),
    read_config=read_config,
    build=build_decoder,
    description="Llama 2/3, Mistral, Qwen2/2.5, SmolLM",
)
