"""The model seam: what the engine needs of a model it serves, and LoadedModel, what every
loader (and model adoption) returns and the engine is built from.

A model computes logits for a batch of token rows at explicit positions, reading and writing
a KV cache that it allocated itself: one "slot" (row of the cache) per sequence, or, for a
model with a paged cache, blocks named by a block table per sequence. The same call serves a
prefill chunk (T > 1) and a decode batch (T == 1).

Two kinds of declaration live here:
- `StepModel` and `PagedStepModel`, the protocols a user's own model implements (structural:
  docs/custom_model.md);
- `SlotModel` and `PagedModel`, the nominal base classes of what the engine runs: nbserve's
  own models subclass `PagedModel`, its adapters `SlotModel`, and a user's object is wrapped
  once into one of them (`models.adapters.step_model.served`). The engine picks its path by
  which of the two it holds (`ServedModel`), never by looking for optional members.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from .pooling import DECODER_DEFAULT, Pooling

if TYPE_CHECKING:
    from ..text import ChatTemplate, Tokenizer
    from .lora import LoraAdapter


class SlotCache(Protocol):
    """A KV cache the engine holds and hands back to the model: its size, and a copy of a
    row's (or block's) first `length` positions into another (n > 1 choices, shared
    prefixes)."""

    @property
    def nbytes(self) -> int: ...

    def copy_prefix(self, src: int, dst: int, length: int) -> None: ...


class PagedCache(SlotCache, Protocol):
    """A cache of blocks plus one pad block, which the rows' table padding names."""

    @property
    def pad_block(self) -> int: ...


class StaticSteps(Protocol):
    """Decode steps at fixed shapes over one paged cache (`execution.static_decode`)."""

    def serves(self, rows: int, max_pos: int, width: int) -> bool:
        """Whether a step of `rows` rows up to `max_pos` over `width` table entries runs here."""
        ...

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor,
                 max_pos: int) -> torch.Tensor: ...

    def describe(self) -> dict[str, int | str | list[int] | None]: ...


@runtime_checkable
class StepModel(Protocol):
    """What a user's model offers to be served (docs/custom_model.md).

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

    A model that also implements `PagedStepModel` gets a paged cache instead.
    The cache is the model's own type (offering `SlotCache`'s members), hence `Any` where
    forward takes it.
    """

    max_context: int
    vocab_size: int

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def make_cache(self, max_batch: int, max_context: int) -> SlotCache: ...

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        cache: Any,
        logit_index: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


@runtime_checkable
class PagedStepModel(StepModel, Protocol):
    """A StepModel with a paged cache (the engine then shares blocks between sequences).

    - `make_paged_cache(n_blocks, block_size, dtype)`: a cache of `n_blocks` blocks of
      `block_size` positions plus one pad block (`cache.pad_block`), with `nbytes` and
      `copy_prefix(src_block, dst_block, length)` (the first `length` positions of a block);
      `kv_bytes_per_token(dtype)` sizes it from the engine's memory budget. Optional members
      of a user's model: `default_kv_dtype`, the cache's dtype when the engine is given none
      (else `dtype`), `accepts_padded_rows` (else False) and `make_static_decode` (else none).
    - `forward` then takes block tables (B, S) int64 where `slots` were: position p of row b
      lives in block tables[b, p // block_size] at offset p % block_size; entries past a
      row's blocks are the pad block, and so are pad positions past a row's table. Blocks
      may be shared by several rows (a common prefix): a row only writes positions at or past
      its own `computed` tokens, which lie in blocks it holds alone.
    """

    def make_paged_cache(self, n_blocks: int, block_size: int,
                         dtype: torch.dtype | None = None) -> PagedCache: ...

    def kv_bytes_per_token(self, dtype: torch.dtype | None = None) -> int: ...


class SlotModel(ABC):
    """What the engine runs over a cache of one row per sequence (nbserve's adapters, a
    user's StepModel). Its forward takes the hints `max_pos` and `contiguous_from` (and may
    ignore them); `accepts_padded_rows` says whether prefill rows may be right-padded."""

    max_context: int
    vocab_size: int
    accepts_padded_rows: bool = False
    # The width of `forward_hidden`'s states; None: the model gives none (an adapter, a user's
    # StepModel), so it serves no pooled embedding.
    hidden_size: int | None = None
    # False for a headless checkpoint (an embedding model's backbone alone): no logits to score.
    has_lm_head: bool = True

    @property
    @abstractmethod
    def device(self) -> torch.device: ...

    @property
    @abstractmethod
    def dtype(self) -> torch.dtype: ...

    @abstractmethod
    def make_cache(self, max_batch: int, max_context: int) -> SlotCache: ...

    @abstractmethod
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                cache: Any, logit_index: torch.Tensor | None = None,
                max_pos: int | None = None, contiguous_from: int | None = None
                ) -> torch.Tensor: ...

    def forward_hidden(self, ids: torch.Tensor, positions: torch.Tensor, where: torch.Tensor,
                       cache: Any, max_pos: int | None = None,
                       contiguous_from: int | None = None) -> torch.Tensor:
        """The hidden states after the final norm (B, T, hidden_size) of every position,
        writing the cache as `forward` does: what an embedding request pools. Served where
        `hidden_size` is set; the engine asks no other model."""
        raise NotImplementedError(f"{type(self).__name__} gives no hidden states")

    def cache_nbytes(self, cache: SlotCache) -> int:
        """The bytes `cache` (made by this model) holds."""
        return int(cache.nbytes)

    def add_lora(self, index: int, adapter: LoraAdapter) -> None:
        """Install `adapter` as adapter `index` (models/lora.py); ValueError where it does not
        fit. Served by nbserve's decoder; other models take none."""
        raise ValueError(f"{type(self).__name__} serves no LoRA adapters (nbserve serves them "
                         "on its native decoder families)")

    def lora_rows(self, indices: list[int]) -> AbstractContextManager[None]:
        """For the steps inside the block, row b applies adapter indices[b] (-1: none)."""
        return nullcontext()


class PagedModel(SlotModel):
    """What the engine runs over a paged cache: nbserve's own models (`DecoderModel`,
    `NanochatModel`) and a user's `PagedStepModel`. `forward` takes block tables where a
    SlotModel's takes slots (and slots too over a cache from `make_cache`); static decode
    steps are offered where `make_static_decode` returns them."""

    accepts_padded_rows: bool = True

    @property
    @abstractmethod
    def default_kv_dtype(self) -> torch.dtype: ...

    @abstractmethod
    def make_paged_cache(self, n_blocks: int, block_size: int,
                         dtype: torch.dtype | None = None) -> PagedCache: ...

    @abstractmethod
    def kv_bytes_per_token(self, dtype: torch.dtype | None = None) -> int: ...

    def make_static_decode(self, cache: Any, max_batch: int, max_context: int,
                           capture: bool) -> StaticSteps | None:
        """Decode steps at fixed shapes over `cache` (CUDA graphs where `capture`), or None
        where the model has none."""
        return None


ServedModel = SlotModel  # a PagedModel is one too: `isinstance(m, PagedModel)` picks the path


@dataclass(slots=True)
class LoadedModel:
    """A model ready to serve: the model, its tokenizer, chat template and stop ids.

    `model` is nbserve's own (`PagedModel`), an adapter (`SlotModel`), or a user's StepModel
    (served through `models.adapters.step_model.served`)."""

    model: StepModel | SlotModel
    tokenizer: Tokenizer
    template: ChatTemplate | None  # None when the model has none
    name: str
    stop_token_ids: list[int] = field(default_factory=list)
    source: str = ""
    pooling: Pooling = DECODER_DEFAULT  # how embedding requests pool (models/pooling.py)
