"""A user's own StepModel, wrapped once into what the engine runs (`served`).

A user's object is duck-typed (docs/custom_model.md): what it offers beyond the required
members (a paged cache, `accepts_padded_rows`, `default_kv_dtype`, static decode steps, a
forward that takes the engine's hints) is read here, once, when it is wrapped, and declared
by the wrapper's type and attributes. nbserve's own models and adapters are served as they
are; they declare the same by subclassing `PagedModel` or `SlotModel`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch

from ..base import PagedCache, PagedModel, SlotCache, SlotModel, StaticSteps, StepModel


@runtime_checkable
class OffersPagedCache(Protocol):
    """A user's model that makes a paged cache and sizes it (`PagedStepModel`'s own
    members)."""

    def make_paged_cache(self, n_blocks: int, block_size: int,
                         dtype: torch.dtype | None = None) -> PagedCache: ...

    def kv_bytes_per_token(self, dtype: torch.dtype | None = None) -> int: ...


class PagedInner(StepModel, OffersPagedCache, Protocol):
    """A user's StepModel with a paged cache, as `served` found it."""


@runtime_checkable
class PadsRows(Protocol):
    """A user's model that says whether padded prefill rows are inert (optional)."""

    @property
    def accepts_padded_rows(self) -> bool: ...


@runtime_checkable
class SizedCache(Protocol):
    """A user's cache that says its size (optional: 0 where it does not)."""

    @property
    def nbytes(self) -> int: ...


@runtime_checkable
class OffersStaticSteps(Protocol):
    """A user's paged model with its own static decode steps (optional)."""

    def make_static_decode(self, cache: PagedCache, max_batch: int, max_context: int,
                           capture: bool) -> StaticSteps | None: ...


@runtime_checkable
class ChoosesKVDtype(Protocol):
    """A user's paged model that names its cache's dtype (optional: else its `dtype`)."""

    @property
    def default_kv_dtype(self) -> torch.dtype: ...


def served(model: StepModel | SlotModel) -> SlotModel:
    """`model` as the engine runs it: as it is when it declares its path (a `SlotModel`,
    `PagedModel` included), else wrapped: `AdoptedPagedModel` when it offers a paged cache
    (`make_paged_cache` and `kv_bytes_per_token`, as `PagedStepModel` says),
    `AdoptedSlotModel` otherwise."""
    if isinstance(model, SlotModel):
        return model
    if isinstance(model, OffersPagedCache):
        return AdoptedPagedModel(model)
    return AdoptedSlotModel(model)


def takes_hints(forward: Callable[..., torch.Tensor]) -> bool:
    """Whether a StepModel's forward takes the optional `max_pos` / `contiguous_from` hints."""
    try:
        inspect.signature(forward).bind(0, 0, 0, 0, logit_index=None, max_pos=0,
                                        contiguous_from=None)
        return True
    except (TypeError, ValueError):
        return False


class AdoptedSlotModel(SlotModel):
    """A user's StepModel over its own cache of one row per sequence. The hints reach its
    forward only if it takes them; `accepts_padded_rows` is the model's own (default False).
    `inner` is the user's object, called live (replacing its `forward` takes effect)."""

    def __init__(self, inner: StepModel):
        self.inner = inner
        self.max_context, self.vocab_size = int(inner.max_context), int(inner.vocab_size)
        self.hints = takes_hints(inner.forward)
        self.accepts_padded_rows = isinstance(inner, PadsRows) and \
            bool(inner.accepts_padded_rows)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"

    @property
    def device(self) -> torch.device:
        return torch.device(self.inner.device)

    @property
    def dtype(self) -> torch.dtype:
        return self.inner.dtype

    def make_cache(self, max_batch: int, max_context: int) -> SlotCache:
        return self.inner.make_cache(max_batch, max_context)

    def cache_nbytes(self, cache: SlotCache) -> int:
        """The cache's `nbytes`, 0 where a user's cache does not say."""
        return int(cache.nbytes) if isinstance(cache, SizedCache) else 0

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                cache: SlotCache, logit_index: torch.Tensor | None = None,
                max_pos: int | None = None, contiguous_from: int | None = None
                ) -> torch.Tensor:
        if self.hints:  # its signature takes them (`takes_hints`), read live
            hinted: Callable[..., torch.Tensor] = self.inner.forward
            return hinted(ids, positions, slots, cache, logit_index=logit_index,
                          max_pos=max_pos, contiguous_from=contiguous_from)
        return self.inner.forward(ids, positions, slots, cache,
                                  logit_index=logit_index)


class AdoptedPagedModel(AdoptedSlotModel, PagedModel):
    """A user's PagedStepModel: the engine gives it a paged cache. Its optional members
    (`default_kv_dtype`, `accepts_padded_rows`, `make_static_decode`) are its own where it
    has them; the forward gets `max_pos` when it takes the hints."""

    inner: PagedInner

    def __init__(self, inner: PagedInner):
        super().__init__(inner)
        self._static = inner.make_static_decode if isinstance(inner, OffersStaticSteps) \
            else None

    @property
    def default_kv_dtype(self) -> torch.dtype:
        inner = self.inner
        return inner.default_kv_dtype if isinstance(inner, ChoosesKVDtype) else self.dtype

    def make_paged_cache(self, n_blocks: int, block_size: int,
                         dtype: torch.dtype | None = None) -> PagedCache:
        return self.inner.make_paged_cache(
            n_blocks, block_size, dtype)

    def kv_bytes_per_token(self, dtype: torch.dtype | None = None) -> int:
        return int(self.inner.kv_bytes_per_token(dtype))

    def make_static_decode(self, cache: PagedCache, max_batch: int, max_context: int,
                           capture: bool) -> StaticSteps | None:
        if self._static is None:
            return None
        return self._static(cache, max_batch, max_context, capture=capture)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                cache: SlotCache, logit_index: torch.Tensor | None = None,
                max_pos: int | None = None, contiguous_from: int | None = None
                ) -> torch.Tensor:
        if self.hints:  # its signature takes them (`takes_hints`), read live
            hinted: Callable[..., torch.Tensor] = self.inner.forward
            return hinted(ids, positions, slots, cache, logit_index=logit_index,
                          max_pos=max_pos)
        return self.inner.forward(ids, positions, slots, cache,
                                  logit_index=logit_index)
