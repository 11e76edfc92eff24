"""Attention over a paged KV cache through nbserve's C kernels (kernels/paged_attention.c).

A paged cache keeps every sequence's keys and values in fixed-size blocks of one shared pool,
(n_blocks, hkv, block_size, d) a layer, found through the sequence's block table (int32): the
cache need not be sized for the longest sequence in every slot, and sequences with a common
prefix can share its blocks. Gathering a sequence's blocks into a contiguous tensor for torch's
attention would copy the whole context every step; the kernels read the blocks in place.
`paged_lone_attention` is the lone decode step (rope, the cache write and the attention in one
call); `paged_decode_step` the same for a decode batch; `paged_decode_attention` is a decode
batch whose queries are roped and whose keys and values are written already.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from ..cpu.kernels.build import quant_kernels


def paged_attention_serves(*tensors: torch.Tensor) -> bool:
    """Whether the kernels can take these float tensors (heads or q, keys, values, the rope
    tables): CPU float32, contiguous. The block tables and lengths are checked by the calls."""
    return all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()
               for t in tensors)


CACHE_DTYPES = (torch.float32, torch.float16)  # the kernels' cache types (float32 maths)


def paged_cache_serves(keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether the kernels can take this cache: CPU, contiguous, float32 or float16."""
    return keys.dtype == values.dtype and keys.dtype in CACHE_DTYPES and all(
        t.device.type == "cpu" and t.is_contiguous() for t in (keys, values))


def _kernel(lib: ctypes.CDLL, name: str, keys: torch.Tensor) -> Any:
    """The entry point for the cache's element type (`name`, or `name` + "_f16")."""
    return getattr(lib, name + ("_f16" if keys.dtype == torch.float16 else ""))


def _check_cache(keys: torch.Tensor, values: torch.Tensor, hkv: int, block_size: int,
                 d: int) -> None:
    if not paged_cache_serves(keys, values):
        raise ValueError(f"paged attention: keys ({keys.dtype}) and values ({values.dtype}) "
                         "must be contiguous CPU tensors of float32 or float16, the same")
    if keys.dim() != 4 or tuple(keys.shape[1:]) != (hkv, block_size, d):
        raise ValueError(f"paged attention: keys {tuple(keys.shape)} are not "
                         f"(n_blocks, {hkv}, {block_size}, {d})")
    if values.shape != keys.shape:
        raise ValueError(f"paged attention: values {tuple(values.shape)} and keys "
                         f"{tuple(keys.shape)} differ")


def _check_index(name: str, t: torch.Tensor, dim: int) -> None:
    if t.dtype != torch.int32 or t.device.type != "cpu" or not t.is_contiguous() or t.dim() != dim:
        raise ValueError(f"paged attention: {name} must be a contiguous {dim}-D CPU int32 "
                         f"tensor (got {t.dtype}, {tuple(t.shape)}, {t.device})")


def _raise_for(failed: int, what: str) -> None:
    if failed == -1:
        raise MemoryError(f"{what}: out of memory for its scratch buffers")
    if failed:
        raise ValueError(f"{what}: invalid arguments (a negative block table entry or length, "
                         "or a length past its table row)")


def paged_lone_attention(heads: torch.Tensor, hq: int, hkv: int,
                         rope: tuple[torch.Tensor, torch.Tensor], keys: torch.Tensor,
                         values: torch.Tensor, block_size: int, table: torch.Tensor, pos: int,
                         *, check: bool = True,
                         kernels: ctypes.CDLL | None = None) -> torch.Tensor:
    """Rope the token's q/k heads, write its k and v into the paged cache at `pos` through
    `table` (the sequence's block table, int32 1-D), attend over positions 0..pos; heads
    (hq + 2 hkv, d) -> out (1, hq * d). `check`: that the table entries used name blocks of
    `keys` (a wrong one would write out of bounds); off, one tensor op less a step.
    `kernels`: another build of the library (tests run the AVX2 and plain C ones)."""
    d = heads.shape[-1]
    _check_cache(keys, values, hkv, block_size, d)
    _check_index("the block table", table, 1)
    if tuple(heads.shape) != (hq + 2 * hkv, d) or pos < 0 or table.shape[0] <= pos // block_size:
        raise ValueError(f"paged lone attention: heads {tuple(heads.shape)}, pos {pos} and a "
                         f"table of {table.shape[0]} blocks of {block_size} do not fit")
    if check:
        used = table[:pos // block_size + 1]
        if bool(((used < 0) | (used >= keys.shape[0])).any()):
            raise ValueError(f"paged lone attention: the block table names blocks outside "
                             f"0..{keys.shape[0] - 1}")
    cos, sin_signed = rope
    out = torch.empty(1, hq * d, dtype=torch.float32)
    lib = kernels if kernels is not None else quant_kernels()
    failed = _kernel(lib, "nbq_paged_lone_attention", keys)(
        heads.data_ptr(), hq, hkv, d, cos.data_ptr(), sin_signed.data_ptr(), keys.data_ptr(),
        values.data_ptr(), block_size, table.data_ptr(), pos, out.data_ptr(),
        torch.get_num_threads())
    _raise_for(failed, "paged lone attention")
    return out


def paged_decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                           block_size: int, tables: torch.Tensor, lengths: torch.Tensor, *,
                           check: bool = True,
                           kernels: ctypes.CDLL | None = None) -> torch.Tensor:
    """A decode batch's attention: row b's query q[b] (hq, d), roped, attends to its positions
    0..lengths[b]-1 through its block table tables[b]; q (B, hq, d), tables (B, S) int32,
    lengths (B,) int32 -> out (B, hq * d) (zeros for a row of length 0). The keys and values
    are written already. `check`: that the table entries used name blocks of `keys` (a wrong
    one would read out of bounds); off, a few tensor ops less a step."""
    if q.dim() != 3 or not paged_attention_serves(q):
        raise ValueError(f"paged decode attention: q {tuple(q.shape)}, strides {q.stride()}, "
                         f"{q.dtype} is not a contiguous float32 (batch, hq, d) CPU tensor")
    batch, hq, d = q.shape
    hkv = keys.shape[1] if keys.dim() == 4 else -1
    _check_cache(keys, values, hkv, block_size, d)
    _check_index("the block tables", tables, 2)
    _check_index("the lengths", lengths, 1)
    if tables.shape[0] != batch or lengths.shape[0] != batch or hkv <= 0 or hq % hkv:
        raise ValueError(f"paged decode attention: q {tuple(q.shape)}, tables "
                         f"{tuple(tables.shape)}, lengths {tuple(lengths.shape)} and {hkv} kv "
                         "heads do not fit")
    if check and batch:
        blocks = (lengths + block_size - 1) // block_size
        used = torch.arange(tables.shape[1], dtype=torch.int32) < blocks[:, None]
        if bool((used & ((tables < 0) | (tables >= keys.shape[0]))).any()):
            raise ValueError(f"paged decode attention: a block table names blocks outside "
                             f"0..{keys.shape[0] - 1}")
    out = torch.empty(batch, hq * d, dtype=torch.float32)
    lib = kernels if kernels is not None else quant_kernels()
    failed = _kernel(lib, "nbq_paged_decode_attention", keys)(
        q.data_ptr(), batch, hq, hkv, d, keys.data_ptr(), values.data_ptr(), block_size,
        tables.data_ptr(), tables.shape[1], lengths.data_ptr(), out.data_ptr(),
        torch.get_num_threads())
    _raise_for(failed, "paged decode attention")
    return out


def paged_decode_step(heads: torch.Tensor, hq: int, hkv: int,
                      rope: tuple[torch.Tensor, torch.Tensor], keys: torch.Tensor,
                      values: torch.Tensor, block_size: int, tables: torch.Tensor,
                      positions: torch.Tensor, *, kernels: ctypes.CDLL | None = None
                      ) -> torch.Tensor:
    """A decode batch's attention from its q/k/v heads, in one call: each row's q and k heads
    roped with its own rope rows, its k and v written into the paged cache at positions[b]
    through tables[b], then the rows attend over positions 0..positions[b] (`paged_lone_attention`
    for a batch). heads (B, hq + 2 hkv, d), rope: cos and sin_signed (B, d), tables (B, S)
    int32, positions (B,) int32 -> out (B, hq * d). The table entries are trusted (the engine
    made them); their signs and the positions are checked by the call."""
    if heads.dim() != 3 or heads.shape[1] != hq + 2 * hkv or not paged_attention_serves(
            heads, *rope):
        raise ValueError(f"paged decode step: heads {tuple(heads.shape)} are not contiguous "
                         f"float32 (batch, {hq + 2 * hkv}, d) on CPU, with rope tables alike")
    batch, _, d = heads.shape
    _check_cache(keys, values, hkv, block_size, d)
    _check_index("the block tables", tables, 2)
    _check_index("the positions", positions, 1)
    cos, sin_signed = rope
    if tables.shape[0] != batch or positions.shape[0] != batch or hq % hkv or \
            tuple(cos.shape) != (batch, d) or tuple(sin_signed.shape) != (batch, d):
        raise ValueError(f"paged decode step: heads {tuple(heads.shape)}, rope "
                         f"{tuple(cos.shape)}, tables {tuple(tables.shape)} and positions "
                         f"{tuple(positions.shape)} do not fit")
    out = torch.empty(batch, hq * d, dtype=torch.float32)
    lib = kernels if kernels is not None else quant_kernels()
    failed = _kernel(lib, "nbq_paged_decode_step", keys)(
        heads.data_ptr(), batch, hq, hkv, d, cos.data_ptr(), sin_signed.data_ptr(),
        keys.data_ptr(), values.data_ptr(), block_size, tables.data_ptr(), tables.shape[1],
        positions.data_ptr(), out.data_ptr(), torch.get_num_threads())
    _raise_for(failed, "paged decode step")
    return out
