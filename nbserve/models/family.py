"""`Family`: one architecture family's names and how to read and build it (`models.registry`
holds the registered ones; each file in models/families/ defines one)."""

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
