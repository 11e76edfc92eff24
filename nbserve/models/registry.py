"""The model registry: which architectures nbserve runs natively, and how to build each.

A loader (HF directory, GGUF file) or the adoption of a `transformers` object asks the registry
for the family of a checkpoint, then lets that family read its config and build its model. A
new family is one model file plus one `register(Family(...))` entry (see docs/architecture.md).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .base import PagedModel
from .family import Family, FamilyConfig, GGUFLayout

__all__ = ["Family", "GGUFLayout", "families", "register"]


_FAMILIES: list[Family] = []
_BUILTINS_DONE = False


def register(family: Family) -> Family:
    """Add a family (a later registration of the same name replaces the earlier one)."""
    _FAMILIES[:] = [f for f in _FAMILIES if f.name != family.name]
    _FAMILIES.append(family)
    return family


def families() -> list[Family]:
    _register_builtins()
    return list(_FAMILIES)


def native_architectures() -> list[str]:
    """Every HF architecture name that nbserve runs on its own engine, sorted."""
    return sorted(a for f in families() for a in f.hf_architectures)


def for_hf_config(config: dict[str, Any], name: str = "model") -> Family:
    """The family of a config.json dict; ValueError listing the native ones otherwise."""
    archs = config.get("architectures") or []
    model_type = config.get("model_type", "")
    for family in families():
        if (archs and archs[0] in family.hf_architectures) or \
                (not archs and model_type in family.model_types):
            return family
    raise ValueError(
        f"unsupported architecture {(archs[0] if archs else model_type)!r} in {name}: nbserve "
        f"implements {', '.join(native_architectures())}. Serve other models with "
        "launch(transformers_model, tokenizer=...) or the StepModel protocol.")


def gguf_layout(architecture: str, experts: int = 0) -> GGUFLayout | None:
    """How a GGUF file of `general.architecture` `architecture` was written, or None if no
    family reads it. A file with `experts` takes a family's layout for such files first (GGUF
    "llama" with experts is Mixtral)."""
    layouts = [g for f in families() for g in f.gguf if g.architecture == architecture]
    return next((g for g in layouts if g.with_experts and experts), None) or \
        next((g for g in layouts if not g.with_experts), None)


def gguf_architectures() -> dict[str, str]:
    """Every GGUF architecture nbserve reads, with the HF architecture name it reads as."""
    return {g.architecture: g.hf_architecture for f in families() for g in f.gguf
            if not g.with_experts}


def descriptions() -> list[str]:
    return [f.description or f.name for f in families()]


def for_class_name(class_name: str) -> Family | None:
    """The family that runs a `transformers` model class natively, or None."""
    return next((f for f in families() if class_name in f.hf_architectures), None)


def read_config(config: dict[str, Any], name: str = "model") -> tuple[Family, FamilyConfig]:
    """(family, its config object) for a config.json dict."""
    family = for_hf_config(config, name)
    return family, family.config_of(config, name)


def for_module(module: nn.Module) -> PagedModel | None:
    """A StepModel over `module`'s own tensors from the first family that recognises it (a
    nanoGPT or nanochat GPT), or None."""
    for family in families():
        if family.adopt_module is not None:
            step = family.adopt_module(module)
            if step is not None:
                return step
    return None


def _register_builtins() -> None:
    """Register the built-in family files once (a user's `register` of the same name wins)."""
    global _BUILTINS_DONE
    if _BUILTINS_DONE:
        return
    _BUILTINS_DONE = True
    from .families import BUILTIN

    have = {f.name for f in _FAMILIES}
    _FAMILIES[:0] = [f for f in BUILTIN if f.name not in have]
