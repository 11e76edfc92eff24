"""llama.cpp's GGUF LoRA files (convert_lora_to_gguf.py: `general.type` "adapter",
`adapter.type` "lora", `adapter.lora.alpha`, tensors `<base tensor>.lora_a` (r, in) and
`.lora_b` (out, r)) read as the `LoraAdapter` a PEFT directory gives (models/lora.py): GGUF
names mapped back to Hugging Face modules through the base architecture's layout, llama.cpp's
Q/K row order undone on the B of attn_q / attn_k, each tensor's alpha / rank folded into B."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..models.lora import AdapterError, LoraAdapter
from ..models.registry import gguf_layout
from .gguf import _open
from .gguf_archs import Meta, name_rule, unpermute_qk

FLOAT_TYPES = ("F32", "F16")


def read_gguf_lora(path: str | Path, cfg: dict[str, Any]) -> LoraAdapter:
    """The adapter in GGUF file `path` for a base of config `cfg` (num_hidden_layers,
    num_attention_heads, num_key_value_heads); AdapterError for a file that is not a LoRA
    adapter nbserve serves."""
    path = Path(path)
    if not path.is_file():
        raise AdapterError(f"no GGUF LoRA file at {path}")
    reader = _open(path)
    meta = Meta(reader)
    if meta.get("general.type") != "adapter" or meta.get("adapter.type") != "lora":
        raise AdapterError(f"{path} is not a GGUF LoRA adapter (general.type "
                           f"{meta.get('general.type')!r}, adapter.type "
                           f"{meta.get('adapter.type')!r}; llama.cpp's convert_lora_to_gguf.py "
                           "writes \"adapter\" and \"lora\")")
    arch = meta.get("general.architecture")
    layout = gguf_layout(str(arch))
    if layout is None:
        raise AdapterError(f"{path}: an adapter for architecture {arch!r}, which nbserve does "
                           "not serve natively")
    alpha = float(meta.get("adapter.lora.alpha") or 0.0)
    parts: dict[str, dict[str, tuple[torch.Tensor, int]]] = {}
    for t in reader.tensors:
        base, _, kind = t.name.rpartition(".")
        if kind not in ("lora_a", "lora_b"):
            raise AdapterError(f"{path}: tensor {t.name!r} is not a lora_a or lora_b tensor")
        if t.tensor_type.name not in FLOAT_TYPES:
            raise AdapterError(f"{path}: tensor {t.name!r} is {t.tensor_type.name}; nbserve "
                               f"reads LoRA tensors in {' or '.join(FLOAT_TYPES)} (convert "
                               "with --outtype f16 or f32)")
        rule = name_rule(base, tuple(int(n) for n in t.shape), layout, cfg)
        if rule is None or len(rule.hf_names) != 1:
            raise AdapterError(f"{path}: the adapter updates {base!r}, which this "
                               f"{cfg.get('architectures', [arch])[0]} model has not: "
                               "an adapter for another model?")
        values = torch.from_numpy(np.array(t.data, dtype=np.float32)).reshape(
            tuple(reversed([int(n) for n in t.shape])))
        parts.setdefault(rule.hf_names[0].removesuffix(".weight"), {})[kind] = \
            (values, rule.heads)
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, ab in parts.items():
        if set(ab) != {"lora_a", "lora_b"}:
            raise AdapterError(f"{path}: module {module!r} has lora_a or lora_b but not both")
        (a, _), (b, heads) = ab["lora_a"], ab["lora_b"]
        if heads:
            b = unpermute_qk(b, heads)
        rank = a.shape[0]
        modules[module] = (a, b * (alpha / rank if alpha else 1.0))  # llama.cpp's scale
    if not modules:
        raise AdapterError(f"{path}: the adapter has no LoRA tensors")
    return LoraAdapter(str(path), 1.0, modules)
