"""A weight's serving form: one object per matmul weight, chosen once at load (`WeightFormats`),
with one interface (`WeightForm`) whatever it holds.

- `Float32Form`: the float32 weight as it is; a few rows through nbserve's C kernel over it
  (`KernelLinear`, no copy), more through its oneDNN-packed copy (`PackedCopy`) where it has
  one, else split across threads (`split_linear`).
- `Float16Form` (weights="mixed16"): one or two rows through a float16 copy (`HalfCopy`), more
  as `Float32Form` does without the kernel.
- `BlockForm` (weights="blocks"): quantized blocks (`QuantBlocks`, any of `BLOCK_TYPES`)
  through the C kernel for every row count; the float32 weight is only their dense view.
- `PartsForm`: fused weights whose parts are blocks of different types (Gemma 3's Q5_0 q and
  k beside a Q8_0 v), each part's kernel giving its slice of the output.

Each form decides which of its paths serves how many rows; the model's layers only call
`matmul`. A holder of a weight (`Linear`, `FusedProjection`) has one declared slot for its
form, None while it is served as a plain weight.
"""

from __future__ import annotations

import copy
from typing import Protocol

import torch
import torch.nn.functional as F

from .linear import HalfCopy, PackedCopy, split_linear
from .quant import KernelLinear, NormWeights, QuantBlocks


class RowNorm(NormWeights, Protocol):
    """An RMSNorm a form may run inside its kernel call (its weight and eps), or itself."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class WeightForm(Protocol):
    """What every serving form of a weight (N, K) offers."""

    @property
    def shape(self) -> tuple[int, int]:
        """(out_features, in_features)."""
        ...

    @property
    def nbytes(self) -> int:
        """Bytes it adds to the model's own weights (its copies or blocks)."""
        ...

    @property
    def weight_format(self) -> str | None:
        """The `dtype=` name it serves a model under ("mixed16", "quantized", ...); None: the
        model's dtype."""
        ...

    @property
    def serves_every_step(self) -> bool:
        """Whether every row count runs without the float32 weight (which may then go)."""
        ...

    @property
    def kernel(self) -> KernelLinear | None:
        """The C kernel serving its few-row steps (the decode stack's weight), or None."""
        ...

    def matmul(self, x: torch.Tensor, norm: RowNorm | None = None,
               gated: bool = False) -> torch.Tensor:
        """x (..., K) @ w.T (+ bias) for any row count; of norm(x) with `norm`, of silu(a) * b
        for x (..., 2K) = [a | b] with `gated` (inside the kernel call where it serves)."""
        ...

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (any shape) of the weight, (*ids.shape, K): an embedding lookup."""
        ...

    def dense(self) -> torch.Tensor:
        """The float32 weight it stands for (for blocks: dequantized now)."""
        ...

    def __deepcopy__(self, memo: dict[int, object]) -> WeightForm | None:
        """The form of a replica's weight (copies follow the copied tensors); None where it
        cannot serve there (a float32 kernel's weight copied off the CPU)."""
        ...


def _prepared(x: torch.Tensor, norm: RowNorm | None, gated: bool) -> torch.Tensor:
    """norm(x), or silu(a) * b of x = [a | b]: what a path without the kernel multiplies."""
    if norm is not None:
        x = norm(x)
    if gated:
        half = x.shape[-1] // 2
        x = F.silu(x[..., :half]) * x[..., half:]
    return x


def _rows(x: torch.Tensor) -> int:
    """The input rows of x (..., K), or of a gated input (..., 2K)."""
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


class _Dense:
    """The float paths of the float forms: packed copy, else split (the weight shared)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 packed: PackedCopy | None):
        self.weight, self.bias, self.packed = weight, bias, packed

    @property
    def shape(self) -> tuple[int, int]:
        return self.weight.shape[0], self.weight.shape[1]

    @property
    def serves_every_step(self) -> bool:
        return False

    def _plain(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self.packed(x)
        return split_linear(x, self.weight, self.bias)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)

    def dense(self) -> torch.Tensor:
        if self.weight.device.type == "meta" and self.packed is not None:
            return self.packed.weight.to_dense().contiguous()
        return self.weight

    def _copied(self, memo: dict[int, object]) -> tuple[torch.Tensor, torch.Tensor | None,
                                                        PackedCopy | None]:
        return (copy.deepcopy(self.weight, memo), copy.deepcopy(self.bias, memo),
                copy.deepcopy(self.packed, memo))


class Float32Form(_Dense):
    """A float32 weight: up to the kernel's rows through `kernel` (the C kernel over this
    weight, norm and gate inside its call), more through `packed`, else split."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 packed: PackedCopy | None = None, kernel: KernelLinear | None = None):
        super().__init__(weight, bias, packed)
        self._kernel = kernel

    @property
    def kernel(self) -> KernelLinear | None:
        return self._kernel

    @property
    def weight_format(self) -> str | None:
        return None

    @property
    def nbytes(self) -> int:
        return 0 if self.packed is None else self.packed.nbytes

    def with_packed(self, packed: PackedCopy) -> Float32Form:
        return Float32Form(self.weight, self.bias, packed, self._kernel)

    def matmul(self, x: torch.Tensor, norm: RowNorm | None = None,
               gated: bool = False) -> torch.Tensor:
        kernel = self._kernel
        if kernel is not None and kernel.serves_rows(_rows(x)) \
                and x.dtype == torch.float32 and x.device.type == "cpu":
            return kernel(x, norm=norm, gated=gated)
        return self._plain(_prepared(x, norm, gated))

    def __deepcopy__(self, memo: dict[int, object]) -> Float32Form:
        weight, bias, packed = self._copied(memo)
        return Float32Form(weight, bias, packed, copy.deepcopy(self._kernel, memo))


class Float16Form(_Dense):
    """A float32 weight with a float16 copy for steps of one or two rows (`HalfCopy`); more
    rows through `packed`, else split (weights="mixed16")."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, half: HalfCopy,
                 packed: PackedCopy | None = None):
        super().__init__(weight, bias, packed)
        self.half = half

    @property
    def kernel(self) -> KernelLinear | None:
        return None

    @property
    def weight_format(self) -> str | None:
        return "mixed16"

    @property
    def nbytes(self) -> int:
        half = self.half.weight.numel() * self.half.weight.element_size()
        return half + (0 if self.packed is None else self.packed.nbytes)

    def with_packed(self, packed: PackedCopy) -> Float16Form:
        return Float16Form(self.weight, self.bias, self.half, packed)

    def matmul(self, x: torch.Tensor, norm: RowNorm | None = None,
               gated: bool = False) -> torch.Tensor:
        x = _prepared(x, norm, gated)
        if self.half.applies(x):
            return self.half(x)
        return self._plain(x)

    def __deepcopy__(self, memo: dict[int, object]) -> Float16Form:
        weight, bias, packed = self._copied(memo)
        return Float16Form(weight, bias, copy.deepcopy(self.half, memo), packed)


class BlockForm:
    """Quantized blocks multiplied by the C kernel for every row count (`KernelLinear`): the
    file's own blocks of any of `BLOCK_TYPES`, or Q8_0 made at load. `round16`: see
    `KernelLinear` (weights="blocks"; False: with exact=True)."""

    def __init__(self, blocks: QuantBlocks, bias: torch.Tensor | None = None,
                 round16: bool = True, kernel: KernelLinear | None = None):
        self.blocks = blocks
        self._kernel = kernel or KernelLinear(blocks, bias, round16=round16)

    @property
    def kernel(self) -> KernelLinear:
        return self._kernel

    @property
    def shape(self) -> tuple[int, int]:
        return self.blocks.shape

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes

    @property
    def weight_format(self) -> str | None:
        return "quantized" if self._kernel.round16 else "quantized-exact"

    @property
    def serves_every_step(self) -> bool:
        return True

    def matmul(self, x: torch.Tensor, norm: RowNorm | None = None,
               gated: bool = False) -> torch.Tensor:
        if x.dtype == torch.float32 and x.device.type == "cpu":
            return self._kernel(x, norm=norm, gated=gated)
        x = _prepared(x, norm, gated)  # not the CPU float32 the kernel reads: its dense view
        return F.linear(x, self.dense().to(x), self._kernel.bias)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.blocks.dequantize_rows(ids)

    def dense(self) -> torch.Tensor:
        return self.blocks.dequantize()

    def __deepcopy__(self, memo: dict[int, object]) -> BlockForm:
        blocks = copy.deepcopy(self.blocks, memo)  # shared blocks (a tied head's) stay shared
        return BlockForm(blocks, kernel=self._kernel.over(blocks,
                                                          copy.deepcopy(self._kernel.bias, memo)))


class PartsForm:
    """A fused projection (q/k/v, gate/up) whose parts are blocks of different types, which
    no one kernel call multiplies (Gemma 3's Q5_0 q and k beside a Q8_0 v): each part's
    `BlockForm` gives its slice of the output, the slices are concatenated, the fused bias
    added. Nothing is requantized: the same values as one matmul over the dequantized parts,
    up to rounding. A norm asked for runs inside each part's kernel call. No single kernel
    serves it (`kernel` is None): the decode stack describes it as its parts' kernels (an
    NBQ_PARTS weight, each part into its columns)."""

    def __init__(self, parts: list[BlockForm], bias: torch.Tensor | None = None):
        if len({p.shape[1] for p in parts}) != 1:
            raise ValueError("fused parts must read the same input size")
        self.parts = parts
        self.bias = None if bias is None else bias.detach().float()

    @property
    def kernel(self) -> KernelLinear | None:
        return None

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def weight_format(self) -> str | None:
        return self.parts[0].weight_format

    @property
    def serves_every_step(self) -> bool:
        return True

    def matmul(self, x: torch.Tensor, norm: RowNorm | None = None,
               gated: bool = False) -> torch.Tensor:
        y = torch.cat([p.matmul(x, norm, gated) for p in self.parts], dim=-1)
        return y if self.bias is None else y + self.bias.to(y)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.dense())

    def dense(self) -> torch.Tensor:
        return torch.cat([p.dense() for p in self.parts])

    def __deepcopy__(self, memo: dict[int, object]) -> PartsForm:
        return PartsForm([copy.deepcopy(p, memo) for p in self.parts],
                         copy.deepcopy(self.bias, memo))
