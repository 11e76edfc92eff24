"""Which torch dtype serves a model: one rule for every loader and for adopted models."""

from __future__ import annotations

import torch

MIXED16 = "mixed16"  # dtype name: float32, plus float16 weight copies for 1-2-row steps
QUANTIZED = "quantized"  # float32, plus quantized weight copies for steps of a few rows
QUANTIZED_EXACT = "quantized-exact"  # the same, with float32 arithmetic on every kernel path
WEIGHT_FORMATS = (MIXED16, QUANTIZED, QUANTIZED_EXACT)  # dtype names beyond torch's
QUANTIZED_FORMATS = (QUANTIZED, QUANTIZED_EXACT)  # the ones whose blocks serve every step

_NAMES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def resolve_dtype(dtype: str | torch.dtype | None, device: str | torch.device) -> torch.dtype:
    """None or "auto": bfloat16 on CUDA (float16 where bfloat16 is unsupported), float32
    elsewhere; else a torch dtype or a name ("float16", "bf16", torch.bfloat16...) among
    float32, bfloat16 and float16. The weight formats ("mixed16", "quantized") are float32
    plus copies: their callers resolve "float32"."""
    if dtype is None or dtype == "auto":
        if torch.device(device).type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    resolved = _NAMES.get(str(dtype).replace("torch.", "")) if isinstance(dtype, str) else dtype
    if resolved not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be float32, bfloat16 or float16 (or 'auto', or the "
                         f"weight formats {', '.join(WEIGHT_FORMATS)}), got {dtype!r}")
    return resolved
