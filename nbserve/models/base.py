"""The StepModel protocol, the one seam between the engine and any model it serves, and
LoadedModel, what every loader (and model adoption) returns and the engine is built from.

A StepModel computes logits for a batch of token rows at explicit positions, reading and
writing a KV cache that it allocated itself: one "slot" (row of the cache) per sequence, or,
for a model that offers a paged cache, blocks named by a block table per sequence.
The same call serves a prefill chunk (T > 1) and a decode batch (T == 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class StepModel(Protocol):
    """What the engine needs from a model.

    - `max_context`: the longest sequence (prompt + output) the model accepts.
    - `vocab_size`: width of the logits.
    - `make_cache(max_batch, max_context)`: allocate the KV cache once; it must offer
      `copy_prefix(src_slot, dst_slot, length)` (used for n > 1) and `nbytes`.
    - `forward(ids, positions, slots, cache, logit_index=None)`:
        ids (B, T) int64 token ids, positions (B, T) int64 absolute positions of those ids,
        slots (B,) int64 cache rows. Row b's tokens are written to the cache at
        (slots[b], positions[b]) and attend to every cached position <= their own.
        All rows have the same T (a decode batch, or prefill chunks of equal length); no
        padding, unless the model sets `accepts_padded_rows = True`: then prefill rows may be
        right-padded, pad entries carrying positions past the row's real tokens (their keys
        and values land in the cache beyond the row's end, where no real query looks).
        Returns logits (B, T, V); with `logit_index` (B,) only the logits of
        position `logit_index[b]` in each row: (B, V).
        Optional: a forward that also accepts `max_pos` (the largest position in `positions`)
        and `contiguous_from` (the first slot when `slots` is a contiguous run, else None)
        gets them from the engine, which saves it a device sync and a gather.

    A paged cache (optional; the engine uses it where the model has `make_paged_cache`):
    - `make_paged_cache(n_blocks, block_size, dtype)`: a cache of `n_blocks` blocks of
      `block_size` positions plus one pad block (`cache.pad_block`), with `nbytes` and
      `copy_prefix(src_block, dst_block, length)` (the first `length` positions of a block);
      `kv_bytes_per_token(dtype)` sizes it from the engine's memory budget; an optional
      `default_kv_dtype` is the cache's dtype when the engine is given none (else `dtype`).
    - `forward` then takes block tables (B, S) int64 where `slots` were: position p of row b
      lives in block tables[b, p // block_size] at offset p % block_size; entries past a
      row's blocks are the pad block, and so are pad positions past a row's table. Blocks
      may be shared by several rows (a common prefix): a row only writes positions at or past
      its own `computed` tokens, which lie in blocks it holds alone.
    """

    max_context: int
    vocab_size: int
    device: torch.device
    dtype: torch.dtype

    def make_cache(self, max_batch: int, max_context: int) -> Any: ...

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        cache: Any,
        logit_index: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


@dataclass(slots=True)
class LoadedModel:
    """A model ready to serve: the StepModel, its tokenizer, chat template and stop ids."""

    model: Any  # a StepModel
    tokenizer: Any  # nbserve.text.Tokenizer
    template: Any | None  # nbserve.text.ChatTemplate, None when the model has none
    name: str
    stop_token_ids: list[int] = field(default_factory=list)
    source: str = ""
