"""LoRA adapter files as `LoraAdapter`s (models/lora.py): PEFT directories, and llama.cpp's
GGUF LoRA files (convert_lora_to_gguf.py: `general.type` "adapter", `adapter.type` "lora",
`adapter.lora.alpha`, tensors `<base tensor>.lora_a` (r, in) and `.lora_b` (out, r)), whose
GGUF names are mapped back to Hugging Face modules through the base architecture's layout and
each tensor's alpha / rank folded into B. Their B of attn_q / attn_k keep llama.cpp's Q/K row
order, undone when installed on a base (which knows its heads). Layer counts and shapes are
the base's to check, at install."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..models.lora import AdapterError, LoraAdapter, read_peft_adapter
from ..models.registry import gguf_layout
from .gguf import _open
from .gguf_archs import Meta, name_rule

FLOAT_TYPES = ("F32", "F16")
# name_rule reads these of a base config: any layer index maps (the base checks its own
# count at install) and no row order is undone here (`LoraAdapter.llama_qk_rows`)
ANY_BASE: dict[str, Any] = {"num_hidden_layers": 1 << 30, "num_attention_heads": 0,
                            "num_key_value_heads": 0}


def read_adapter(path: str | Path) -> LoraAdapter:
    """The adapter at `path`: a .gguf file (llama.cpp's), else a PEFT directory;
    AdapterError (a ValueError) for what nbserve does not serve."""
    return read_gguf_lora(path) if str(path).endswith(".gguf") else read_peft_adapter(path)


def read_gguf_lora(path: str | Path) -> LoraAdapter:
    """The adapter in llama.cpp's GGUF LoRA file `path`; AdapterError for a file that is not
    a LoRA adapter nbserve serves."""
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
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for t in reader.tensors:
        base, _, kind = t.name.rpartition(".")
        if kind not in ("lora_a", "lora_b"):
            raise AdapterError(f"{path}: tensor {t.name!r} is not a lora_a or lora_b tensor")
        if t.tensor_type.name not in FLOAT_TYPES:
            raise AdapterError(f"{path}: tensor {t.name!r} is {t.tensor_type.name}; nbserve "
                               f"reads LoRA tensors in {' or '.join(FLOAT_TYPES)} (convert "
                               "with --outtype f16 or f32)")
        rule = name_rule(base, tuple(int(n) for n in t.shape), layout, ANY_BASE)
        if rule is None or len(rule.hf_names) != 1:
            raise AdapterError(f"{path}: the adapter updates {base!r}, which a {arch} model "
                               "has not (or not as one matrix)")
        values = torch.from_numpy(np.array(t.data, dtype=np.float32)).reshape(
            tuple(reversed([int(n) for n in t.shape])))
        parts.setdefault(rule.hf_names[0].removesuffix(".weight"), {})[kind] = values
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, ab in parts.items():
        if set(ab) != {"lora_a", "lora_b"}:
            raise AdapterError(f"{path}: module {module!r} has lora_a or lora_b but not both")
        a, b = ab["lora_a"], ab["lora_b"]
        rank = a.shape[0]
        modules[module] = (a, b * (alpha / rank if alpha else 1.0))  # llama.cpp's scale
    if not modules:
        raise AdapterError(f"{path}: the adapter has no LoRA tensors")
    return LoraAdapter(str(path), 1.0, modules, llama_qk_rows=layout.permuted_qk)
