"""LoRA adapters applied per row of a batch: each matmul holder (holders.py) may carry a
`LoraSlot`, the low-rank factors of every loaded adapter that targets it; a step names which
adapter each of its rows uses (`AdapterRows`), and `linear` adds to each row its adapter's
update y += scale * (x @ A.T) @ B.T, gathered by adapter (rows without one skip it). The base
weights stay as they are (quantized, packed, fused): the update is a separate small matmul.

A fused holder (q|k|v, gate|up) keeps one pair per adapter: A the stacked A's of its parts,
B block-diagonal (each part's B at its output columns, its scale folded in), so that one pair
of matmuls serves the parts an adapter targets and leaves the others at zero.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


class AdapterRows:
    """Which adapter each row of the running step applies: `rows` (B,) of adapter indices,
    -1 for none; None while no row has one (then every slot is skipped). One per model, shared
    by its slots; set by the engine around a step (`selected`)."""

    def __init__(self) -> None:
        self.rows: torch.Tensor | None = None
        self.used: list[int] = []  # the distinct indices in `rows`, -1 left out

    @contextmanager
    def selected(self, indices: list[int], device: torch.device) -> Iterator[None]:
        """Rows use `indices` (one per batch row, -1: no adapter) for the block's steps."""
        used = sorted({i for i in indices if i >= 0})
        if not used:
            yield
            return
        self.rows, self.used = torch.tensor(indices, device=device), used
        try:
            yield
        finally:
            self.rows, self.used = None, []

    @property
    def active(self) -> bool:
        return self.rows is not None


class LoraSlot:
    """The adapters' factors of one matmul holder: by adapter index, (A (r, in), B (out, r))
    with the scale folded into B."""

    def __init__(self, rows: AdapterRows, out_features: int):
        self.rows, self.out_features = rows, out_features
        self.pairs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def live(self) -> bool:
        """Whether the running step has a row whose adapter updates this holder."""
        return self.rows.active and any(i in self.pairs for i in self.rows.used)

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y plus each row's update of x (rows along dim 0 of both: (B, T, in) or (B, in))."""
        rows = self.rows.rows
        if rows is None or rows.shape[0] != x.shape[0]:
            return y
        out = y
        for index in self.rows.used:
            pair = self.pairs.get(index)
            if pair is None:
                continue
            a, b = pair
            where = (rows == index).nonzero().view(-1)
            delta = (x.index_select(0, where).to(a.dtype) @ a.T) @ b.T
            out = out.index_add(0, where, delta.to(y.dtype))
        return out
