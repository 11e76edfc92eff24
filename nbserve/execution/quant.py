"""Quantized weights (weights="blocks"): matmuls over blocks of 4- or 8-bit codes, through
nbserve's C kernel (`nbserve/cpu/kernels/quant_matmul.c`), for steps of any row count.

A lone stream's decode step reads every weight once per token, so its speed is set by the bytes
it reads: SmolLM2-135M's matmuls read 540 MB in float32, 270 MB in float16 and 96 MB as the
GGUF's own Q4_1/Q8_0 blocks. The blocks are kept as the file stores them (no requantization:
the same weights llama.cpp multiplies): Q4_0/Q4_1/Q8_0 as structure-of-arrays `QuantBlocks`,
the K-quants, Q5_0, Q5_1, IQ4_NL and IQ4_XS as the file's own rows of blocks (`GGMLBlocks`,
multiplied in exact float32 arithmetic by `cpu/kernels/gguf_blocks.c`); weights of other types,
and float checkpoints, are quantized to Q8_0 at load. Inputs, outputs and the arithmetic are
float32: steps of a few rows add d * sum(x q) + m * sum(x) per block (GGUF blocks: products of
the dequantized weights), steps of more rows dequantize panels of weight rows
(d * q + m, as GGUF does) and multiply them as float32, so a product differs from one over the
dequantized weights only in rounding. One exception, `round16` (weights="blocks" without
exact=True): on the AVX2 path, and on the AVX-512 path where they measure faster, steps
of one or two rows multiply their inputs rounded to 16 bits per block of 32 with integer
products, which decode the weights in fewer instructions.
Q4_K's and Q6_K's products in decode steps (weights="blocks" without exact=True) take their
inputs rounded to 8 bits per 256 as llama.cpp's CPU kernels do (Q8_K), at any batch size, a
row the same bits in any batch of up to 8 rows and in any of more (gemm8); prompt chunks of
more than 8 rows take gemm8 over the input rounded per 32 where the build has it (on Gemma 3
270M, prompts rounded per 256 moved about half the greedy answers, per 32 a few:
benchmarks/README.md), shorter ones keep 16-bit or float32 inputs. NBSERVE_ROUND8=decode
keeps prompts at 16 bits, NBSERVE_ROUND8=0 decode steps too, NBSERVE_ROUND8=all rounds every
prompt chunk per 256 (`cpu.kernels.tuning.round8_wanted`);
benchmarks/activation_rounding.py counts the greedy answers each keeps identical to exact
arithmetic and to transformers' (benchmarks/README.md).
The blocks serve every step, so a model loaded from them needs no float32 copy of its weights.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Protocol, cast

import numpy as np
import torch

from ..cpu.kernels.abi import BlockType as GGMLType
from ..cpu.kernels.abi import KernelFlag, WeightKind

BLOCK = 32  # weights per block, along the input dimension (GGUF's Q4_0, Q4_1, Q8_0)
FLOAT_MAX_ROWS = 4  # the same for float32 weights; SmolLM2's matmuls in the engine's thread,
# kernel against oneDNN-packed (ms): 1 row 13.6 / 20.3, 3: 17.3 / 20.2, 4: 16.7 / 17.1, 8: 29 / 22
# the kernel's flags (nbserve_kernels.h) as plain ints: `|` on them stays an int operation
GATED, ROUND16 = int(KernelFlag.GATED), int(KernelFlag.ROUND16)
ROUND8, ROUND8_MANY = int(KernelFlag.ROUND8), int(KernelFlag.ROUND8_MANY)


@dataclass
class QuantBlocks:
    """A weight (N, K) as blocks of 32 along K, structure of arrays:
    kind "q4": w = scale * q + min, q in 0..15, `codes` uint8 (N, K/2), byte j of a block holding
    code j (low nibble) and code j + 16 (high nibble), GGUF's order; kind "q8": w = scale * q,
    `codes` int8 (N, K). `scales` and `mins` are float16 (N, K/32), as GGUF stores them (given
    in another dtype, they are rounded to float16 here); the kernel reads them as float32."""

    kind: str
    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None

    def __post_init__(self) -> None:
        self.scales = self.scales.to(torch.float16).contiguous()
        if self.mins is not None:
            self.mins = self.mins.to(torch.float16).contiguous()

    @property
    def shape(self) -> tuple[int, int]:
        return self.scales.shape[0], self.scales.shape[1] * BLOCK

    @property
    def nbytes(self) -> int:
        tensors = [self.codes, self.scales] + ([] if self.mins is None else [self.mins])
        return sum(t.numel() * t.element_size() for t in tensors)

    @classmethod
    def from_gguf(cls, raw: np.ndarray, type_name: str) -> QuantBlocks | None:
        """The blocks of a GGUF tensor stored in one of `BLOCK_TYPES` (raw: its bytes, one row
        of blocks per output row, as `gguf`'s reader gives them); None for other types."""
        row = BLOCK_TYPES.get(type_name)
        if row is None:
            return None
        rows = raw.shape[0]
        return row.read(np.ascontiguousarray(raw).reshape(rows, -1, row.type_size))

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> QuantBlocks | None:
        """Q8_0 blocks of a float weight (scale = max |w| / 127 per block, codes rounded to
        nearest with it, the scale then stored as float16: as llama.cpp quantizes Q8_0); None
        when its input dimension is not a multiple of 32."""
        rows, k = weight.shape
        if k % BLOCK:
            return None
        w = weight.detach().float().cpu().reshape(rows, k // BLOCK, BLOCK)
        scales = w.abs().amax(-1) / 127.0
        inverse = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
        codes = torch.round(w * inverse[..., None]).clamp_(-127, 127).to(torch.int8)
        return cls("q8", codes.reshape(rows, k).contiguous(), scales, None)

    def take_rows(self, index: torch.Tensor) -> QuantBlocks:
        """These blocks with their output rows reordered (`w[index]`)."""
        mins = None if self.mins is None else self.mins[index].contiguous()
        return QuantBlocks(self.kind, self.codes[index].contiguous(),
                           self.scales[index].contiguous(), mins)

    def empty_rows(self, rows: int) -> QuantBlocks:
        """Blocks of the same kind and input size with `rows` rows, not filled yet (see
        `put_rows`)."""
        mins = None if self.mins is None else self.mins.new_empty(rows, self.mins.shape[1])
        return QuantBlocks(self.kind, self.codes.new_empty(rows, self.codes.shape[1]),
                           self.scales.new_empty(rows, self.scales.shape[1]), mins)

    def put_rows(self, start: int, part: QuantBlocks) -> None:
        """Copy `part`'s rows into these blocks' rows from `start` (a loader filling them
        chunk by chunk)."""
        stop = start + part.shape[0]
        self.codes[start:stop] = part.codes
        self.scales[start:stop] = part.scales
        if self.mins is not None and part.mins is not None:
            self.mins[start:stop] = part.mins

    def row_range(self, start: int, stop: int) -> QuantBlocks:
        """Output rows start..stop of these blocks, as views (no copy)."""
        mins = None if self.mins is None else self.mins[start:stop]
        return QuantBlocks(self.kind, self.codes[start:stop], self.scales[start:stop], mins)

    @classmethod
    def cat(cls, parts: list[QuantBlocks]) -> QuantBlocks | None:
        """The blocks of the weights stacked by output rows (a fused projection); None when the
        parts differ in kind or input size. Parts that are consecutive row ranges of one
        tensor's blocks (a loader read them so: `row_range`) are joined without a copy."""
        first = parts[0]
        if len(parts) == 1:
            return first  # nothing to stack: the same blocks, not a copy
        if any(isinstance(p, GGMLBlocks) for p in parts):
            return GGMLBlocks.stack(parts)
        if any(p.kind != first.kind or p.shape[1] != first.shape[1] for p in parts):
            return None
        # one kind: all parts have mins (q4) or none has (q8)
        mins = None if first.mins is None else \
            _stacked([cast(torch.Tensor, p.mins) for p in parts])
        return cls(first.kind, _stacked([p.codes for p in parts]),
                   _stacked([p.scales for p in parts]), mins)

    def dequantize_rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` (any shape) of the float32 weight, (*index.shape, K): an embedding
        lookup from the blocks, the same values as `dequantize()[index]`."""
        flat = index.reshape(-1)
        return self.take_rows(flat).dequantize().view(*index.shape, self.shape[1])

    def dequantize(self) -> torch.Tensor:
        """The float32 weight (N, K) these blocks stand for."""
        rows, k = self.shape
        scales = self.scales.float()[..., None]  # exact: float16 -> float32
        if self.kind == "q8":
            q = self.codes.float().view(rows, -1, BLOCK)
            return (q * scales).view(rows, k)
        assert self.mins is not None  # q4 blocks carry mins
        packed = self.codes.view(rows, -1, BLOCK // 2)
        q = torch.cat([packed & 15, packed >> 4], dim=-1).float()
        return (q * scales + self.mins.float()[..., None]).view(rows, k)


@dataclass
class GGMLBlocks(QuantBlocks):
    """A weight (N, K) as the GGUF file's own blocks of a ggml type that nbserve's C kernels
    multiply as they lie (`cpu/kernels/gguf_blocks.c`: the K-quants, Q5_0, Q5_1, IQ4_NL,
    IQ4_XS; exact float32 arithmetic on gguf's dequantized values): kind "ggml:<type>", `codes`
    uint8 (N, bytes a row), each row its blocks in the file's order. Each block carries its own
    scales: `scales` is empty and `mins` None."""

    block_type: int = 0  # ggml's type number (abi.BlockType)
    in_features: int = 0

    @classmethod
    def of_file(cls, blocks: np.ndarray, block_type: GGMLType) -> GGMLBlocks:
        """From a tensor's bytes as (rows, blocks, bytes a block) uint8: a copy of a read-only
        array (a file's memory map), else those bytes (a buffer a loader read them into)."""
        rows, per_row = blocks.shape[0], blocks.shape[1]
        flat = np.ascontiguousarray(blocks).reshape(rows, -1)
        codes = torch.from_numpy(flat if flat.flags.writeable else flat.copy())
        return cls(f"ggml:{block_type.name}", codes, torch.empty(0), None, int(block_type),
                   per_row * _ggml_layout(block_type)[0])

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.in_features

    @property
    def nbytes(self) -> int:
        return self.codes.numel()

    def take_rows(self, index: torch.Tensor) -> GGMLBlocks:
        return GGMLBlocks(self.kind, self.codes[index].contiguous(), self.scales, None,
                          self.block_type, self.in_features)

    def empty_rows(self, rows: int) -> GGMLBlocks:
        return GGMLBlocks(self.kind, self.codes.new_empty(rows, self.codes.shape[1]),
                          self.scales, None, self.block_type, self.in_features)

    def put_rows(self, start: int, part: QuantBlocks) -> None:
        self.codes[start:start + part.shape[0]] = part.codes

    def row_range(self, start: int, stop: int) -> GGMLBlocks:
        return GGMLBlocks(self.kind, self.codes[start:stop], self.scales, None,
                          self.block_type, self.in_features)

    @classmethod
    def stack(cls, parts: list[QuantBlocks]) -> GGMLBlocks | None:
        """Blocks of one ggml type and input size stacked by output rows; None otherwise."""
        first = parts[0]
        if not all(isinstance(p, GGMLBlocks) and p.kind == first.kind
                   and p.shape[1] == first.shape[1] for p in parts):
            return None
        assert isinstance(first, GGMLBlocks)
        return GGMLBlocks(first.kind, _stacked([p.codes for p in parts]), first.scales, None,
                          first.block_type, first.in_features)

    def dequantize_rows(self, index: torch.Tensor) -> torch.Tensor:
        from ..cpu.kernels.blocks import blocks_dequantize

        rows, k = self.shape
        return blocks_dequantize(self.block_type, self.codes.view(-1), rows, k, rows=index)

    def dequantize(self) -> torch.Tensor:
        from ..cpu.kernels.blocks import blocks_dequantize

        rows, k = self.shape
        return blocks_dequantize(self.block_type, self.codes.view(-1), rows, k)


def _stacked(tensors: list[torch.Tensor]) -> torch.Tensor:
    """`torch.cat(tensors)` (by rows); a view, not a copy, where they are consecutive row
    ranges of one contiguous tensor."""
    first, end = tensors[0], tensors[0].data_ptr()
    for t in tensors:
        if not t.is_contiguous() or t.data_ptr() != end or t.shape[1:] != first.shape[1:] \
                or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
            return torch.cat(tensors)
        end += t.numel() * t.element_size()
    rows = sum(t.shape[0] for t in tensors)
    return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())


def _half_field(blocks: np.ndarray, offset: int) -> torch.Tensor:
    """A float16 field of every block (bytes offset..offset+1), (rows, blocks)."""
    field = np.ascontiguousarray(blocks[:, :, offset:offset + 2]).view(np.float16)[..., 0]
    return torch.from_numpy(np.ascontiguousarray(field))


def _read_q8_0(blocks: np.ndarray) -> QuantBlocks:
    """Q8_0 (34 bytes: float16 d, 32 int8 codes; w = d q) as kind "q8"."""
    rows = blocks.shape[0]
    codes = blocks[:, :, 2:].reshape(rows, -1).view(np.int8)
    return QuantBlocks("q8", torch.from_numpy(np.ascontiguousarray(codes)),
                       _half_field(blocks, 0), None)


def _read_q4(blocks: np.ndarray, with_min: bool) -> QuantBlocks:
    """Q4_1 (20 bytes: float16 d, float16 m, 16 bytes of nibbles; w = d q + m) or Q4_0 (18
    bytes: d and the nibbles; w = d (q - 8) = d q + (-8 d), exact in float16 too, a power of
    two) as kind "q4"."""
    rows, scales = blocks.shape[0], _half_field(blocks, 0)
    mins, start = (_half_field(blocks, 2), 4) if with_min else (scales * -8.0, 2)
    codes = np.ascontiguousarray(blocks[:, :, start:]).reshape(rows, -1)
    return QuantBlocks("q4", torch.from_numpy(codes), scales, mins)


def _ggml_layout(block_type: GGMLType) -> tuple[int, int]:
    """(weights, bytes) of a block of the type, as ggml defines it (the kernels' table is held
    to it by tests/test_block_kernels.py)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType(int(block_type))]


@dataclass(frozen=True)
class BlockType:
    """One GGUF block type served from the file's own blocks: a row of the table below, after
    ggml's type traits (ggml.c's `type_traits[]`). It says what the file holds (ggml's type
    number, weights and bytes per block) and how those bytes become the blocks a kernel
    multiplies (`read`, whose result's `kind` picks the kernel row in `KINDS`); nothing else
    in nbserve switches on the type."""

    name: str  # GGUF's name of the type, as gguf's reader gives it
    ggml_type: int  # ggml's type number (enum ggml_type, gguf.GGMLQuantizationType)
    block_size: int  # weights per block, along the input dimension
    type_size: int  # bytes per block in the file
    read: Callable[[np.ndarray], QuantBlocks]  # (rows, blocks, type_size) uint8 -> blocks


BLOCK_TYPES: dict[str, BlockType] = {row.name: row for row in (
    BlockType("Q4_0", 2, BLOCK, 18, lambda blocks: _read_q4(blocks, with_min=False)),
    BlockType("Q4_1", 3, BLOCK, 20, lambda blocks: _read_q4(blocks, with_min=True)),
    BlockType("Q8_0", 8, BLOCK, 34, _read_q8_0),
    *(BlockType(t.name, int(t), *_ggml_layout(t), partial(GGMLBlocks.of_file, block_type=t))
      for t in GGMLType if t.name not in ("Q4_0", "Q4_1", "Q8_0")),
)}


class NormWeights(Protocol):
    """What the kernel reads of an RMSNorm it runs inside a matmul."""

    @property
    def weight(self) -> torch.Tensor: ...

    @property
    def eps(self) -> float: ...


Pointers = tuple[int, int | None, int | None]  # a weight's codes (or float32 rows), scales, mins


def _q4_matmul(lib: ctypes.CDLL, w: Pointers, x: int, rows: int, k: int, n: int, y: int,
               threads: int, norm: int | None, eps: float, flags: int) -> int:
    return lib.nbq_q4_matmul(x, rows, k, w[0], w[1], w[2], n, y, threads, norm, eps, flags)


def _q8_matmul(lib: ctypes.CDLL, w: Pointers, x: int, rows: int, k: int, n: int, y: int,
               threads: int, norm: int | None, eps: float, flags: int) -> int:
    return lib.nbq_q8_matmul(x, rows, k, w[0], w[1], n, y, threads, norm, eps, flags)


def _ggml_matmul(block_type: int) -> KindMatmul:
    """The C matmul over GGUF blocks of `block_type` (w: codes only)."""
    def matmul(lib: ctypes.CDLL, w: Pointers, x: int, rows: int, k: int, n: int, y: int,
               threads: int, norm: int | None, eps: float, flags: int) -> int:
        return lib.nbq_blocks_matmul(x, rows, k, block_type, w[0], n, y, threads, norm, eps,
                                     flags)
    return matmul


def _f32_matmul(lib: ctypes.CDLL, w: Pointers, x: int, rows: int, k: int, n: int, y: int,
                threads: int, norm: int | None, eps: float, flags: int) -> int:
    return lib.nbq_f32_matmul(x, rows, k, w[0], n, y, threads, norm, eps, flags)


class KindMatmul(Protocol):
    """One call of a storage kind's C matmul: y (rows, n) = prepare(x) (rows, k) @ w.T, all
    arguments addresses and sizes (nbserve_kernels.h); 0, or -1 when out of memory."""

    def __call__(self, lib: ctypes.CDLL, w: Pointers, x: int, rows: int, k: int, n: int, y: int,
                 threads: int, norm: int | None, eps: float, flags: int) -> int: ...


@dataclass(frozen=True)
class KernelKind:
    """How nbserve's C kernels take one storage of weights (ggml-cpu's `type_traits_cpu[]`): its
    `nbq_kind` (the decode stack's `nbq_weight.kind`), its matmul entry point and the most input
    rows it takes (None: any). `KernelLinear` calls the row its weight names and never switches
    on kinds; a storage kind is one row here plus its kernels."""

    name: str
    weight_kind: WeightKind
    matmul: KindMatmul
    max_rows: int | None
    block_type: int = 0  # kind "ggml:<type>": the ggml type (`nbq_weight.block_type`)


KINDS: dict[str, KernelKind] = {row.name: row for row in (
    KernelKind("q4", WeightKind.Q4, _q4_matmul, None),
    KernelKind("q8", WeightKind.Q8, _q8_matmul, None),
    KernelKind("f32", WeightKind.F32, _f32_matmul, FLOAT_MAX_ROWS),
    *(KernelKind(f"ggml:{row.name}", WeightKind.BLOCKS, _ggml_matmul(row.ggml_type), None,
                 row.ggml_type) for row in BLOCK_TYPES.values()
      if row.ggml_type not in (2, 3, 8)),  # Q4_0, Q4_1, Q8_0: kinds q4 and q8 above
)}


class KernelLinear:
    """A matmul through nbserve's C kernel: over a weight's quantized blocks (any number of
    rows: `max_rows` None), or over a float32 weight as it is, shared, not copied (up to
    FLOAT_MAX_ROWS rows; larger inputs take the form's other paths). See `applies`."""

    max_rows: int | None  # the most input rows it takes; None: any

    def __init__(self, weight: QuantBlocks | torch.Tensor, bias: torch.Tensor | None = None,
                 kernels: ctypes.CDLL | None = None, round16: bool = False):
        """`round16`: blocks' products of a few rows may take the input rounded to 16 bits
        per block of 32 (scale max |x| / 32767), within max |x| / 65534 of each input: they
        do where the kernel build has integer row kernels for it and they are the faster
        path on this machine (always on AVX2, measured once on AVX-512: see
        `cpu.kernels.tuning`); exact float32 arithmetic elsewhere and for float32 weights.
        Q4_K's and Q6_K's in decode steps and long prompt chunks to 8 bits instead, where the
        build has those kernels (`tuning.round8_wanted`; see `flags`)."""
        from ..cpu.kernels.blocks import blocks_rounded8
        from ..cpu.kernels.build import quant_kernels
        from ..cpu.kernels.tuning import round8_wanted, round16_pays

        self.weight = weight
        self.round16 = round16 and isinstance(weight, QuantBlocks)  # allowed (weights="blocks")
        self.bias = None if bias is None else bias.detach().float()
        self.out_features, self.in_features = weight.shape
        self._lib = kernels or quant_kernels()  # a build for another CPU path, in tests
        self._rounds = self.round16 and round16_pays(self._lib, torch.get_num_threads())
        self._pointers: Pointers | None = None  # a float32 weight's is read per call
        if isinstance(weight, QuantBlocks):
            self._pointers = (weight.codes.data_ptr(), weight.scales.data_ptr(),
                              None if weight.mins is None else weight.mins.data_ptr())
        elif not float_kernel_serves(weight):
            raise ValueError("the float32 kernel needs a contiguous CPU float32 weight "
                             f"with rows of whole blocks of {BLOCK}")
        self.kind = weight.kind if isinstance(weight, QuantBlocks) else "f32"
        row = KINDS[self.kind]
        self.weight_kind, self._matmul, self.max_rows = row.weight_kind, row.matmul, row.max_rows
        self.block_type = row.block_type
        round8 = round8_wanted() if self.round16 else "none"
        self._rounds8 = (round8 != "none" and self.weight_kind == WeightKind.BLOCKS
                         and blocks_rounded8(self.block_type, self._lib))
        # what a prompt chunk keeps of ROUND8: all of it, gemm8's share or nothing
        self._prompt8 = ((ROUND8 if round8 == "all" else ROUND8_MANY if round8 == "many" else 0)
                         if self._rounds8 else 0)

    @property
    def pointers(self) -> Pointers:
        """The addresses the kernel reads: codes, scales, mins (float32: the model's own rows,
        read now, as they may have moved)."""
        if self._pointers is not None:
            return self._pointers
        return cast(torch.Tensor, self.weight).data_ptr(), None, None

    @property
    def flags(self) -> int:
        """The kernel's flags for a decode step's product (ROUND16, ROUND8, both or none; GATED
        per call). For an input of several positions a sequence (a prompt chunk, (batch,
        positions, k)) ROUND8 becomes ROUND8_MANY by default: gemm8's 8 bits per 32 past 8 rows,
        16-bit or float32 inputs for fewer, never the row kernels' 8 bits per 256, which loses
        far more greedy answers (benchmarks/activation_rounding.py); NBSERVE_ROUND8=decode
        drops it, NBSERVE_ROUND8=all keeps it."""
        return (ROUND16 if self._rounds else 0) | (ROUND8 if self._rounds8 else 0)

    @property
    def nbytes(self) -> int:
        """Bytes this adds to the model: its blocks; nothing for a float32 weight (shared)."""
        return self.weight.nbytes if isinstance(self.weight, QuantBlocks) else 0

    @property
    def serves_every_step(self) -> bool:
        """Whether this kernel multiplies inputs of any row count (quantized blocks do)."""
        return self.max_rows is None

    def serves_rows(self, rows: int) -> bool:
        """Whether it takes an input of `rows` rows."""
        return self.max_rows is None or rows <= self.max_rows

    def applies(self, x: torch.Tensor) -> bool:
        return ((self.max_rows is None or x.numel() <= self.max_rows * x.shape[-1])
                and x.dtype == torch.float32 and x.device.type == "cpu")

    def __call__(self, x: torch.Tensor, norm: NormWeights | None = None,
                 gated: bool = False) -> torch.Tensor:
        """x (..., K) @ w.T (+ bias). With `norm` (an RMSNorm: `.weight`, `.eps`), of norm(x);
        `gated`: of silu(a) * b for x (..., 2K) = [a | b]. Both run inside the kernel call."""
        k, n = self.in_features, self.out_features
        width = 2 * k if gated else k
        rows = x.numel() // width
        flat = x.reshape(rows, width).contiguous()
        y = torch.empty(rows, n, dtype=torch.float32)
        norm_at, eps = (None, 0.0) if norm is None else (norm.weight.data_ptr(), norm.eps)
        flags = self.flags | (GATED if gated else 0)
        if x.dim() >= 3 and x.shape[-2] > 1:  # a prompt chunk: see `flags`
            flags = flags & ~ROUND8 | self._prompt8
        failed = self._matmul(self._lib, self.pointers, flat.data_ptr(), rows, k, n,
                              y.data_ptr(), torch.get_num_threads(), norm_at, eps, flags)
        if failed:
            raise MemoryError("kernel matmul: out of memory for its input buffer")
        y = y.view(*x.shape[:-1], n)
        return y if self.bias is None else y + self.bias

    def over(self, weight: QuantBlocks | torch.Tensor, bias: torch.Tensor | None
             ) -> KernelLinear:
        """The same kernel (build, rounding) over other weights: a copy's."""
        return KernelLinear(weight, bias, self._lib, self.round16)

    def __deepcopy__(self, memo: dict[int, object]) -> KernelLinear | None:
        """A copy over copied weights (their pointers follow); None for a float32 weight copied
        where the kernel cannot read it (a replica on another device)."""
        import copy

        weight = copy.deepcopy(self.weight, memo)
        if isinstance(weight, torch.Tensor) and not float_kernel_serves(weight):
            return None
        return self.over(weight, copy.deepcopy(self.bias, memo))


def float_kernel_serves(weight: torch.Tensor) -> bool:
    """Whether the C kernel can multiply this float32 weight as it is."""
    return (weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.dim() == 2
            and weight.is_contiguous() and weight.shape[1] % BLOCK == 0)
