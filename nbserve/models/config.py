"""DecoderConfig: the shape and the options of nbserve's decoder-only transformer, which every
native family (models/families/) fills in from its config.json.

The defaults are Llama's; a family turns on what its architecture has: q/k norms, Gemma's
(1 + w) norms and sandwich norms, OLMo 2's post-norms, sliding-window layers, layers without
RoPE, softcaps, GELU or ReLU² MLPs, biases, learned positions, experts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import nn

from .rope import RopeSpec, read_rope

ACTIVATIONS = ("silu", "gelu_tanh", "gelu", "relu2")


class ExpertLayers(Protocol):
    """What a config's experts offer the decoder (`models.moe.MoEConfig`): their count and the
    MLP of each layer (a mixture where the layer routes, else the dense one)."""

    @property
    def num_experts(self) -> int: ...

    def make_mlp(self, cfg: DecoderConfig, layer: int) -> nn.Module: ...

NORM_LAYOUTS = ("pre", "sandwich", "post")


@dataclass(slots=True)
class DecoderConfig:
    """Sizes, then options (see the module docstring).

    ropes / layer_rope: the distinct RoPEs and, per layer, the index of its own (None: a layer
    without RoPE). layer_window: per layer, its sliding window (None: global attention); key j
    is visible to the query at position p iff p - window < j <= p. norm_layout: "pre"
    (Llama: norm before attention and MLP), "sandwich" (Gemma: before and after both), "post"
    (OLMo 2: after both). qk_norm: "" (none), "head" (an RMSNorm per head, Qwen3/Gemma 3),
    "full" (over all heads together, OLMo 2). attn_scale: the query scale (None: head_dim ** -0.5).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    architecture: str = "LlamaForCausalLM"
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    name: str = "model"
    ropes: list[RopeSpec] = field(default_factory=list)
    layer_rope: list[int | None] = field(default_factory=list)
    layer_window: list[int | None] = field(default_factory=list)
    hidden_act: str = "silu"
    gated_mlp: bool = True
    mlp_bias: bool = False
    o_bias: bool = False
    norm: str = "rms"  # "rms" or "layer" (LayerNorm, GPT-2)
    norm_bias: bool = True  # a LayerNorm's bias (nanoGPT may go without)
    norm_offset: float = 0.0  # Gemma scales by (1 + weight)
    norm_layout: str = "pre"
    qk_norm: str = ""
    embed_scale: float | None = None
    learned_positions: bool = False
    attn_scale: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    moe: ExpertLayers | None = None  # a models.moe.MoEConfig for mixture-of-experts layers

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        if not self.ropes:
            scaling = dict(self.rope_scaling or {})
            kind = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
            self.ropes = [RopeSpec(theta=float(self.rope_theta), rotary_dim=self.head_dim,
                                   kind=kind, params=tuple(sorted(scaling.items())),
                                   max_positions=self.max_position_embeddings)]
        if not self.layer_rope:
            self.layer_rope = [0] * n
        if not self.layer_window:
            self.layer_window = [None] * n
        if len(self.layer_rope) != n or len(self.layer_window) != n:
            raise ValueError(f"{self.name}: per-layer options must list {n} layers")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {self.hidden_act!r} in {self.name}: nbserve "
                             f"implements {', '.join(ACTIVATIONS)}")
        if self.norm_layout not in NORM_LAYOUTS:
            raise ValueError(f"unknown norm layout {self.norm_layout!r}")

    @property
    def scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim ** -0.5

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], name: str = "model", **options: Any) -> DecoderConfig:
        """The sizes, RoPE, windows and stop ids of a config.json dict; `options` set the rest
        (a family's reader passes what its architecture has)."""
        archs = cfg.get("architectures") or []
        n_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        head_dim = cfg.get("head_dim") or hidden // n_heads
        n_layers = cfg["num_hidden_layers"]
        eos = cfg.get("eos_token_id")
        types = cfg.get("layer_types") or []
        if "layer_window" not in options:
            window = cfg.get("sliding_window")
            if types and len(types) == n_layers:
                options["layer_window"] = [window if t == "sliding_attention" else None
                                           for t in types]
        if "ropes" not in options:
            options["ropes"] = [read_rope(cfg, head_dim, name)]
        fields: dict[str, Any] = dict(
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg.get("intermediate_size") or 4 * hidden,
            num_hidden_layers=n_layers,
            num_attention_heads=n_heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=head_dim,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=options["ropes"][0].theta,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias")),
            architecture=archs[0] if archs else cfg.get("model_type", ""),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=[eos] if isinstance(eos, int) else list(eos or []),
            name=name,
        )
        return cls(**(fields | options))

    def windows_in_use(self) -> bool:
        return any(w is not None for w in self.layer_window)


LlamaConfig = DecoderConfig  # the Llama family's config: the decoder's defaults


def layer_types_of(cfg: dict[str, Any], n_layers: int) -> list[str] | None:
    """config.json `layer_types` when it lists every layer, else None."""
    types = cfg.get("layer_types")
    return list(types) if isinstance(types, list) and len(types) == n_layers else None
