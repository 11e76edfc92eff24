"""LlamaConfig: the architecture numbers nbserve's transformer needs, read from HF config.json."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


@dataclass(slots=True)
class LlamaConfig:
    """Llama / Mistral / Qwen2 / SmolLM shapes. `attention_bias` is True for Qwen2 (q/k/v bias)."""

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

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], name: str = "model") -> LlamaConfig:
        """Build from a config.json dict; raise ValueError naming what is unsupported."""
        archs = cfg.get("architectures") or []
        by_type = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                   "qwen2": "Qwen2ForCausalLM"}
        arch = archs[0] if archs else by_type.get(cfg.get("model_type", ""), "")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch or cfg.get('model_type')!r} in {name}: nbserve "
                f"implements {', '.join(sorted(SUPPORTED_ARCHITECTURES))}. Serve other models "
                "with launch(transformers_model, tokenizer=...) or the StepModel protocol.")
        n_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        eos = cfg.get("eos_token_id")
        eos_list = [eos] if isinstance(eos, int) else list(eos or [])
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        rope_params = cfg.get("rope_parameters")  # transformers >= 5 folds theta/scaling here
        if isinstance(rope_params, dict):
            rope_theta = rope_theta or rope_params.get("rope_theta")
            if rope_params.get("rope_type", "default") != "default" and not rope_scaling:
                rope_scaling = rope_params
        if rope_scaling is not None:
            kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
            if kind not in ("default", "llama3", None):
                raise ValueError(f"unsupported rope_scaling type {kind!r} in {name}: "
                                 "nbserve supports the default RoPE and Llama-3 scaling")
            if kind in ("default", None):
                rope_scaling = None
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=n_heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=cfg.get("head_dim") or hidden // n_heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias")),
            architecture=arch,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos_list,
            name=name,
        )
