"""Mixtral: Mistral's layout (its `sliding_window` on every layer where set) with a mixture of
experts in every layer (models/moe.py): the top-k weights always renormalised and kept in
float32 until they scale the experts' outputs, as transformers does. Hub checkpoints name the
block `block_sparse_moe` and each expert's matrices w1 (gate), w3 (up), w2 (down): they are
renamed and stacked at load; transformers 5's `mlp.experts.*` tensors load as they are.

GGUF: Mixtral files say architecture "llama" with an expert count, which the GGUF reader
(loading/gguf_archs.py) reads as MixtralForCausalLM, so this family claims no GGUF name of
its own (the llama family holds "llama")."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..config import DecoderConfig
from ..decoder import DecoderModel, build_decoder
from ..family import Family
from ..moe import MoEConfig, moe_tensors

PROJECTIONS = {"w1": "gate", "w3": "up", "w2": "down"}


def read_config(cfg: dict[str, Any], name: str) -> DecoderConfig:
    n = cfg["num_hidden_layers"]
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{name}: unsupported Mixtral activation {cfg['hidden_act']!r}")
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    if experts <= 0:
        raise ValueError(f"{name}: a Mixtral config needs num_local_experts > 0")
    moe = MoEConfig(num_experts=experts, top_k=int(cfg.get("num_experts_per_tok", 2)),
                    intermediate_size=int(cfg["intermediate_size"]), norm_topk_prob=True,
                    sparse_layers=frozenset(range(n)), routing="mixtral")
    return DecoderConfig.from_hf(cfg, name, layer_window=[cfg.get("sliding_window")] * n,
                                 attention_bias=bool(cfg.get("attention_bias")), moe=moe)


def build(cfg: DecoderConfig, tensors: Iterable[tuple[str, torch.Tensor]],
          **options: Any) -> DecoderModel:
    """`build_decoder` over Mixtral tensors, per-expert ones renamed and stacked first."""
    return build_decoder(cfg, moe_tensors(tensors, cfg, PROJECTIONS, block="block_sparse_moe"),
                         **options)


FAMILY = Family(
    name="mixtral",
    hf_architectures=("MixtralForCausalLM",),
    model_types=("mixtral",),
    gguf_architectures={},  # GGUF "llama" + expert_count reads as Mixtral (see above)
    read_config=read_config,
    build=build,
    description="Mixtral",
)
