"""The step paths of a decoder over the paged cache, for every architecture that derives from
`PagedSteps` (models/decoder.py): a batch's step (prefill chunks and decode rows, layer by
layer, or a decode batch's layers in one C call), and a lone decode step (one sequence's one
token: the same values without the batch bookkeeping, or all its layers in one C call).

The architecture provides what a step reads of it, declared here as methods it implements
(`_step_layers`, `_embed`, `_logits`, the RoPE rows, `_stack_of_layers`); which path serves is
chosen here, by the step's shape and what the weights' forms run on.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Protocol

import torch

from .decode_stack import DecodeStack
from .kv_cache import PagedKVCache
from .paged_attention import CACHE_DTYPES
from .step_inputs import LoneInputs, Rope, StepInputs, padded_tables

RopeRows = tuple[torch.Tensor, torch.Tensor]  # (cos, sin_signed) rows


class StepLayer(Protocol):
    """A decoder layer as the step paths run it."""

    def __call__(self, x: torch.Tensor, ropes: Sequence[Rope], step: StepInputs,
                 cache: PagedKVCache) -> torch.Tensor: ...

    def lone_step(self, x: torch.Tensor, ropes: Sequence[Rope], pos: int, seq: LoneInputs,
                  cache: PagedKVCache) -> torch.Tensor: ...


class PagedSteps:
    """`forward` over a paged cache and the paths behind it; see the module docstring."""

    # ------------------------------------------------------------------ what a model provides

    def _step_layers(self) -> Sequence[StepLayer]:
        """The decoder layers, in order."""
        raise NotImplementedError

    def _embed(self, ids: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """The input of the first layer for token ids (B, T) or (1,)."""
        raise NotImplementedError

    def _embed_lone(self, ids: torch.Tensor, pos: int) -> torch.Tensor:
        """`_embed` of a lone step's token (1,) at position `pos`."""
        raise NotImplementedError

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """Float32 logits of the last layer's hidden states."""
        raise NotImplementedError

    def _final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The last layer's hidden states through the final norm (what `_logits` reads)."""
        raise NotImplementedError

    def _batch_ropes(self, positions: torch.Tensor, kv_len: int) -> list[Rope]:
        """Each RoPE's rows (B, T, 1, rotary) for `positions` (B, T)."""
        raise NotImplementedError

    def _lone_ropes(self, pos: int) -> list[Rope]:
        """Each RoPE's row at position `pos`."""
        raise NotImplementedError

    def _identity_rope(self, rows: int) -> RopeRows | None:
        """Rope rows that change nothing, for the kernels at layers without RoPE; None when
        every layer has one."""
        raise NotImplementedError

    def _stack_of_layers(self) -> DecodeStack | None:
        """The layers as one C call (decode_stack.py), or None where they do not fit it."""
        raise NotImplementedError

    def _adapters_active(self) -> bool:
        """Whether the running step has rows with a LoRA adapter: then the one-C-call paths
        (the decode stack, the lone step), which know no adapters, are skipped."""
        return False

    @property
    def _paged_kernel(self) -> bool:
        """Whether decode attention runs in nbserve's C kernel (where the matmuls do)."""
        raise NotImplementedError

    @property
    def _lone_ready(self) -> bool:
        """Whether `_lone_step` can serve (it is written for fused q/k/v)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ the paths

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor,
                cache: PagedKVCache, logit_index: torch.Tensor | None = None,
                max_pos: int | None = None, contiguous_from: int | None = None) -> torch.Tensor:
        """ids, positions (B, T), block tables (B, blocks) -> logits (B, T, V), or (B, V)
        with logit_index. Rows of a cache made by `make_cache` may be given as slots (B,).

        `max_pos` (the largest position, if the caller knows it: the engine does) saves a
        device sync, and lets a lone decode step (B = T = 1) take `_lone_step`.
        `contiguous_from` is accepted for callers of the row convention and not needed.
        """
        if tables.dim() == 1:
            tables = cache.row_tables(tables)
        lone = max_pos is not None
        if max_pos is None:
            max_pos = int(positions.max())
        if ids.shape == (1, 1) and lone and self._lone_ready and not self._adapters_active():
            return self._lone_step(ids, max_pos, tables[0], cache, logit_index is None)
        kernel = self._paged_kernel and cache.dtype in CACHE_DTYPES
        return self.batched_step(ids, positions, tables, cache, max_pos + 1, logit_index, kernel)

    @torch.inference_mode()
    def forward_hidden(self, ids: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor,
                       cache: PagedKVCache, max_pos: int | None = None,
                       contiguous_from: int | None = None) -> torch.Tensor:
        """ids, positions (B, T), block tables (B, blocks) -> the hidden states after the
        final norm (B, T, H), the cache written as `forward` writes it (an embedding's
        prefill: its chunks run as a prompt's do, pooled by the engine)."""
        if tables.dim() == 1:
            tables = cache.row_tables(tables)
        if max_pos is None:
            max_pos = int(positions.max())
        kernel = self._paged_kernel and cache.dtype in CACHE_DTYPES
        return self.batched_step(ids, positions, tables, cache, max_pos + 1, None, kernel,
                                 hidden=True)

    def batched_step(self, ids: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor,
                     cache: PagedKVCache, kv_len: int, logit_index: torch.Tensor | None = None,
                     kernel: bool = False, padded: bool = False, hidden: bool = False
                     ) -> torch.Tensor:
        """`forward` for a batch (never the lone-step shortcut), attention reading the first
        `kv_len` positions of every table row: the largest position + 1, or with `padded`
        more, masked by position (`StaticDecode` rounds it up, to run at fixed shapes).
        `kernel`: decode attention in the C kernels (CPU). `hidden`: every position's states
        after the final norm instead of logits (`forward_hidden`)."""
        identity = self._identity_rope(ids.shape[0]) if kernel and ids.shape[1] == 1 else None
        ropes = self._batch_ropes(positions, kv_len)
        x = self._embed(ids, positions)  # (B, T, H)
        stacked = self._stacked_batch_step(x, positions, tables, cache, kv_len, ropes,
                                           identity) \
            if kernel and ids.shape[1] == 1 and not self._adapters_active() else None
        if stacked is not None:
            x = stacked
        else:
            step = StepInputs(positions, tables, kv_len - 1, cache, kernel, padded, identity)
            for layer in self._step_layers():
                x = layer(x, ropes, step, cache)
        if hidden:
            return self._final_norm(x)
        if logit_index is not None:
            x = x[torch.arange(x.shape[0], device=x.device), logit_index]  # (B, H)
        return self._logits(x)

    def _lone_step(self, ids: torch.Tensor, pos: int, table: torch.Tensor,
                   cache: PagedKVCache, keep_time_dim: bool) -> torch.Tensor:
        """`forward` for a lone decode step (B = T = 1, the single-stream case): the same
        values, through each layer's `lone_step`, without the batch bookkeeping that costs a
        noticeable share of a one-token step (benchmarks/README.md)."""
        ropes = self._lone_ropes(pos)
        x = self._embed_lone(ids.view(1), pos)  # (1, H)
        identity = self._identity_rope(1)
        seq = LoneInputs(table, pos, cache.block_size,
                         None if identity is None else (identity[0][0], identity[1][0]))
        stacked = self._stacked_lone_step(x, ropes, pos, seq, cache)
        if stacked is not None:
            x = stacked
        else:
            for layer in self._step_layers():
                x = layer.lone_step(x, ropes, pos, seq, cache)
        logits = self._logits(x)
        return logits.view(1, 1, -1) if keep_time_dim else logits

    def _stacked_lone_step(self, x: torch.Tensor, ropes: Sequence[Rope], pos: int,
                           seq: LoneInputs, cache: PagedKVCache) -> torch.Tensor | None:
        """Every layer's lone step in one C call where the model's layers and this step
        allow it (the same values); None: run them one by one."""
        stack = self._stack_of_layers()
        if stack is None or not stack.serves(pos, cache):
            return None
        rope = seq.identity_rope if stack.rope_id is None else ropes[stack.rope_id]
        if rope is None:
            return None
        rows = (rope[0].view(1, -1), rope[1].view(1, -1))
        return stack(x, ctypes.c_int32(pos), seq.table_i32, cache, rows)

    def _stacked_batch_step(self, x: torch.Tensor, positions: torch.Tensor,
                            tables: torch.Tensor, cache: PagedKVCache, kv_len: int,
                            ropes: Sequence[Rope], identity: RopeRows | None
                            ) -> torch.Tensor | None:
        """A decode batch's layers (x (B, 1, H), one token a row) in one C call, or None."""
        stack = self._stack_of_layers()
        if stack is None or not stack.serves(kv_len - 1, cache):
            return None
        b, d = x.shape[0], stack.d
        layer_rope = identity if stack.rope_id is None else ropes[stack.rope_id]
        if layer_rope is None:
            return None
        rope = layer_rope if stack.rope_id is None else \
            (layer_rope[0].reshape(b, d), layer_rope[1].reshape(b, d))
        tables = padded_tables(tables, kv_len, cache)
        out = stack(x, positions[:, 0].to(torch.int32).contiguous(),
                    tables.to(torch.int32).contiguous(), cache,
                    (rope[0].contiguous(), rope[1].contiguous()))
        return None if out is None else out.view(b, 1, -1)
