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

    max_batch: sequences decoded together (one KV slot each). max_context: tokens per sequence
    (None: the model's, at most 4096). max_queue: requests waiting for a slot before new ones
    get BusyError. prefill_chunk: prompt tokens prefilled per step (long prompts are split).
    queue_timeout: seconds a request may wait for a slot. max_backlog: events per choice a
    caller may leave unread before its request is cancelled. restart_on_failure: restart the
    engine thread if it dies. threads: torch intra-op threads of the engine thread (None: tuned
    per forward size on CPU). step_timeout: seconds one step may run before the engine counts
    as stuck. name: the served model name (default: the model's). quiet: no start-up line.
    """

    max_batch: int = 16
    max_context: int | None = None
    max_queue: int = 256
    prefill_chunk: int = 512
    queue_timeout: float | None = 600.0
    max_backlog: int | None = 1024
    restart_on_failure: bool = True
    threads: int | None = None
    step_timeout: float | None = 300.0
    name: str | None = None
    quiet: bool = False

    def __post_init__(self) -> None:
        for field in ("max_batch", "max_queue", "prefill_chunk"):
            _int_at_least(field, getattr(self, field), 1)
        _int_at_least("max_context", self.max_context, 2, "the model's, at most 4096")
        _int_at_least("max_backlog", self.max_backlog, 1, "no limit")
        _int_at_least("threads", self.threads, 1, "tuned")
        _seconds_or_none("queue_timeout", self.queue_timeout)
        _seconds_or_none("step_timeout", self.step_timeout)
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

    def context_for(self, model_context: int) -> int:
        """The context length to serve a model whose own limit is `model_context`."""
        if self.max_context is None:
            return min(model_context, 4096)
        if self.max_context > model_context:
            raise ValueError(f"max_context must be between 2 and the model's {model_context}, "
                             f"got {self.max_context}")
        return self.max_context
