"""TransformersAdapter: serve any `transformers` causal LM with its own KV cache, one per slot.

Architectures nbserve implements (Llama, Mistral, Qwen2) are taken over by nbserve's own model
instead (see `nbserve.models.adopt`); this adapter is the correct-but-slower path for the rest
(GPT-2, Phi, Gemma...). Each row of a batch runs separately with the model's own cache object
(a `DynamicCache`), rolled back when a slot's sequence is replaced.
"""

from __future__ import annotations

import copy
import inspect
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from .common import (
    CONTEXT_KEYS,
    ModuleAdapter,
    eval_view,
    first_int,
    logits_of,
    native_list,
    warn_slow,
)


@runtime_checkable
class NestedConfig(Protocol):
    """A transformers config that holds its text model's (a multimodal model's)."""

    def get_text_config(self) -> object: ...


@runtime_checkable
class LanguageModel(Protocol):
    """A transformers model's LM head, which says the vocabulary size."""

    def get_output_embeddings(self) -> nn.Module: ...


@runtime_checkable
class CroppableCache(Protocol):
    """A transformers cache object (`DynamicCache`...): its length, and a cut of its end."""

    def get_seq_length(self) -> int: ...

    def crop(self, max_length: int) -> None: ...


def _rollback(cache: object, keep: int) -> bool:
    """Cut `cache` back to its first `keep` positions; False when that is not possible."""
    if not isinstance(cache, CroppableCache):
        return False  # a legacy tuple cache
    try:
        current = cache.get_seq_length()
        if current == keep:
            return True
        if current < keep or not getattr(cache, "is_croppable", True):
            return False
        cache.crop(keep - current)  # negative: remove that many (transformers 4.x and 5.x)
        return cache.get_seq_length() == keep
    except Exception:  # noqa: BLE001 - legacy tuple caches, layers that cannot crop
        return False


def _nbytes(obj: object, depth: int = 0) -> int:
    """Bytes of the tensors held by a cache object (its layers' keys/values)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if depth > 3 or obj is None:
        return 0
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(o, depth + 1) for o in obj)
    layers = getattr(obj, "layers", None)
    if layers is not None:
        return _nbytes(list(layers), depth + 1)
    return _nbytes([getattr(obj, "keys", None), getattr(obj, "values", None)], depth + 1)


class SlotCaches:
    """One transformers cache object per slot, plus the tokens it was built from."""

    def __init__(self, max_batch: int):
        self.caches: list[object | None] = [None] * max_batch  # transformers cache objects
        self.tokens: list[list[int]] = [[] for _ in range(max_batch)]

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(c) for c in self.caches)

    @torch.inference_mode()
    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        self.tokens[dst] = self.tokens[src][:length]
        cache = copy.deepcopy(self.caches[src]) if self.caches[src] is not None else None
        self.caches[dst] = cache if cache is not None and _rollback(cache, length) else None


class TransformersAdapter(ModuleAdapter):
    """A StepModel over a `transformers` causal LM (its weights used live, not copied)."""

    def __init__(self, model: nn.Module, *, max_context: int | None = None, warn: bool = True):
        super().__init__()
        self.module = model
        self._view = eval_view(model)
        self.name = type(model).__name__
        config: object = getattr(model, "config", None)  # a transformers PretrainedConfig
        text_config = config.get_text_config() if isinstance(config, NestedConfig) else config
        limit = first_int(CONTEXT_KEYS, text_config)
        if max_context is not None and limit is not None and max_context > limit:
            raise ValueError(f"max_context={max_context} is more than {self.name} supports "
                             f"({limit} positions in its config)")
        context = max_context or limit
        if not context:
            raise ValueError(f"cannot tell the context length of {self.name}: pass "
                             "max_context=... to load()")
        self.max_context = int(context)
        vocab = first_int(("vocab_size",), text_config)
        if not vocab and isinstance(model, LanguageModel):
            vocab = model.get_output_embeddings().get_parameter("weight").shape[0]
        if not vocab:
            raise ValueError(f"cannot tell the vocabulary size of {self.name}")
        self.vocab_size = int(vocab)
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._keep_arg = next((a for a in ("logits_to_keep", "num_logits_to_keep")
                               if a in params), None)
        if warn:
            warn_slow(model, (
                f"nbserve: {self.name} is served through TransformersAdapter: correct, but each "
                "sequence runs separately with the model's own cache, so throughput is lower "
                "than on nbserve's own engine, which runs these architectures natively: "
                f"{native_list()}. Serve one of those, or implement the nbserve.StepModel "
                "protocol (docs/custom_model.md), for full speed."))

    def __repr__(self) -> str:
        return f"TransformersAdapter({self.name}, max_context={self.max_context})"

    def make_cache(self, max_batch: int, max_context: int) -> SlotCaches:
        return SlotCaches(max_batch)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                cache: SlotCaches, logit_index: torch.Tensor | None = None,
                max_pos: int | None = None, contiguous_from: int | None = None) -> torch.Tensor:
        """ids, positions (B, T), slots (B,) -> logits (B, T, V), or (B, V) with logit_index."""
        pick = logit_index.tolist() if logit_index is not None else None
        rows = []
        for r, (slot, row_ids, pos) in enumerate(zip(slots.tolist(), ids.tolist(),
                                                     positions.tolist())):
            logits = self._run_row(cache, slot, pos[0], row_ids,
                                   keep=None if pick is None else len(row_ids) - pick[r])
            rows.append(logits[0] if pick is not None else logits)
        return torch.stack(rows).float()

    def _run_row(self, cache: SlotCaches, slot: int, start: int, new: list[int],
                 keep: int | None) -> torch.Tensor:
        """Run `new` at positions start.. of `slot`; logits of the last `keep` (or all new)."""
        past, tokens = cache.caches[slot], cache.tokens[slot]
        if start > len(tokens):
            raise RuntimeError(f"slot {slot} holds {len(tokens)} tokens; cannot write at {start}")
        kept = start if past is not None and _rollback(past, start) else 0
        if kept == 0:
            past = None  # rebuild this slot's cache from its tokens
        feed = tokens[kept:start] + new
        kwargs: dict[str, object] = {self._cache_arg: past, "use_cache": True}
        if keep is not None and self._keep_arg:
            kwargs[self._keep_arg] = keep
        out = self._view(
            input_ids=torch.tensor([feed], device=self.device),
            position_ids=torch.arange(kept, start + len(new), device=self.device)[None],
            **kwargs)
        returned = getattr(out, "cache", None)
        if returned is None:
            returned = getattr(out, "past_key_values", None)
        cache.caches[slot] = returned if returned is not None else past
        cache.tokens[slot] = tokens[:start] + new
        logits = logits_of(out, f"{self.name}.forward")[0]  # (T', V)
        return logits[-(keep or len(new)):]
