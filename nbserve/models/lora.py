"""PEFT LoRA adapter directories (`adapter_config.json` + `adapter_model.safetensors`) read and
fitted onto a decoder's matmul holders (execution/lora.py applies them per row).

What PEFT's plain LoRA allows is served: any rank, `lora_alpha`, `use_rslora`, any of the
decoder's projections (q/k/v/o, gate/up/down, fused or not). What would change the model
otherwise is refused when the adapter is loaded, with what to change: `fan_in_fan_out`,
`bias` other than "none", `modules_to_save`, DoRA, per-module rank or alpha patterns, LoRA on
the embeddings or the LM head. An adapter whose tensors do not fit the base (another shape,
a module the base has not) is refused with the mismatch named.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..execution.holders import FusedProjection, Linear
from ..execution.lora import AdapterRows, LoraSlot
from .rope import unpermute_qk

PEFT_PREFIX = "base_model.model."


class AdapterError(ValueError):
    """An adapter that cannot be served on this base (the message says why and what to do)."""


@dataclass(slots=True)
class LoraAdapter:
    """An adapter as read: its scale and each target module's (A (r, in), B (out, r))."""

    path: str
    scale: float
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]  # "model.layers.0.self_attn.q_proj"
    llama_qk_rows: bool = False  # B of q_proj / k_proj in llama.cpp's row order (a GGUF's)


def read_peft_adapter(path: str | Path) -> LoraAdapter:
    """Read a PEFT LoRA directory; AdapterError for what nbserve does not serve."""
    from safetensors.torch import load_file

    folder = Path(path)
    config_file, weights_file = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not config_file.is_file() or not weights_file.is_file():
        raise AdapterError(f"{folder} is not a PEFT adapter directory: it needs "
                           "adapter_config.json and adapter_model.safetensors (PEFT's "
                           "save_pretrained writes both)")
    config: dict[str, Any] = json.loads(config_file.read_text())
    _check_config(config, folder)
    rank = int(config.get("r", 8))
    alpha = float(config.get("lora_alpha", rank))
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in load_file(str(weights_file)).items():
        module, _, kind = name.removeprefix(PEFT_PREFIX).rpartition(".lora_")
        if kind not in ("A.weight", "B.weight"):
            raise AdapterError(f"{folder}: tensor {name!r} is not a LoRA A or B weight (nbserve "
                               "serves plain LoRA: no DoRA magnitudes, embeddings or biases)")
        pairs.setdefault(module, {})[kind[0]] = tensor
    modules = {}
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{folder}: module {module!r} has lora_A or lora_B but not both")
        if ab["A"].shape[0] != ab["B"].shape[1]:
            raise AdapterError(f"{folder}: module {module!r} has lora_A {tuple(ab['A'].shape)}"
                               f" and lora_B {tuple(ab['B'].shape)} of different ranks")
        modules[module] = (ab["A"], ab["B"])
    if not modules:
        raise AdapterError(f"{folder}: the adapter has no LoRA tensors")
    return LoraAdapter(str(folder), scale, modules)


def _check_config(config: dict[str, Any], folder: Path) -> None:
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise AdapterError(f"{folder}: peft_type {peft_type!r}; nbserve serves LoRA adapters")
    refusals = [
        (config.get("fan_in_fan_out"), "fan_in_fan_out is true (Conv1D-style weights)"),
        (config.get("bias", "none") != "none", f"bias is {config.get('bias')!r}: only "
         "\"none\" (the base's biases unchanged)"),
        (config.get("modules_to_save"), f"modules_to_save {config.get('modules_to_save')!r} "
         "(full copies of modules, not a low-rank update)"),
        (config.get("use_dora"), "use_dora is true (DoRA)"),
        (config.get("rank_pattern"), "rank_pattern sets per-module ranks"),
        (config.get("alpha_pattern"), "alpha_pattern sets per-module alphas"),
    ]
    for refused, why in refusals:
        if refused:
            raise AdapterError(f"{folder}: nbserve does not serve this adapter: {why}; train it "
                               "with plain LoRA settings, or merge it into the weights")


def _holder_parts(named: list[tuple[Linear | FusedProjection, list[str]]]
                  ) -> dict[str, tuple[Linear | FusedProjection, int, int]]:
    """Each module a LoRA may target: (its holder, its first output column, its width)."""
    parts: dict[str, tuple[Linear | FusedProjection, int, int]] = {}
    for holder, names in named:
        sizes = holder.sizes if isinstance(holder, FusedProjection) else [holder.out_features]
        if len(names) != len(sizes):  # a weight that came fused: one module over all of it
            names, sizes = names[:1], [sum(sizes)]
        start = 0
        for name, size in zip(names, sizes):
            parts[name.removesuffix(".weight")] = (holder, start, size)
            start += size
    return parts


def install_adapter(named: list[tuple[Linear | FusedProjection, list[str]]], rows: AdapterRows,
                    index: int, adapter: LoraAdapter, device: torch.device, dtype: torch.dtype,
                    family: str, heads: tuple[int, int]) -> None:
    """Fit `adapter` onto the holders of `named` (a decoder's `_named_holders`, the LM head
    left out) as adapter `index`; AdapterError naming the first mismatch (nothing installed).
    `heads`: the base's query and key/value heads (to undo llama.cpp's Q/K row order)."""
    parts = _holder_parts(named)
    per_holder: dict[int, list[tuple[int, int, torch.Tensor, torch.Tensor]]] = {}
    holders: dict[int, Linear | FusedProjection] = {}
    for module, (a, b) in sorted(adapter.modules.items()):
        found = parts.get(module)
        if found is None:
            kinds = sorted({m.rpartition(".")[2] for m in parts})
            raise AdapterError(f"{adapter.path}: the adapter targets {module!r}, which this "
                               f"{family} model has not (its LoRA targets are "
                               f"{', '.join(kinds)}): an adapter for another model?")
        holder, start, width = found
        kind = module.rpartition(".")[2]
        if adapter.llama_qk_rows and kind in ("q_proj", "k_proj") and b.shape[0] == width:
            b = unpermute_qk(b, heads[0] if kind == "q_proj" else heads[1])
        in_features = holder.weight.shape[1]
        if a.shape[1] != in_features or b.shape[0] != width:
            raise AdapterError(f"{adapter.path}: {module} has lora_A {tuple(a.shape)} and "
                               f"lora_B {tuple(b.shape)}, but the base's {module} maps "
                               f"{in_features} to {width} features: an adapter for another "
                               "model size?")
        holders[id(holder)] = holder
        per_holder.setdefault(id(holder), []).append((start, width, a, b))
    for key, holder in holders.items():
        out = holder.weight.shape[0]
        pieces = per_holder[key]
        a_all = torch.cat([a for _, _, a, _ in pieces]).to(device=device, dtype=dtype)
        b_all = torch.zeros(out, a_all.shape[0], device=device, dtype=dtype)
        col = 0
        for start, width, a, b in pieces:
            r = a.shape[0]
            b_all[start:start + width, col:col + r] = (b.float() * adapter.scale).to(dtype)
            col += r
        if holder.lora is None:
            holder.lora = LoraSlot(rows, out)
        holder.lora.pairs[index] = (a_all.contiguous(), b_all)


def remove_adapter(named: list[tuple[Linear | FusedProjection, list[str]]], index: int) -> None:
    """Drop adapter `index` from every holder."""
    for holder, _ in named:
        if holder.lora is not None:
            holder.lora.pairs.pop(index, None)
