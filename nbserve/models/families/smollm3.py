"""SmolLM3: Llama's layout, with RoPE left out of some layers (every fourth by default:
config.json `no_rope_layers`, 1 for a layer that ropes, 0 for one that does not)."""

from __future__ import annotations

from typing import Any

from ..config import DecoderConfig
from ..decoder import build_decoder
from ..family import ATTENTION, MLP, NORMS, Family, GGUFKeys, GGUFLayout, no_sliding_window
from .llama import qwen_windows


def read_config(cfg: dict[str, Any], name: str) -> DecoderConfig:
    n = cfg["num_hidden_layers"]
    uses = cfg.get("no_rope_layers")
    if uses is None:
        interval = cfg.get("no_rope_layer_interval", 4)
        uses = [int((i + 1) % interval != 0) for i in range(n)]
    if len(uses) != n:
        raise ValueError(f"{name}: no_rope_layers lists {len(uses)} layers, the model has {n}")
    return DecoderConfig.from_hf(cfg, name, layer_window=qwen_windows(cfg),
                                 layer_rope=[0 if u else None for u in uses],
                                 attention_bias=bool(cfg.get("attention_bias")),
                                 mlp_bias=bool(cfg.get("mlp_bias")))


def read_gguf_keys(keys: GGUFKeys, cfg: dict[str, Any]) -> None:
    # llama.cpp skips RoPE in every 4th layer of smollm3 (n_no_rope_layer_step = 4), as the
    # HF default no_rope_layers does; the converter writes no key for it.
    n = cfg["num_hidden_layers"]
    cfg.update(no_rope_layers=[int((i + 1) % 4 != 0) for i in range(n)],
               no_rope_layer_interval=4, mlp_bias=False)
    no_sliding_window(cfg)


FAMILY = Family(
    name="smollm3",
    hf_architectures=("SmolLM3ForCausalLM",),
    model_types=("smollm3",),
    gguf=(GGUFLayout("smollm3", "smollm3", "SmolLM3ForCausalLM", NORMS + ATTENTION + MLP,
                     permuted_qk=True, read_keys=read_gguf_keys),),
    read_config=read_config,
    build=build_decoder,
    description="SmolLM3",
)
