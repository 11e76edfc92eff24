"""`Family`: one architecture family's names and how to read and build it (`models.registry`
holds the registered ones; each file in models/families/ defines one)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, Protocol

import torch
from torch import nn

from .base import PagedModel

Tensors = Iterable[tuple[str, torch.Tensor]]


class GGUFKeys(Protocol):
    """What a family's GGUF metadata reader sees of a file (loading/gguf_archs.py implements
    it): the `{arch}.*` keys, refused when missing or given per layer, and the tensors' shapes.
    Names are without the `{arch}.` prefix."""

    path: Path

    def key(self, name: str) -> str:
        """The full metadata key, `{arch}.{name}`."""
        ...

    def has(self, name: str) -> bool: ...

    def raw(self, name: str, default: Any = None) -> Any:
        """The value as the file holds it (a number, string, bool or list), else `default`."""
        ...

    def need(self, name: str) -> Any:
        """The one value of a key a complete file has; ValueError when absent or per layer."""
        ...

    def get_int(self, name: str, default: int | None = None) -> int | None: ...

    def get_float(self, name: str, default: float | None = None) -> float | None:
        """A float32 value as the short decimal it was written from."""
        ...

    def refuse(self, name: str, why: str) -> NoReturn:
        """Raise a ValueError naming the key, its value and `why` nbserve cannot serve it."""
        ...

    def tensor_shape(self, name: str) -> tuple[int, ...] | None:
        """A tensor's GGUF shape (ne0, ne1, ...: ne1 counts rows), None if the file lacks it."""
        ...

    def tensor_values(self, name: str) -> list[float]:
        """A small tensor's values, dequantized, as float32 short decimals."""
        ...


GGUFReadKeys = Callable[[GGUFKeys, dict[str, Any]], None]

# HF module names the GGUF layouts share (Llama's checkpoint names).
ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
QK_NORMS = ("self_attn.q_norm", "self_attn.k_norm")
MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
NORMS = ("input_layernorm", "post_attention_layernorm")
TOP = ("model.embed_tokens", "model.norm", "lm_head")
LAYER = "model.layers.{bid}."


@dataclass(frozen=True, slots=True)
class GGUFLayout:
    """How llama.cpp's converter (convert_hf_to_gguf.py) wrote one HF model type into a GGUF
    file of architecture `architecture`, so that the GGUF loader can read it back as the
    Hugging Face checkpoint it came from.

    top, block_prefix, block: the HF modules (at the top, and in each block under
    `block_prefix`); the GGUF loader asks `gguf`'s own name map for their GGUF names. `{xid}`
    in a block module marks one of a stack of experts (GGUF keeps them as one 3-D tensor).
    permuted_qk: Q/K rows in llama.cpp's RoPE order. norm_shift: added to every `*norm.weight`
    (Gemma: 1). conv1d: Conv1D weights (in, out) the converter transposed (GPT-2).
    with_experts: this layout reads the files of `architecture` that have an expert count
    (GGUF "llama" with experts is Mixtral). partial_rotary: RoPE may cover part of a head.
    decoder_keys: start the config from the keys every RoPE decoder shares (else `read_keys`
    writes all of it). read_keys(keys, config): the architecture's own `{arch}.*` keys into
    config.json keys, the defaults llama.cpp assumes where the converter writes none, and
    refusals of what nbserve does not compute.
    """

    architecture: str
    model_type: str
    hf_architecture: str
    block: tuple[str, ...]
    top: tuple[str, ...] = TOP
    block_prefix: str = LAYER
    permuted_qk: bool = False
    norm_shift: float = 0.0
    conv1d: tuple[str, ...] = ()
    with_experts: bool = False
    partial_rotary: bool = False
    decoder_keys: bool = True
    read_keys: GGUFReadKeys | None = None


def no_sliding_window(cfg: dict[str, Any]) -> None:
    """Full attention in every layer (the GGUF converter writes no window key for these)."""
    cfg.update(use_sliding_window=False, sliding_window=None,
               layer_types=["full_attention"] * cfg["num_hidden_layers"])


def gguf_experts(keys: GGUFKeys, cfg: dict[str, Any]) -> tuple[int, int]:
    """(experts, experts per token) of a GGUF mixture of experts, every layer checked to route
    (no dense layers between) through a softmax."""
    experts, used = keys.get_int("expert_count") or 0, keys.get_int("expert_used_count") or 0
    if not experts or not used:
        raise ValueError(f"{keys.path} lacks {keys.key('expert_count')} or "
                         f"{keys.key('expert_used_count')}; is it a complete file?")
    dense = [i for i in range(cfg["num_hidden_layers"])
             if keys.tensor_shape(f"blk.{i}.ffn_gate_inp.weight") is None]
    if dense:
        raise ValueError(f"{keys.path}: layers {dense} have no router (blk.N.ffn_gate_inp); "
                         "nbserve reads files whose every layer routes to experts")
    softmax = 1  # gguf.ExpertGatingFuncType.SOFTMAX, llama.cpp's default
    if keys.get_int("expert_gating_func", softmax) != softmax:
        keys.refuse("expert_gating_func", "experts weighted otherwise than by a softmax")
    return experts, used


class FamilyConfig(Protocol):
    """What a family's config (its `read_config`'s, passed to its `build`) offers every
    loader: the rows of the embedding."""

    @property
    def vocab_size(self) -> int: ...


@dataclass(frozen=True, slots=True)
class Family:
    """One architecture family and the names it goes by.

    hf_architectures: config.json `architectures` / transformers class names it serves.
    model_types: config.json `model_type` values (used when `architectures` is absent).
    gguf: how GGUF files of this family were written, one `GGUFLayout` per `general.architecture`
    it reads (the GGUF loader turns a file's metadata into a config.json-style dict).
    read_config(config_dict, name) -> config: raises ValueError naming what it cannot serve.
    build(config, tensors, device=, dtype=, **options) -> a StepModel from HF-named tensors;
    options the loaders and adoption pass: transposed_head, fuse, pack, float_kernel.
    adopt_module(module) -> a StepModel over a plain torch module's own tensors when the module
    is of this family (nanoGPT's GPT, nanochat's GPT), else None.
    """

    name: str
    hf_architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    gguf: tuple[GGUFLayout, ...]
    read_config: Callable[[dict[str, Any], str], FamilyConfig]  # passed to build
    build: Callable[..., PagedModel]
    description: str = ""
    adopt_module: Callable[[nn.Module], PagedModel | None] | None = None

    def config_of(self, config: dict[str, Any], name: str = "model") -> FamilyConfig:
        """`read_config`, a missing config.json key reported as a ValueError naming it."""
        try:
            return self.read_config(config, name)
        except KeyError as exc:
            raise ValueError(f"the config of {name} lacks {exc.args[0]!r}, which a "
                             f"{self.description or self.name} model needs") from None
