"""The Python face of gguf_blocks.c: products and dequantization over GGUF's own weight blocks.

A weight is `n` rows of `k` inputs, each row k / elems blocks of its `BlockType` exactly as the
GGUF file stores them, passed as a contiguous CPU uint8 tensor (e.g. `torch.frombuffer` over
the mapped file): nothing is copied or repacked here. The arithmetic is the exact mode of the
kernels (float32 products of the weights that `gguf.quants.dequantize` gives), or with
`round16` the integer row kernels over the input rounded to 16 bits per block of the type
(32 inputs, or 256 for the K-quants and IQ4_XS), or with `round8` Q4_K's and Q6_K's over the input
rounded to 8 bits per 256 (llama.cpp's Q8_K).
"""

from __future__ import annotations

import ctypes

import torch

from .abi import BlockType, KernelFlag
from .build import quant_kernels

__all__ = ["BlockType", "block_layout", "blocks_dequantize", "blocks_matmul", "blocks_rounded",
           "blocks_rounded8", "blocks_rounded8_many", "blocks_rounded_many", "row_bytes"]


def _lib(lib: ctypes.CDLL | None) -> ctypes.CDLL:
    return quant_kernels() if lib is None else lib


def block_layout(block_type: int, lib: ctypes.CDLL | None = None) -> tuple[int, int]:
    """(weights, bytes) of one block of `block_type`; ValueError for a type the kernels do not
    serve, naming those they do."""
    kernels = _lib(lib)
    elems, size = kernels.nbq_block_elems(int(block_type)), kernels.nbq_block_bytes(int(block_type))
    if not elems:
        served = ", ".join(t.name for t in BlockType if kernels.nbq_blocks_supported(int(t)))
        raise ValueError(f"GGUF type {block_type!r} is not served from its blocks by nbserve's "
                         f"kernels (served: {served})")
    return elems, size


def blocks_rounded(block_type: int, lib: ctypes.CDLL | None = None) -> bool:
    """Whether `round16` products of `block_type` take integer row kernels in this build (AVX2
    and AVX-512 builds; the plain C one keeps float32 inputs)."""
    return bool(_lib(lib).nbq_blocks_rounded(int(block_type)))


def blocks_rounded8(block_type: int, lib: ctypes.CDLL | None = None) -> bool:
    """Whether `round8` products of `block_type` take 8-bit row kernels in this build (Q4_K and
    Q6_K on the AVX2 and AVX-512 builds; elsewhere `round8` changes nothing)."""
    return bool(_lib(lib).nbq_blocks_rounded8(int(block_type)))


def blocks_rounded8_many(block_type: int, lib: ctypes.CDLL | None = None) -> bool:
    """Whether `round8` products of `block_type` past 8 rows (batches, prompt chunks) take gemm8,
    16 weight rows built once for a chunk of input rows (Q4_K and Q6_K where the CPU has
    AVX-512 VNNI); elsewhere they take the 8-bit row kernels."""
    return bool(_lib(lib).nbq_blocks_rounded8_many(int(block_type)))


def blocks_rounded_many(block_type: int, lib: ctypes.CDLL | None = None) -> bool:
    """Whether `round16` products of `block_type` round inputs of any row count, prompt chunks
    and batches through built blocks, faster than the float32 panels: the 256-weight types on
    the AVX-512 build (gemm16), the 32-weight types on the AVX-512 VNNI and AVX2 builds
    (gemm32); elsewhere inputs past 8 rows take the exact panels."""
    return bool(_lib(lib).nbq_blocks_rounded_many(int(block_type)))


def row_bytes(block_type: int, k: int, lib: ctypes.CDLL | None = None) -> int:
    """Bytes of one weight row of k inputs; ValueError when k is not whole blocks."""
    elems, size = block_layout(block_type, lib)
    if k <= 0 or k % elems:
        raise ValueError(f"a row of {BlockType(block_type).name} blocks holds a multiple of "
                         f"{elems} weights, got {k}")
    return k // elems * size


def _check_blocks(blocks: torch.Tensor, block_type: int, n: int, k: int,
                  lib: ctypes.CDLL | None) -> None:
    want = n * row_bytes(block_type, k, lib)
    if blocks.dtype != torch.uint8 or blocks.device.type != "cpu" \
            or not blocks.is_contiguous() or blocks.numel() != want:
        raise ValueError(f"blocks must be a contiguous CPU uint8 tensor of {want} bytes ({n} rows "
                         f"of {k} {BlockType(block_type).name} weights), got {blocks.dtype} "
                         f"{tuple(blocks.shape)} on {blocks.device}")


def blocks_matmul(x: torch.Tensor, block_type: int, blocks: torch.Tensor, n: int, k: int, *,
                  norm: torch.Tensor | None = None, eps: float = 0.0, gated: bool = False,
                  round16: bool = False, round8: bool = False, round8_many: bool = False,
                  threads: int | None = None, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """x (..., k) @ w.T -> (..., n) for the weight w in `blocks`; with `norm` (RMSNorm weights,
    k floats) of RMSNorm(x, eps); `gated`: of silu(a) * b for x (..., 2k) = [a | b].
    `round16`: inputs of a few rows rounded to 16 bits per block of the type for the integer row
    kernels, where the build has them for the type (`blocks_rounded`). `round8`: the same rounded
    to 8 bits per 256 where the build has 8-bit kernels for the type (`blocks_rounded8`), which
    then win over `round16`; elsewhere `round16` alone decides. `round8_many` (without `round8`):
    rounded to 8 bits per 32 where gemm8 takes the rows (past 8 rows, `blocks_rounded8_many`),
    elsewhere nothing: what prompt chunks ask for."""
    kernels = _lib(lib)
    _check_blocks(blocks, block_type, n, k, kernels)
    width = 2 * k if gated else k
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[-1] != width:
        raise ValueError(f"x must be float32 on the CPU with a last dimension of {width}, got "
                         f"{x.dtype} {tuple(x.shape)} on {x.device}")
    if norm is not None and (norm.dtype != torch.float32 or norm.numel() != k):
        raise ValueError(f"norm must be {k} float32 weights, got {norm.dtype} {norm.numel()}")
    rows = x.numel() // width
    flat = x.reshape(rows, width).contiguous()
    norm_c = None if norm is None else norm.contiguous()
    y = torch.empty(rows, n, dtype=torch.float32)
    failed = kernels.nbq_blocks_matmul(
        flat.data_ptr(), rows, k, int(block_type), blocks.data_ptr(), n, y.data_ptr(),
        threads or torch.get_num_threads(), None if norm_c is None else norm_c.data_ptr(), eps,
        (int(KernelFlag.GATED) if gated else 0) | (int(KernelFlag.ROUND16) if round16 else 0)
        | (int(KernelFlag.ROUND8) if round8 else 0)
        | (int(KernelFlag.ROUND8_MANY) if round8_many else 0))
    if failed == -1:
        raise MemoryError("block matmul: out of memory for its buffers")
    if failed:
        raise ValueError(f"block matmul refused {BlockType(block_type).name} with k={k}")
    return y.view(*x.shape[:-1], n)


def blocks_dequantize(block_type: int, blocks: torch.Tensor, n: int, k: int,
                      rows: torch.Tensor | None = None, threads: int | None = None,
                      lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """The weight's rows as float32 (exactly `gguf.quants.dequantize`): all n (n, k), or the
    rows at `rows` (integer indices, any shape) as rows.shape + (k,): an embedding lookup."""
    kernels = _lib(lib)
    _check_blocks(blocks, block_type, n, k, kernels)
    index = None if rows is None else rows.reshape(-1).to(torch.int32).contiguous()
    count = n if index is None else index.numel()
    if index is not None and count and (int(index.min()) < 0 or int(index.max()) >= n):
        raise IndexError(f"row index out of range 0..{n - 1}")
    out = torch.empty(count, k, dtype=torch.float32)
    failed = kernels.nbq_blocks_dequantize(
        int(block_type), blocks.data_ptr(), n, k, None if index is None else index.data_ptr(),
        count, out.data_ptr(), threads or torch.get_num_threads())
    if failed:
        raise ValueError(f"block dequantization refused {BlockType(block_type).name} with k={k}")
    return out if rows is None else out.view(*rows.shape, k)
