"""The float paths of a matmul on CPU: oneDNN-packed copies, a split by output rows, float16
copies (the forms of formats.py combine them; holders.py dispatches to the forms).

Why (the figures are in benchmarks/README.md, "Linear layers"): `F.linear` with float32 weights
runs single-threaded for one input row, far below the memory bandwidth. Viewing the weight as k
blocks of output rows and running one `bmm` over them lets torch give each thread its own
block; the view shares the weight's memory, and every output value is the same dot product as
before, in the same order. Loaders go one step further where memory allows: a oneDNN-packed
copy of each weight (`PackedCopy`) is as fast at one row and faster for batches; the split
serves models without one. A lone stream can also use float16 copies (`HalfCopy`,
weights="mixed16").
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

SPLIT_MAX_ROWS = 128  # past this, F.linear's GEMM threads well on its own


def split_ways(x: torch.Tensor, weight: torch.Tensor) -> int:
    """Into how many blocks `split_linear` cuts `weight` for input `x` (1: plain F.linear)."""
    k = torch.get_num_threads()
    out_features, in_features = weight.shape
    rows = x.numel() // in_features if in_features else 0
    if (k < 2 or rows == 0 or rows > SPLIT_MAX_ROWS or weight.device.type != "cpu"
            or weight.dtype != torch.float32 or out_features % k or not weight.is_contiguous()):
        return 1
    return k


def split_linear(x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x (..., in) and weight (out, in)."""
    k = split_ways(x, weight)
    if k == 1:
        if weight.dtype == torch.bfloat16 and weight.device.type == "cpu":  # oneDNN's GEMM
            return in_row_buckets(x, lambda rows: F.linear(rows, weight, bias),
                                  minimum=1)
        return F.linear(x, weight, bias)
    out_features, in_features = weight.shape
    rows = x.numel() // in_features
    blocks = weight.view(k, out_features // k, in_features).transpose(1, 2)  # (k, in, out/k)
    y = torch.bmm(x.reshape(1, rows, in_features).expand(k, rows, in_features), blocks)
    y = y.transpose(0, 1).reshape(*x.shape[:-1], out_features)  # (k, rows, out/k) -> (..., out)
    return y if bias is None else y + bias


# ------------------------------------------------------------------ oneDNN-packed copies
PACK_FOR_ROWS = 16  # the row count oneDNN is told to expect; measured best from 1 to 256 rows
PACK_MIN_ROWS = 4  # fewer input rows are padded with zero rows up to this many (see PackedCopy)
PACK_EXACT_ROWS = 16  # up to here every row count runs as it is; above, in buckets
PACK_BUCKETS_PER_OCTAVE = 8  # so a bucket adds less than an eighth of zero rows


def packed_rows(rows: int, minimum: int = PACK_MIN_ROWS) -> int:
    """The row count a `PackedCopy` multiplies for `rows` input rows: at least `minimum`;
    above PACK_EXACT_ROWS, `rows` rounded up to one of PACK_BUCKETS_PER_OCTAVE steps between
    powers of two (18, 20, ..., 32, 36, 40, ...). oneDNN keeps a kernel, and buffers that
    grow with the rows, for every shape it has run (two caches of 1,024 shapes each), for
    its float32 packed GEMM and its bfloat16 one (`F.linear` on CPU): a server that saw every
    prompt length would grow by gigabytes; buckets bound the shapes."""
    if rows < minimum:
        return minimum
    if rows <= PACK_EXACT_ROWS:
        return rows
    octave = rows.bit_length() - 1  # 2**octave <= rows < 2**(octave + 1)
    step = 1 << (octave - (PACK_BUCKETS_PER_OCTAVE.bit_length() - 1))
    return -(-rows // step) * step


def in_row_buckets(x: torch.Tensor, matmul: Callable[[torch.Tensor], torch.Tensor],
                   minimum: int = PACK_MIN_ROWS) -> torch.Tensor:
    """`matmul(x)` (rows in, rows out) run on x's rows padded with zero rows to
    `packed_rows` (at least `minimum`), the extra output rows dropped."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    target = packed_rows(rows, minimum) if rows else 0
    if target == rows:
        return matmul(x)
    padded = F.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, target - rows))
    return matmul(padded)[:rows].view(*x.shape[:-1], -1)


def packing_available(weight: torch.Tensor) -> bool:
    """Whether `PackedCopy` can serve this weight: a CPU float32 matrix, torch built with
    oneDNN (mkldnn) and its linear ops present."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


PACK_MEMORY_SHARE = 0.25  # loaders pack only while the copies fit in this share of the RAM


def packing_affordable(extra_bytes: int) -> bool:
    """Whether packed copies of `extra_bytes` fit in PACK_MEMORY_SHARE of this machine's
    memory (they double a float32 model's weights: a small model gains speed, a large one
    would run out of memory instead)."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # no sysconf: do not guess
        return False
    return extra_bytes <= PACK_MEMORY_SHARE * ram


class PackedCopy:
    """A copy of a float32 weight in oneDNN's blocked layout, multiplied by oneDNN's own
    kernel (the path `torch.compile`'s weight freezing takes on CPU, here without compiling).

    It beats both the split linear and `F.linear` at every batch size measured, and the
    transposed LM-head copy at one row (benchmarks/README.md, "Linear layers"). Outputs differ
    from F.linear's in the last bits (another summation order). Costs one more copy of the
    weight.

    oneDNN's kernel for 1 or 2 rows is slower than the one it picks for 3 to 6, so fewer than
    PACK_MIN_ROWS rows are padded with zero rows up to it (a lone float32 decode step got
    faster; benchmarks/README.md has the A/B). Larger inputs are padded to `packed_rows`
    buckets, which bound the memory oneDNN keeps per shape.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        dense = weight.detach().contiguous()
        self.weight = torch.ops.mkldnn._reorder_linear_weight(dense, PACK_FOR_ROWS)
        self.bias = None if bias is None else bias.detach().contiguous()
        self.nbytes = dense.numel() * dense.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return in_row_buckets(x, self._matmul)  # zero rows: see above

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    def __deepcopy__(self, memo: dict) -> PackedCopy:  # oneDNN tensors have no storage to copy
        return PackedCopy(self.weight.to_dense(), self.bias)


# ------------------------------------------------------------- float16 copies for single rows
FLOAT16_MAX_ROWS = 2  # up to here the float16 copy is used (measured, see HalfCopy)


class HalfCopy:
    """A float16 copy of a weight, used for inputs of up to FLOAT16_MAX_ROWS rows (a lone
    decode step); inputs, outputs and every other op stay float32.

    At one row a float16 `F.linear` reads half the bytes and is much faster than float32;
    at batch sizes it is slower, so batches keep the float32 weight (benchmarks/README.md).
    bfloat16 would be fast for batches too, but its 8-bit mantissa changed SmolLM2's greedy
    answers badly; float16's 11 bits kept them. Costs half the float32 weight's memory again.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight = weight.detach().to(torch.float16).contiguous()
        self.bias = None if bias is None else bias.detach().float()

    def applies(self, x: torch.Tensor) -> bool:
        return x.numel() <= FLOAT16_MAX_ROWS * x.shape[-1] and x.dtype == torch.float32

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x.to(torch.float16), self.weight).float()
        return y if self.bias is None else y + self.bias
