"""Qwen3-MoE: Qwen3's attention (an RMSNorm over each q and k head) with mixture-of-experts
MLPs (models/moe.py) in the layers `decoder_sparse_step` and `mlp_only_layers` pick, the dense
MLP of `intermediate_size` in the others. As in transformers, `use_sliding_window` puts the
window on every layer. Hub checkpoints (and GGUF files) name each expert's matrices
(`mlp.experts.E.gate_proj`...): they are stacked at load; transformers 5's stacked tensors load
as they are."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..config import DecoderConfig
from ..decoder import DecoderModel, build_decoder
from ..family import Family
from ..moe import MoEConfig, moe_tensors, sparse_layers

PROJECTIONS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


def read_config(cfg: dict[str, Any], name: str) -> DecoderConfig:
    n = cfg["num_hidden_layers"]
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{name}: unsupported Qwen3-MoE activation {cfg['hidden_act']!r}")
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    sparse = sparse_layers(n, experts, cfg.get("decoder_sparse_step", 1),
                           cfg.get("mlp_only_layers") or ())
    moe = MoEConfig(num_experts=experts, top_k=int(cfg["num_experts_per_tok"]),
                    intermediate_size=int(cfg["moe_intermediate_size"]),
                    norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                    sparse_layers=sparse, routing="qwen3_moe") if sparse else None
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    return DecoderConfig.from_hf(cfg, name, layer_window=[window] * n, qk_norm="head",
                                 attention_bias=bool(cfg.get("attention_bias")), moe=moe)


def build(cfg: DecoderConfig, tensors: Iterable[tuple[str, torch.Tensor]],
          **options: Any) -> DecoderModel:
    """`build_decoder` over Qwen3-MoE tensors, per-expert ones stacked first."""
    return build_decoder(cfg, moe_tensors(tensors, cfg, PROJECTIONS), **options)


FAMILY = Family(
    name="qwen3_moe",
    hf_architectures=("Qwen3MoeForCausalLM",),
    model_types=("qwen3_moe",),
    gguf_architectures={"qwen3moe": "Qwen3MoeForCausalLM"},
    read_config=read_config,
    build=build,
    description="Qwen3-MoE",
)
