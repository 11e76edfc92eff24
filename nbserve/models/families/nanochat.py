"""nanochat's GPT (karpathy/nanochat, nanochat/gpt.py at commit 92d63d4e8bb4): a `GPT` module
in the notebook is recognised by its parameter names and config and served by
models/nanochat.py over its own tensors (no copy); checkpoint directories are read by
loading/nanochat_dir.py. nanochat has no config.json, so no HF architecture name maps here;
`read_config` reads the `model_config` of a checkpoint's meta JSON.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..family import Family
from ..nanochat import NanochatConfig, NanochatModel, build_nanochat, window_sizes

_CONFIG_FIELDS = ("sequence_len", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd")
_SIGNATURE = ("transformer.wte.weight", "transformer.h.0.attn.c_q.weight", "lm_head.weight")


def read_config(cfg: dict[str, Any], name: str) -> NanochatConfig:
    """A nanochat GPTConfig as a dict (a checkpoint's meta `model_config`)."""
    return NanochatConfig.from_model_config(cfg, name)


def build(cfg: NanochatConfig, tensors: Iterable[tuple[str, torch.Tensor]],
          **options: Any) -> NanochatModel:
    return build_nanochat(cfg, tensors, **options)


def adopt_nanochat(module: nn.Module) -> NanochatModel | None:
    """models/nanochat.py over a nanochat `GPT` module's own tensors, or None when `module`
    does not look like one (its config has nanochat's GPTConfig fields, its parameters
    `transformer.wte`, `transformer.h.N.attn.c_q`, `lm_head`). Raises ValueError naming the
    parameters that differ when it is one, but of another version of gpt.py."""
    c = getattr(module, "config", None)
    names = {n for n, _ in module.named_parameters()}
    if c is None or not set(_SIGNATURE) <= names or \
            not all(isinstance(getattr(c, f, None), int) for f in _CONFIG_FIELDS):
        return None
    sizes = getattr(module, "window_sizes", None)  # what its forward reads
    if sizes is None:
        sizes = window_sizes(c.sequence_len, str(getattr(c, "window_pattern", "L")), c.n_layer)
    wte = module.get_parameter("transformer.wte.weight")
    cfg = NanochatConfig.of(c.vocab_size, int(wte.shape[0]), c.n_layer, c.n_head, c.n_kv_head,
                            c.n_embd, c.sequence_len, [tuple(s) for s in sizes],
                            type(module).__name__)
    return build_nanochat(cfg, module.named_parameters(), share=True)


FAMILY = Family(
    name="nanochat",
    hf_architectures=(),
    model_types=(),
    gguf=(),
    read_config=read_config,
    build=build,
    description="nanochat",
    adopt_module=adopt_nanochat,
)
