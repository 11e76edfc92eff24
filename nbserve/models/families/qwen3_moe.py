"""Qwen3-MoE: Qwen3's attention (an RMSNorm over each q and k head) with mixture-of-experts
MLPs (models/moe.py) in the layers `decoder_sparse_step` and `mlp_only_layers` pick, the dense
MLP of `intermediate_size` in the others. As in transformers, `use_sliding_window` puts the
window on every layer. Hub checkpoints (and GGUF files) name each expert's matrices
(`mlp.experts.E.gate_proj`...): they are stacked at load; transformers 5's stacked tensors load
as they are."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from ..config import DecoderConfig
from ..decoder import DecoderBuildOptions, DecoderModel, build_decoder
from ..family import (
    ATTENTION,
    NORMS,
    QK_NORMS,
    Family,
    GGUFKeys,
    GGUFLayout,
    gguf_experts,
    no_sliding_window,
)
from ..moe import MoEConfig, moe_tensors, sparse_layers

if TYPE_CHECKING:
    from typing_extensions import Unpack

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
          **options: Unpack[DecoderBuildOptions]) -> DecoderModel:
    """`build_decoder` over Qwen3-MoE tensors, per-expert ones stacked first."""
    return build_decoder(cfg, moe_tensors(tensors, cfg, PROJECTIONS), **options)


def read_gguf_keys(keys: GGUFKeys, cfg: dict[str, Any]) -> None:
    experts, used = gguf_experts(keys, cfg)
    # llama.cpp always renormalizes the top-k weights of qwen3moe (norm_topk_prob: true in
    # every Qwen3-MoE), and routes in every layer; the converter writes neither.
    norm = keys.raw("expert_weights_norm", True)
    gate = keys.tensor_shape("blk.0.ffn_gate_exps.weight")
    size = keys.get_int("expert_feed_forward_length") or (gate[1] if gate is not None else None)
    if size is None:
        raise ValueError(f"{keys.path} lacks {keys.key('expert_feed_forward_length')}")
    cfg.update(num_experts=experts, num_experts_per_tok=used, moe_intermediate_size=size,
               norm_topk_prob=bool(norm), decoder_sparse_step=1, mlp_only_layers=[])
    no_sliding_window(cfg)


FAMILY = Family(
    name="qwen3_moe",
    hf_architectures=("Qwen3MoeForCausalLM",),
    model_types=("qwen3_moe",),
    gguf=(GGUFLayout("qwen3moe", "qwen3_moe", "Qwen3MoeForCausalLM",
                     NORMS + ATTENTION + QK_NORMS + (
                         "mlp.gate", "mlp.experts.{xid}.gate_proj", "mlp.experts.{xid}.up_proj",
                         "mlp.experts.{xid}.down_proj"), read_keys=read_gguf_keys),),
    read_config=read_config,
    build=build,
    description="Qwen3-MoE",
)
