"""KVCache: one preallocated key/value tensor pair per layer, one row ("slot") per sequence.

Layout per layer: (slots, kv_heads, max_context, head_dim), so that a decode step reads the
first `L` positions of B slots as a strided view (contiguous slots) or one gather (scattered).
"""

from __future__ import annotations

import torch


class KVCache:
    """Preallocated cache for `max_batch` sequences of up to `max_context` tokens each."""

    def __init__(self, n_layers: int, max_batch: int, max_context: int, n_kv_heads: int,
                 head_dim: int, device: torch.device | str, dtype: torch.dtype):
        shape = (max_batch, n_kv_heads, max_context, head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.max_batch = max_batch
        self.max_context = max_context

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v (B, T, H, D) at (slots[b], :, positions[b, t])."""
        idx_s = slots[:, None]  # (B, 1) broadcast against positions (B, T)
        self.k[layer][idx_s, :, positions] = k
        self.v[layer][idx_s, :, positions] = v

    def read(self, layer: int, slots: torch.Tensor, length: int,
             contiguous_from: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (B, H, length, D) of `slots`; a view when slots are a contiguous run."""
        if contiguous_from is not None:
            s = slice(contiguous_from, contiguous_from + slots.shape[0])
            return self.k[layer][s, :, :length], self.v[layer][s, :, :length]
        return self.k[layer][slots, :, :length], self.v[layer][slots, :, :length]

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` cached positions of slot `src` into slot `dst` (n > 1)."""
        for k, v in zip(self.k, self.v):
            k[dst, :, :length] = k[src, :, :length]
            v[dst, :, :length] = v[src, :, :length]
