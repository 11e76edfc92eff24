"""Mixtral: Mistral's layout (its `sliding_window` on every layer where set) with a mixture of
experts in every layer (models/moe.py): the top-k weights always renormalised and kept in
float32 until they scale the experts' outputs, as transformers does. Hub checkpoints name the
block `block_sparse_moe` and each expert's matrices w1 (gate), w3 (up), w2 (down): they are
renamed and stacked at load; transformers 5's `mlp.experts.*` tensors load as they are.

GGUF: Mixtral files say architecture "llama" with an expert count: this family's layout is
the one for such files (`with_experts`), the llama family's for the others."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from ..config import DecoderConfig
from ..decoder import DecoderBuildOptions, DecoderModel, build_decoder
from ..family import ATTENTION, NORMS, Family, GGUFKeys, GGUFLayout, gguf_experts
from ..moe import MoEConfig, moe_tensors

if TYPE_CHECKING:
    from typing_extensions import Unpack

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
          **options: Unpack[DecoderBuildOptions]) -> DecoderModel:
    """`build_decoder` over Mixtral tensors, per-expert ones renamed and stacked first."""
    return build_decoder(cfg, moe_tensors(tensors, cfg, PROJECTIONS, block="block_sparse_moe"),
                         **options)


def read_gguf_keys(keys: GGUFKeys, cfg: dict[str, Any]) -> None:
    experts, used = gguf_experts(keys, cfg)
    if not keys.raw("expert_weights_norm", True):
        keys.refuse("expert_weights_norm", "Mixtral renormalizes the top-k expert weights")
    cfg.update(num_local_experts=experts, num_experts_per_tok=used, sliding_window=None,
               intermediate_size=keys.get_int("expert_feed_forward_length")
               or cfg["intermediate_size"])


FAMILY = Family(
    name="mixtral",
    hf_architectures=("MixtralForCausalLM",),
    model_types=("mixtral",),
    gguf=(GGUFLayout("llama", "mixtral", "MixtralForCausalLM", NORMS + ATTENTION + (
        "block_sparse_moe.gate", "block_sparse_moe.experts.{xid}.w1",
        "block_sparse_moe.experts.{xid}.w2", "block_sparse_moe.experts.{xid}.w3"),
        permuted_qk=True, with_experts=True, read_keys=read_gguf_keys),),
    read_config=read_config,
    build=build,
    description="Mixtral",
)
