"""The model seam (models/base.py): the engine's path is the type of the model it holds.

nbserve's own models are `PagedModel`s and its adapters `SlotModel`s, served as they are; a
user's StepModel is wrapped once (`models.adapters.step_model.served`) into the one whose
members it offers, and the engine runs it as it runs nbserve's own.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from fakes import ScriptedModel

from nbserve.engine import Engine
from nbserve.loading import load
from nbserve.models.adapters import RecomputeAdapter
from nbserve.models.adapters.step_model import AdoptedPagedModel, AdoptedSlotModel, served
from nbserve.models.base import PagedModel, SlotModel
from nbserve.types import Delta, Request, SamplingParams

PROMPTS = [[3, 4, 5, 6, 7], [8, 9, 10], [11, 12, 13, 14, 15, 16, 17]]


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    return load(str(tiny_llama_dir), verbose=False)


class UserPaged:
    """A user's paged StepModel: no nbserve base class, the members of PagedStepModel written
    out by hand (here over a native model, so that its answers can be compared). `hints`:
    whether its forward takes max_pos / contiguous_from."""

    def __init__(self, inner: Any, hints: bool):
        self.inner, self.hints = inner, hints
        self.max_context, self.vocab_size = inner.max_context, inner.vocab_size
        self.device, self.dtype = inner.device, inner.dtype
        self.calls: list[tuple[int, bool]] = []  # (where's dims, whether max_pos came)

    def make_cache(self, max_batch: int, max_context: int) -> Any:
        return self.inner.make_cache(max_batch, max_context)

    def make_paged_cache(self, n_blocks: int, block_size: int, dtype: Any = None) -> Any:
        return self.inner.make_paged_cache(n_blocks, block_size, dtype)

    def kv_bytes_per_token(self, dtype: Any = None) -> int:
        return int(self.inner.kv_bytes_per_token(dtype))

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor,
                cache: Any, logit_index: torch.Tensor | None = None,
                **hints: Any) -> torch.Tensor:
        if not self.hints and hints:
            raise TypeError(f"forward got hints it does not take: {sorted(hints)}")
        self.calls.append((tables.dim(), "max_pos" in hints))
        return self.inner.forward(ids, positions, tables, cache, logit_index=logit_index,
                                  max_pos=hints.get("max_pos"))


class UserPagedNoHints(UserPaged):
    def forward(self, ids: torch.Tensor, positions: torch.Tensor,  # type: ignore[override]
                tables: torch.Tensor, cache: Any,
                logit_index: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(ids, positions, tables, cache, logit_index)


def _greedy(engine: Engine) -> list[list[int]]:
    out = []
    for ids in PROMPTS:
        tokens: list[int] = []
        for ev in engine.stream(Request(prompt_ids=ids, params=SamplingParams(
                max_tokens=12, temperature=0.0, ignore_eos=True))):
            if isinstance(ev, Delta):
                tokens += ev.token_ids
        out.append(tokens)
    return out


def test_nbserve_models_and_adapters_are_served_as_they_are(tiny) -> None:
    assert isinstance(tiny.model, PagedModel) and served(tiny.model) is tiny.model
    adapter = RecomputeAdapter(torch.nn.Linear(4, 4), max_context=8, vocab_size=4, warn=False)
    assert isinstance(adapter, SlotModel) and not isinstance(adapter, PagedModel)
    assert served(adapter) is adapter
    wrapped = served(ScriptedModel())
    assert type(wrapped) is AdoptedSlotModel and not wrapped.accepts_padded_rows


@pytest.mark.parametrize("cls", [UserPaged, UserPagedNoHints])
def test_a_users_paged_step_model_gets_the_paged_cache(tiny, cls) -> None:
    """docs/custom_model.md: a model with make_paged_cache and kv_bytes_per_token gets block
    tables; its optional members default (float32 cache, no padded rows, no static steps),
    and the engine's hints reach its forward only where it takes them."""
    with Engine(tiny, max_batch=4, max_context=128, quiet=True) as native:
        want = _greedy(native)
        native_blocks = native.stats()["kv_blocks_total"]
    user = cls(tiny.model, hints=cls is UserPaged)
    loaded = dataclasses.replace(tiny, model=user)
    with Engine(loaded, max_batch=4, max_context=128, quiet=True) as engine:
        assert type(engine.model) is AdoptedPagedModel and engine.model.inner is user
        assert not engine.model.accepts_padded_rows
        assert engine.cache.dtype == tiny.model.dtype
        assert engine.stats()["kv_blocks_total"] == native_blocks
        assert _greedy(engine) == want
    assert user.calls and all(dims == 2 for dims, _ in user.calls)  # block tables, not slots
    assert all(got_hint == (cls is UserPaged) for _, got_hint in user.calls)
