"""The model registry: which architectures nbserve runs natively, and how to build each.

A loader (HF directory, GGUF file) or the adoption of a `transformers` object asks the registry
for the family of a checkpoint, then lets that family read its config and build its model. A
new family is one model file plus one `register(Family(...))` entry (see docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

Tensors = Iterable[tuple[str, torch.Tensor]]


@dataclass(frozen=True, slots=True)
class Family:
    """One architecture family and the names it goes by.

    hf_architectures: config.json `architectures` / transformers class names it serves.
    model_types: config.json `model_type` values (used when `architectures` is absent).
    gguf_architectures: GGUF `general.architecture` values, each with the HF architecture name
    it reads as (the GGUF loader turns a file's metadata into a config.json-style dict).
    read_config(config_dict, name) -> config: raises ValueError naming what it cannot serve.
    build(config, tensors, device=, dtype=, **options) -> a StepModel from HF-named tensors;
    options the loaders and adoption pass: transposed_head, fuse, pack, float_kernel.
    adopt_module(module) -> a StepModel over a plain torch module's own tensors when the module
    is of this family (nanoGPT's GPT, nanochat's GPT), else None.
    """

    name: str
    hf_architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    gguf_architectures: dict[str, str]
    read_config: Callable[[dict[str, Any], str], Any]
    build: Callable[..., Any]
    description: str = ""
    adopt_module: Callable[[Any], Any] | None = None

    def config_of(self, config: dict[str, Any], name: str = "model") -> Any:
        """`read_config`, a missing config.json key reported as a ValueError naming it."""
        try:
            return self.read_config(config, name)
        except KeyError as exc:
            raise ValueError(f"the config of {name} lacks {exc.args[0]!r}, which a "
                             f"{self.description or self.name} model needs") from None


_FAMILIES: list[Family] = []


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


def for_gguf(architecture: str) -> Family | None:
    """The family of a GGUF `general.architecture`, or None."""
    return next((f for f in families() if architecture in f.gguf_architectures), None)


def gguf_architectures() -> dict[str, str]:
    """Every GGUF architecture nbserve reads, with the HF architecture name it reads as."""
    return {g: hf for f in families() for g, hf in f.gguf_architectures.items()}


def descriptions() -> list[str]:
    return [f.description or f.name for f in families()]


def for_class_name(class_name: str) -> Family | None:
    """The family that runs a `transformers` model class natively, or None."""
    return next((f for f in families() if class_name in f.hf_architectures), None)


def read_config(config: dict[str, Any], name: str = "model") -> tuple[Family, Any]:
    """(family, its config object) for a config.json dict."""
    family = for_hf_config(config, name)
    return family, family.config_of(config, name)


def for_module(module: Any) -> Any:
    """A StepModel over `module`'s own tensors from the first family that recognises it (a
    nanoGPT or nanochat GPT), or None."""
    for family in families():
        if family.adopt_module is not None:
            step = family.adopt_module(module)
            if step is not None:
                return step
    return None


def _register_builtins() -> None:
    """Import the family files (each registers itself) once."""
    from . import families as _families  # noqa: F401
