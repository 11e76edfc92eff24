"""PagedKVCache: keys and values in fixed-size blocks, one pool per layer.

Layout per layer: (n_blocks + 1, kv_heads, block_size, head_dim). A sequence's block table
lists its blocks in position order: position p lives in block table[p // block_size] at
offset p % block_size. The extra block (`pad_block`) takes the writes of padding positions
and fills the unused entries of a table row; nothing reads it.

On CPU the storage is a private anonymous memory map: zero-filled, and committed by the OS
page by page as blocks are first written, so a cache sized for many tokens holds resident only
the blocks that were used; `free_pages` returns the pages of blocks that hold nothing any more
(the engine calls it when it goes idle). Elsewhere it is one tensor allocated up front, and
its memory stays committed.
"""

from __future__ import annotations

import mmap

import torch


class PagedKVCache:
    """`n_blocks` blocks of `block_size` positions for every layer, plus the pad block."""

    def __init__(self, n_layers: int, n_blocks: int, block_size: int, n_kv_heads: int,
                 head_dim: int, device: torch.device | str, dtype: torch.dtype,
                 rows: int | None = None):
        self.n_blocks, self.block_size, self.pad_block = n_blocks, block_size, n_blocks
        self.n_kv_heads, self.head_dim, self.dtype = n_kv_heads, head_dim, dtype
        self.device = torch.device(device)
        shape = (n_blocks + 1, n_kv_heads, block_size, head_dim)
        per = shape[0] * shape[1] * shape[2] * shape[3]
        self._map: mmap.mmap | None = None
        itemsize = torch.empty((), dtype=dtype).element_size()
        self._block_bytes = n_kv_heads * block_size * head_dim * itemsize  # one layer's K
        if self.device.type == "cpu":
            size = max(per * 2 * n_layers * itemsize, 1)
            # private: pages given back with MADV_DONTNEED are freed, and read back as zeros
            self._map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) \
                if hasattr(mmap, "MAP_PRIVATE") else mmap.mmap(-1, size)
            flat = torch.frombuffer(self._map, dtype=dtype, count=per * 2 * n_layers)
        else:
            flat = torch.zeros(per * 2 * n_layers, dtype=dtype, device=self.device)
        parts = flat.view(2 * n_layers, *shape)
        self.k = [parts[2 * i] for i in range(n_layers)]
        self.v = [parts[2 * i + 1] for i in range(n_layers)]
        # `rows`: a cache made by `make_cache(rows, context)`, where row r owns blocks
        # r * blocks_per_row ... (the one-row-per-sequence calling convention)
        self.rows = rows
        self.blocks_per_row = n_blocks // rows if rows else 0

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks sequences can use (the pad block not counted)."""
        return sum(t[:self.n_blocks].numel() * t.element_size() for t in self.k + self.v)

    @property
    def bytes_per_token(self) -> int:
        return self.nbytes // max(self.n_blocks * self.block_size, 1)

    @property
    def lazy(self) -> bool:
        """Whether memory is committed as blocks are first written (and can be given back by
        `free_pages`): on CPU. Elsewhere all of `nbytes` is committed from the start."""
        return self._map is not None

    @property
    def page_reach(self) -> int:
        """Blocks that one memory page of a layer's keys can span (at least 1): how far the
        caller widens a run of freed blocks over unused neighbours (`KVSpace.give_back`)."""
        return -(-mmap.PAGESIZE // max(self._block_bytes, 1))

    def free_pages(self, runs: list[tuple[int, int]]) -> int:
        """Return to the system the memory pages that lie wholly inside the blocks
        [start, end) of `runs`, in every layer's keys and values; those blocks must hold
        nothing a sequence still needs (they read back as zeros). Returns the bytes given
        back (0 off CPU, where the cache's memory stays committed)."""
        if self._map is None or not hasattr(mmap, "MADV_DONTNEED"):
            return 0
        page, bb = mmap.PAGESIZE, self._block_bytes
        part = (self.n_blocks + 1) * bb  # one layer's keys (or values), with the pad block
        given = 0
        for i in range(2 * len(self.k)):
            for start, end in runs:
                lo = -(-(i * part + start * bb) // page) * page
                hi = (i * part + min(end, self.n_blocks) * bb) // page * page
                if hi > lo:
                    self._map.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
                    given += hi - lo
        return given

    def row_tables(self, rows: torch.Tensor) -> torch.Tensor:
        """Block tables (B, blocks_per_row) of cache rows (B,), for a cache made per row."""
        if not self.rows:
            raise ValueError("this cache has no rows: pass block tables (B, blocks), not slots")
        per = self.blocks_per_row
        return rows[:, None].long() * per + torch.arange(per, device=rows.device)[None, :]

    def write(self, layer: int, blocks: torch.Tensor, offsets: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v (B, T, H, D) at (blocks[b, t], :, offsets[b, t])."""
        self.k[layer][blocks, :, offsets] = k.to(self.dtype)
        self.v[layer][blocks, :, offsets] = v.to(self.dtype)

    def gather(self, layer: int, tables: torch.Tensor, length: int,
               start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (B, H, length - start, D) of positions start..length-1 of each
        table row: a copy (for prefill and the paths without a paged-attention kernel).
        `start`: a sliding window's first position (only its blocks are read)."""
        first = start // self.block_size
        nb = -(-length // self.block_size) - first
        idx = tables[:, first:first + nb]
        b = idx.shape[0]
        lo, hi = start - first * self.block_size, length - first * self.block_size

        def one(t: torch.Tensor) -> torch.Tensor:
            blocks = t[idx]  # (B, nb, H, bs, D)
            return blocks.transpose(1, 2).reshape(b, self.n_kv_heads, nb * self.block_size,
                                                  self.head_dim)[:, :, lo:hi]

        return one(self.k[layer]), one(self.v[layer])

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` positions of block `src` into block `dst` (every layer)."""
        for k, v in zip(self.k, self.v):
            k[dst, :, :length] = k[src, :, :length]
            v[dst, :, :length] = v[src, :, :length]
