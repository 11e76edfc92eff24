"""Which torch dtype serves a model: one rule for every loader and for adopted models."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

MIXED16 = "mixed16"  # dtype name: float32, plus float16 weight copies for 1-2-row steps
QUANTIZED = "quantized"  # float32, plus quantized weight copies for steps of a few rows
QUANTIZED_EXACT = "quantized-exact"  # the same, with float32 arithmetic on every kernel path
WEIGHT_FORMATS = (MIXED16, QUANTIZED, QUANTIZED_EXACT)  # dtype names beyond torch's
QUANTIZED_FORMATS = (QUANTIZED, QUANTIZED_EXACT)  # the ones whose blocks serve every step

WEIGHTS = ("auto", "blocks", "dense", "mixed16")  # the weight formats `load(weights=)` takes
COMPUTE_DTYPES = ("auto", "float32", "bfloat16", "float16")  # what `load(dtype=)` takes
# The dtype names that carried a weight format before `weights` and `exact`: (weights, exact).
FORMAT_ALIASES = {MIXED16: ("mixed16", False), QUANTIZED: ("blocks", False),
                   QUANTIZED_EXACT: ("blocks", True)}

_NAMES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def resolve_dtype(dtype: str | torch.dtype | None, device: str | torch.device) -> torch.dtype:
    """None or "auto": bfloat16 on CUDA (float16 where bfloat16 is unsupported), float32
    elsewhere; else a torch dtype or a name ("float16", "bf16", torch.bfloat16...) among
    float32, bfloat16 and float16. The weight format is apart (`weight_choice`)."""
    if dtype is None or dtype == "auto":
        if torch.device(device).type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    resolved = _NAMES.get(str(dtype).replace("torch.", "")) if isinstance(dtype, str) else dtype
    if resolved not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be one of {', '.join(COMPUTE_DTYPES)} (the weight "
                         f"format is `weights`: {', '.join(WEIGHTS)}), got {dtype!r}")
    return resolved


@dataclass(frozen=True, slots=True)
class WeightChoice:
    """A load's weight format and compute dtype, as asked (see `weight_choice`)."""

    dtype: str | torch.dtype | None  # the compute dtype asked; None: "auto"
    weights: str  # one of WEIGHTS
    exact: bool  # blocks: float32 arithmetic on every kernel path (no rounded inputs)

    @property
    def format(self) -> str | None:
        """The loader's name for the copies it adds or the blocks it serves ("mixed16",
        "quantized", "quantized-exact"); None: dense weights, or "auto" left to the loader."""
        if self.weights == "blocks":
            return QUANTIZED_EXACT if self.exact else QUANTIZED
        return MIXED16 if self.weights == "mixed16" else None

    @property
    def auto(self) -> bool:
        """Whether the loader picks the format (a quantized GGUF on CPU: its blocks)."""
        return self.weights == "auto" and self.dtype is None


def weight_choice(dtype: str | torch.dtype | None = None, weights: str = "auto",
                  exact: bool = False) -> WeightChoice:
    """`dtype` (the compute dtype), `weights` (the weight format) and `exact` checked, the old
    dtype names that carried a format ("mixed16", "quantized", "quantized-exact") mapped to
    `weights`/`exact` with a FutureWarning naming the new spelling. Bad values: ValueError
    listing the valid ones."""
    if not isinstance(exact, bool):
        raise ValueError(f"exact must be True or False, got {exact!r}")
    if not isinstance(weights, str) or weights.lower() not in WEIGHTS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    weights = weights.lower()
    name = dtype.lower() if isinstance(dtype, str) else None
    if name in FORMAT_ALIASES:
        weights_for, exact_for = FORMAT_ALIASES[name]
        if weights not in ("auto", weights_for):
            raise ValueError(f"dtype={dtype!r} means weights={weights_for!r}, but "
                             f"weights={weights!r} was given")
        new = f"weights={weights_for!r}" + (", exact=True" if exact_for else "")
        warnings.warn(f"dtype={dtype!r} is now spelled {new} (dtype is the compute dtype "
                      "only)", FutureWarning, stacklevel=3)
        return WeightChoice(None, weights_for, exact or exact_for)
    if exact and weights in ("dense", "mixed16"):
        raise ValueError(f"exact=True applies to weights='blocks' (or 'auto'); weights="
                         f"{weights!r} has no rounded kernels to turn off")
    if dtype == "auto":
        dtype = None
    if dtype is not None:
        resolve_dtype(dtype, "cpu")  # a bad name fails here, listing the valid ones
    return WeightChoice(dtype, weights, exact)


def weights_of(weight_format: str) -> tuple[str, bool]:
    """(weights, exact) a model's `weight_format` ("quantized", "mixed16", a torch dtype's
    name...) stands for: what the load line and /stats report beside the compute dtype."""
    if weight_format in FORMAT_ALIASES:
        return FORMAT_ALIASES[weight_format]
    return "dense", False


def load_kwargs(weight_format: str) -> dict[str, str | bool]:
    """The `load()` keywords that build a model of this `weight_format`, the name a model
    reports ("quantized", "quantized-exact", "mixed16", or a dtype's such as "float32"): the
    inverse of `weights_of`, for code that names formats the way /stats does."""
    if weight_format in FORMAT_ALIASES:
        weights, exact = FORMAT_ALIASES[weight_format]
        return {"weights": weights, "exact": True} if exact else {"weights": weights}
    resolve_dtype(weight_format, "cpu")  # a bad name fails here, listing the valid ones
    return {"weights": "dense", "dtype": weight_format}
