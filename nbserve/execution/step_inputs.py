"""What one step hands every layer: where each token's keys and values go in the paged cache,
the block tables (as indices and as the C kernels' int32 arrays), the masks per sliding window;
and a lone decode step's block and offset."""

from __future__ import annotations

import torch

from .kv_cache import PagedKVCache

Rope = tuple[torch.Tensor, torch.Tensor] | None  # (cos, sin_signed) of a layer; None: no RoPE


def padded_tables(tables: torch.Tensor, kv_len: int, cache: PagedKVCache) -> torch.Tensor:
    """Block tables (B, S) wide enough for reads of `kv_len` positions: positions past every
    row's blocks read the pad block."""
    width = -(-kv_len // cache.block_size)
    if tables.shape[1] >= width:
        return tables
    pad = tables.new_full((tables.shape[0], width - tables.shape[1]), cache.pad_block)
    return torch.cat((tables, pad), dim=1)


class StepInputs:
    """Per-forward values shared by every layer: where each token's keys and values go
    (block, offset), the block tables, the masks (causal, and per sliding window), the cache
    read length."""

    __slots__ = ("tables", "positions", "kv_len", "mask", "blocks", "offsets", "kernel",
                 "tables_i32", "positions_i32", "identity_rope", "_bias", "_windowed")

    def __init__(self, positions: torch.Tensor, tables: torch.Tensor, max_pos: int,
                 cache: PagedKVCache, kernel: bool, padded: bool = False,
                 identity_rope: tuple[torch.Tensor, torch.Tensor] | None = None):
        """`padded`: the read length `max_pos` + 1 may pass every row's position (a length
        rounded up), so even a lone row needs its mask. `identity_rope`: rope rows (B, D)
        that leave heads as they are, for the kernels at layers without RoPE."""
        self.positions = positions
        self.kv_len = max_pos + 1
        bs = cache.block_size
        tables = padded_tables(tables, self.kv_len, cache)
        self.tables = tables
        self.blocks = tables.gather(1, torch.div(positions, bs, rounding_mode="floor"))
        self.offsets = positions % bs
        b, t = positions.shape
        self.kernel = kernel and t == 1
        if self.kernel:
            self.tables_i32 = tables.to(torch.int32).contiguous()
            self.positions_i32 = positions[:, 0].to(torch.int32).contiguous()
        self.identity_rope = identity_rope
        if b == 1 and t == 1 and not padded:
            self.mask = None  # one query at the last position: every cached key is visible
        else:  # key j is visible to the query at position p iff j <= p
            keys = torch.arange(self.kv_len, device=positions.device)
            self.mask = (keys[None, None, None, :] <= positions[:, None, :, None])  # (B,1,T,L)
        self._bias: dict[int | None, torch.Tensor | None] = {}
        self._windowed: dict[int, torch.Tensor] = {}

    def mask_for(self, window: int | None) -> torch.Tensor | None:
        """The mask of a layer with this sliding window (None: global), (B, 1, T, L); None
        when every key is visible. Before the window's width is reached it is the causal one."""
        if window is None or self.kv_len <= window:
            return self.mask
        if window not in self._windowed:
            keys = torch.arange(self.kv_len, device=self.positions.device)
            pos = self.positions[:, None, :, None]
            self._windowed[window] = (keys[None, None, None, :] <= pos) & \
                (keys[None, None, None, :] > pos - window)
        return self._windowed[window]

    def decode_bias(self, kv_heads: int, group: int, dtype: torch.dtype,
                    window: int | None = None) -> torch.Tensor | None:
        """The mask of a decode step (T = 1) as 0 / -inf, (B * kv_heads, group, L), for
        `baddbmm`; made once per step and window, shared by the layers. None when all keys
        are visible."""
        if window is not None and self.kv_len <= window:
            window = None
        if window not in self._bias:
            mask = self.mask_for(window)
            if mask is None:
                self._bias[window] = None
            else:
                b, _, _, length = mask.shape
                bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
                bias.masked_fill_(~mask, float("-inf"))
                self._bias[window] = bias.expand(b, kv_heads, group, length).reshape(
                    b * kv_heads, group, length)
        return self._bias[window]


class LoneInputs:
    """Where a lone decode step's token goes: its block table (as an index and as the C
    kernel's int32 array), the block and offset of its position."""

    __slots__ = ("table", "table_i32", "block", "offset", "identity_rope")

    def __init__(self, table: torch.Tensor, pos: int, block_size: int,
                 identity_rope: tuple[torch.Tensor, torch.Tensor] | None = None):
        self.table = table[None, :]  # (1, blocks)
        self.table_i32 = table.to(torch.int32).contiguous()
        self.block = int(table[pos // block_size])
        self.offset = pos % block_size
        self.identity_rope = identity_rope
