"""Headless checkpoints: a decoder saved without its LM head, as embedding models ship.

transformers' bare backbone (`Qwen3Model`, `Qwen2Model`, `LlamaModel`...) saves its tensors
without the `model.` prefix (`embed_tokens.weight`, `layers.0.…`, `norm.weight`) and has no
`lm_head`; Qwen3-Embedding and gte-Qwen2 ship that way, some under a `*ForCausalLM` name. The
HF loader reads them through the family of the causal model (the backbone is the same), with
the prefix put back; the model is headless when no head is stored and none is tied to the
embedding, or when the checkpoint declares itself an embedding model (a bare architecture, a
sentence-transformers `modules.json`). The head slot then holds the embedding (no copy), the model
says it has no head (`SlotModel.has_lm_head` False) and the engine refuses generation on it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from ..models import registry

PREFIX = "model."
HEAD = "lm_head.weight"
BARE_MARK = "embed_tokens.weight"  # a bare decoder's first tensor, without the prefix
_BARE_SUFFIX, _CAUSAL_SUFFIX = "Model", "ForCausalLM"


def causal_config(config: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """`config` with a bare backbone architecture (`Qwen3Model`) renamed to the causal model a
    native family serves (`Qwen3ForCausalLM`), and whether it was bare. Other configs pass
    unchanged."""
    archs = config.get("architectures") or []
    if not archs or not archs[0].endswith(_BARE_SUFFIX):
        return config, False
    causal = archs[0][:-len(_BARE_SUFFIX)] + _CAUSAL_SUFFIX
    if causal not in registry.native_architectures():
        return config, False
    return {**config, "architectures": [causal, *archs[1:]]}, True


def tensor_names(files: list[Path]) -> set[str]:
    """Every tensor name the safetensors `files` hold (their headers only)."""
    from safetensors import safe_open

    names: set[str] = set()
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            names.update(sf.keys())
    return names


def is_bare(names: set[str]) -> bool:
    """Whether the names are a bare decoder's (no `model.` prefix on the backbone)."""
    return BARE_MARK in names and not any(n.startswith(PREFIX) for n in names)


def prefixed(tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """A bare decoder's tensors under the causal model's names (`model.` before all but the
    head)."""
    for name, tensor in tensors:
        yield (name if name.startswith("lm_head.") else PREFIX + name), tensor


def is_headless(names: set[str], tied: bool, declared_embedding: bool) -> bool:
    """No LM head stored, and none tied to the embedding (or the checkpoint declares itself an
    embedding model, whose tied head would be no language model's)."""
    return HEAD not in names and (not tied or declared_embedding)
