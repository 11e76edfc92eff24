"""Gemma 2 and Gemma 3 (text): (1 + w) RMSNorms before and after both attention and MLP,
GeGLU with tanh-GELU, embeddings scaled by sqrt(hidden), queries scaled by
query_pre_attn_scalar ** -0.5, sliding-window layers interleaved with global ones; Gemma 2
softcaps its attention and final logits, Gemma 3 has q/k norms and its own RoPE base for the
local layers. A multimodal Gemma 3 (4B and up, Gemma3ForConditionalGeneration) is served as
its language model: text in, text out; its vision tower is not loaded."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from ..config import DecoderConfig, layer_types_of
from ..decoder import DecoderBuildOptions, DecoderModel, build_decoder
from ..family import ATTENTION, MLP, NORMS, QK_NORMS, Family, GGUFKeys, GGUFLayout
from ..rope import RopeSpec, read_rope

if TYPE_CHECKING:
    from typing_extensions import Unpack

ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu": "gelu",
               "silu": "silu"}


def _sliding(cfg: dict[str, Any], gemma3: bool) -> list[bool]:
    """Which layers attend through the window: `layer_types`, else the family's pattern
    (Gemma 2: every other layer from the first; Gemma 3: all but every
    `sliding_window_pattern`-th)."""
    n = cfg["num_hidden_layers"]
    types = layer_types_of(cfg, n)
    if types is not None:
        return [t == "sliding_attention" for t in types]
    if gemma3:
        pattern = cfg.get("sliding_window_pattern", 6)
        return [(i + 1) % pattern != 0 for i in range(n)]
    return [i % 2 == 0 for i in range(n)]


MULTIMODAL = "Gemma3ForConditionalGeneration"  # Gemma 3 4B and up: its language model is served
_VISION = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
           "model.multi_modal_projector.")
_TEXT_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                  ("language_model.lm_head.", "lm_head."))


def read_config(cfg: dict[str, Any], name: str) -> DecoderConfig:
    archs = cfg.get("architectures") or []
    if (archs[:1] == [MULTIMODAL] or "text_config" in cfg) and \
            isinstance(cfg.get("text_config"), dict):  # the text model; images are not served
        text = {k: v for k, v in cfg.items() if k in ("tie_word_embeddings", "bos_token_id",
                                                      "eos_token_id")}
        cfg = text | cfg["text_config"] | {"architectures": ["Gemma3ForCausalLM"],
                                           "model_type": "gemma3_text"}
        archs = cfg["architectures"]
    gemma3 = (archs[0] if archs else cfg.get("model_type", "")) in (
        "Gemma3ForCausalLM", "gemma3_text")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {act!r} in {name}")
    hidden = cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    sliding = _sliding(cfg, gemma3)
    window = cfg.get("sliding_window")
    ropes: list[RopeSpec] = [read_rope(cfg, head_dim, name, "full_attention")]
    if gemma3:
        params = cfg.get("rope_parameters")
        if isinstance(params, dict) and isinstance(params.get("sliding_attention"), dict):
            ropes.append(read_rope(cfg, head_dim, name, "sliding_attention"))
        else:  # older configs: a plain RoPE with its own base
            ropes.append(RopeSpec(theta=float(cfg.get("rope_local_base_freq", 10000.0)),
                                  rotary_dim=head_dim,
                                  max_positions=int(cfg.get("max_position_embeddings", 2048))))
    return DecoderConfig.from_hf(
        cfg, name, ropes=ropes,
        layer_rope=[1 if gemma3 and s else 0 for s in sliding],
        layer_window=[window if s else None for s in sliding],
        hidden_act=ACTIVATIONS[act], norm_offset=1.0, norm_layout="sandwich",
        qk_norm="head" if gemma3 else "", embed_scale=hidden ** 0.5,
        attn_scale=float(cfg.get("query_pre_attn_scalar") or head_dim) ** -0.5,
        attn_softcap=cfg.get("attn_logit_softcapping"),
        final_softcap=cfg.get("final_logit_softcapping"),
        attention_bias=bool(cfg.get("attention_bias")))


def text_tensors(tensors: Iterable[tuple[str, torch.Tensor]]
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """A multimodal Gemma 3's language-model tensors under the text model's names (saved
    `language_model.model.*` or in memory `model.language_model.*`); vision tensors dropped."""
    for name, tensor in tensors:
        if name.startswith(_VISION):
            continue
        for old, new in _TEXT_PREFIXES:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        yield name, tensor


def build(cfg: DecoderConfig, tensors: Iterable[tuple[str, torch.Tensor]],
          **options: Unpack[DecoderBuildOptions]) -> DecoderModel:
    return build_decoder(cfg, text_tensors(tensors), **options)


# --- GGUF: the keys llama.cpp's converter writes, and the defaults llama.cpp takes for the others


def _layer_types(keys: GGUFKeys, n_layers: int, default_period: int
                 ) -> tuple[list[str], int | None]:
    """Sliding/full per layer as llama.cpp reads `attention.sliding_window_pattern` (an array
    of bools, or a period whose last layer is full), and the period when there is one."""
    value = keys.raw("attention.sliding_window_pattern", default_period)
    if isinstance(value, list):
        if len(value) != n_layers:
            keys.refuse("attention.sliding_window_pattern", f"not one flag per layer ({n_layers})")
        sliding = [bool(v) for v in value]
        period = next((p for p in range(1, n_layers + 1) if sliding == [
            i % p < p - 1 for i in range(n_layers)]), None)
    else:
        period = int(value)
        sliding = [period == 0 or i % period < period - 1 for i in range(n_layers)]
    return ["sliding_attention" if s else "full_attention" for s in sliding], period


def attention_scalar(cfg: dict[str, Any], n_layers_27b: int) -> int:
    """Gemma's query_pre_attn_scalar as llama.cpp takes it (no key is written): hidden / heads
    for the 27B models, the head size for the others."""
    if cfg["num_hidden_layers"] == n_layers_27b:
        return int(cfg["hidden_size"] // cfg["num_attention_heads"])
    return int(cfg["head_dim"])


def _gemma2_keys(keys: GGUFKeys, cfg: dict[str, Any]) -> None:
    cfg.update(hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh")
    layer_types, _ = _layer_types(keys, cfg["num_hidden_layers"], 2)
    cfg.update(
        sliding_window=keys.get_int("attention.sliding_window", 4096), layer_types=layer_types,
        attn_logit_softcapping=keys.get_float("attn_logit_softcapping"),
        final_logit_softcapping=keys.get_float("final_logit_softcapping"),
        query_pre_attn_scalar=attention_scalar(cfg, 46))
    if keys.get_float("rope.freq_base_swa", cfg["rope_theta"]) != cfg["rope_theta"]:
        keys.refuse("rope.freq_base_swa", "another RoPE base in Gemma 2's sliding layers")


def _gemma3_keys(keys: GGUFKeys, cfg: dict[str, Any]) -> None:
    cfg.update(hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh")
    if keys.has("attn_logit_softcapping"):
        keys.refuse("attn_logit_softcapping", "Gemma 3 has no attention softcapping")
    window = keys.get_int("attention.sliding_window") or 0
    period: int | None
    if window:
        layer_types, period = _layer_types(keys, cfg["num_hidden_layers"], 6)
    else:
        layer_types, period = ["full_attention"] * cfg["num_hidden_layers"], 1
    cfg.update(
        sliding_window=window or None, layer_types=layer_types, attn_logit_softcapping=None,
        final_logit_softcapping=keys.get_float("final_logit_softcapping"),
        rope_local_base_freq=keys.get_float("rope.freq_base_swa", 10000.0),
        query_pre_attn_scalar=attention_scalar(cfg, 62))
    if period is not None:
        cfg["sliding_window_pattern"] = period


_GEMMA_NORMS = NORMS + ("pre_feedforward_layernorm", "post_feedforward_layernorm")

FAMILY = Family(
    name="gemma",
    hf_architectures=("Gemma2ForCausalLM", "Gemma3ForCausalLM", MULTIMODAL),
    model_types=("gemma2", "gemma3_text", "gemma3"),
    gguf=(GGUFLayout("gemma2", "gemma2", "Gemma2ForCausalLM", _GEMMA_NORMS + ATTENTION + MLP,
                     norm_shift=1.0, read_keys=_gemma2_keys),
          GGUFLayout("gemma3", "gemma3_text", "Gemma3ForCausalLM",
                     _GEMMA_NORMS + ATTENTION + QK_NORMS + MLP, norm_shift=1.0,
                     read_keys=_gemma3_keys)),
    read_config=read_config,
    build=build,
    description="Gemma 2, Gemma 3 (text; of the multimodal ones, the language model)",
)
