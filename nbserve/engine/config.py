"""EngineConfig: every option of an Engine in one validated record.

`Engine(model, max_batch=8)` and `Engine(model, EngineConfig(max_batch=8))` are the same; the
Pool and launch build one record per replica from the same keywords, so a default lives here
only.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Any

import torch

from .kv_budget import check_kv_memory

PAGED_MAX_BATCH = 64  # default running sequences with a paged cache (a limit, no reservation)
ROW_MAX_BATCH = 16  # default rows of a one-row-per-sequence cache (each reserved up front)
KV_DTYPES = ("float32", "bfloat16", "float16")


def _seconds_or_none(name: str, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or value <= 0):
        raise ValueError(f"{name} must be a number of seconds > 0 (or None for no limit), got "
                         f"{value!r}")


def _int_at_least(name: str, value: Any, lo: int, none_means: str | None = None) -> None:
    if value is None and none_means is not None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        extra = f" (or None: {none_means})" if none_means else ""
        raise ValueError(f"{name} must be an integer >= {lo}{extra}, got {value!r}")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How an Engine schedules and protects itself.

    max_batch: sequences running together (None: 64 where the model has a paged cache, else 16,
    one cache row each). max_context: tokens per sequence (None: the model's, capped by what
    the KV blocks hold; at most 4096 for a one-row-per-sequence cache). kv_memory: the paged
    cache's budget, bytes (an int) or a fraction of the free memory (of the RAM available on
    CPU); None: 0.25 of the RAM on CPU, 0.9 of the free GPU memory on CUDA, and no more than
    max_batch sequences of max_context. kv_block_size: tokens per KV block (whole blocks are
    shared between sequences, the agreeing part of a next block is copied; vLLM's default
    of 16). kv_dtype: the
    cache's dtype ("float32", "bfloat16", "float16"; None: the model's `default_kv_dtype`,
    float16 for a quantized CPU model, else its dtype). max_queue: requests
    waiting for admission before new ones get BusyError. prefill_chunk: prompt tokens
    prefilled per step (long prompts are split). queue_timeout: seconds a request may wait
    for admission. max_backlog: events per choice a caller may leave unread (None: no
    limit). slow_client_timeout: seconds the oldest of them may wait: a caller over
    max_backlog whose oldest unread event is older is too slow, and its request is cancelled
    (0: the count alone decides); a busy machine's event loop that is late for a moment is not
    a slow client. restart_on_failure: restart the engine thread if it dies.
    threads: torch intra-op threads of the engine thread (None: tuned per forward size on
    CPU). step_timeout: seconds one step may run before the engine counts as stuck. name:
    the served model name (default: the model's). quiet: no start-up line. static_decode:
    decode steps at bucketed shapes from static buffers, captured as CUDA graphs and replayed
    (`execution.static_decode`; None: on for a CUDA model with a paged cache, off on CPU, where
    True runs the same bucketed steps eagerly, without the C kernels).
    """

    max_batch: int | None = None
    max_context: int | None = None
    kv_memory: int | float | None = None
    kv_block_size: int = 16
    kv_dtype: str | None = None
    max_queue: int = 256
    prefill_chunk: int = 512
    queue_timeout: float | None = 600.0
    max_backlog: int | None = 1024
    slow_client_timeout: float = 10.0
    restart_on_failure: bool = True
    threads: int | None = None
    step_timeout: float | None = 300.0
    name: str | None = None
    quiet: bool = False
    static_decode: bool | None = None

    def __post_init__(self) -> None:
        for field in ("max_queue", "prefill_chunk", "kv_block_size"):
            _int_at_least(field, getattr(self, field), 1)
        _int_at_least("max_batch", self.max_batch, 1, "64 with a paged cache, else 16")
        check_kv_memory(self.kv_memory)
        if self.kv_dtype is not None and self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)} (or None: the "
                             f"model's), got {self.kv_dtype!r}")
        _int_at_least("max_context", self.max_context, 2, "the model's, at most 4096")
        _int_at_least("max_backlog", self.max_backlog, 1, "no limit")
        _int_at_least("threads", self.threads, 1, "tuned")
        _seconds_or_none("queue_timeout", self.queue_timeout)
        _seconds_or_none("step_timeout", self.step_timeout)
        grace = self.slow_client_timeout
        if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not grace >= 0:
            raise ValueError("slow_client_timeout must be a number of seconds >= 0 (0: "
                             f"max_backlog alone decides), got {grace!r}")
        if self.static_decode is not None and not isinstance(self.static_decode, bool):
            raise ValueError("static_decode must be True, False or None (on for a CUDA model), "
                             f"got {self.static_decode!r}")
        if self.name is not None and (not isinstance(self.name, str) or not self.name.strip()):
            raise ValueError(f"name must be a non-empty string (or None), got {self.name!r}")

    @classmethod
    def options(cls) -> tuple[str, ...]:
        """The keyword names an Engine takes besides the model."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_options(cls, base: EngineConfig | None = None, **options: Any) -> EngineConfig:
        """`base` (default: the defaults) with `options` replaced; an unknown keyword is a
        TypeError that names it and the close matches."""
        known = cls.options()
        unknown = [k for k in options if k not in known]
        if unknown:
            hints = []
            for key in unknown:
                close = difflib.get_close_matches(key, known, n=1)
                hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise TypeError(f"unknown engine option {', '.join(hints)}; the engine takes "
                            f"{', '.join(known)}")
        return dataclasses.replace(base or cls(), **options)

    def resolved_max_batch(self, paged: bool) -> int:
        """`max_batch`, or its default for a model with (without) a paged cache."""
        if self.max_batch is not None:
            return self.max_batch
        return PAGED_MAX_BATCH if paged else ROW_MAX_BATCH

    def resolved_kv_dtype(self, model_default: torch.dtype) -> torch.dtype:
        """`kv_dtype`, or the model's default (its `default_kv_dtype`, else its dtype)."""
        return model_default if self.kv_dtype is None else getattr(torch, self.kv_dtype)

    def context_for(self, model_context: int, paged: bool = False) -> int:
        """The context length to serve a model whose own limit is `model_context` (before
        a paged cache caps it at what its blocks hold)."""
        if self.max_context is None:
            return model_context if paged else min(model_context, 4096)
        if self.max_context > model_context:
            raise ValueError(f"max_context must be between 2 and the model's {model_context}, "
                             f"got {self.max_context}")
        return self.max_context
