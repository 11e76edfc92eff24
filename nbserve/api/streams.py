"""What the chat and completions streams share: the failure of a started request, what every
chunk of one response carries, the log-probability floor and the finish reasons. Each family's
chunks and fold live with its route (`chat.py`, `completions.py`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..types import ErrorEvent, Usage
from .trace import Trace

# A JSON object as the routes build and read it (chunks, answers, items, body fields).
JSONBody = dict[str, Any]
_LOGPROB_FLOOR = -9999.0  # OpenAI's stand-in for -inf (JSON has no infinity)
FINISH_REASONS = {"stop": "stop", "length": "length", "cancelled": "stop", "error": "stop"}


class StreamFailed(Exception):
    """The engine ended a started request with an ErrorEvent."""

    def __init__(self, event: ErrorEvent):
        super().__init__(event.message)
        self.event = event


@dataclass(slots=True)
class StreamInfo:
    """What every chunk of one response carries, plus how to render token bytes."""

    id: str
    model: str
    created: int
    trace: Trace
    token_bytes: Callable[[int, str], list[int]] | None = None
    detokenize: Callable[[list[int]], str] | None = None
    usage_parts: dict[int, Usage] = field(default_factory=dict)  # per sub-request

    def usage(self) -> JSONBody:
        p = sum(u.prompt_tokens for u in self.usage_parts.values())
        c = sum(u.completion_tokens for u in self.usage_parts.values())
        cached = sum(u.cached_tokens for u in self.usage_parts.values())
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def record_usage(self, part: int, usage: Usage) -> None:
        self.usage_parts[part] = usage
        t = self.trace
        t.prompt_tokens = sum(u.prompt_tokens for u in self.usage_parts.values())
        t.completion_tokens = sum(u.completion_tokens for u in self.usage_parts.values())
        t.cached_tokens = sum(u.cached_tokens for u in self.usage_parts.values())

    def decode(self, ids: list[int]) -> str:
        return self.detokenize(ids) if self.detokenize is not None and ids else ""

    def bytes_of(self, token_id: int, text: str) -> list[int]:
        if self.token_bytes is not None:
            return list(self.token_bytes(token_id, text))
        return list(text.encode("utf-8"))


def clamp_logprob(value: float) -> float:
    """A log-probability as JSON can hold it (-inf becomes OpenAI's floor)."""
    return max(_LOGPROB_FLOOR, value)
