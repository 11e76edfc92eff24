"""What the chat and completions streams share: the failure of a started request, what every
chunk of one response carries, the log-probability floor, the finish reasons and the walk that
folds a stream's chunks per choice. Each family's chunks and what its fold keeps of a chunk
live with its route (`chat.py`, `completions.py`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
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


@dataclass
class Folded:
    """A stream's chunks folded per choice: the first chunk (id, created, model), each choice's
    state (what the family's `add` kept, and its `finish` reason) and the usage chunk's usage."""

    head: JSONBody
    choices: dict[int, JSONBody]
    usage: JSONBody | None

    def answer(self, obj: str, choices: list[JSONBody]) -> JSONBody:
        """The non-streaming answer of object type `obj` around `choices`."""
        head = self.head
        return {"id": head.get("id"), "object": obj, "created": head.get("created"),
                "model": head.get("model"), "system_fingerprint": None, "choices": choices,
                "usage": self.usage}


async def fold_chunks(chunks: AsyncIterator[JSONBody], new_state: Callable[[], JSONBody],
                      add: Callable[[JSONBody, JSONBody], None]) -> Folded:
    """Walk a stream's chunks once: each choice's chunk goes to `add(state, chunk)` on its own
    state (`new_state()` at its first chunk); its finish reason is kept as `state["finish"]`."""
    folded = Folded({}, {}, None)
    async for c in chunks:
        folded.head = folded.head or c
        if not c["choices"]:
            folded.usage = c.get("usage")
        for ch in c["choices"]:
            st = folded.choices.get(ch["index"])
            if st is None:
                st = folded.choices[ch["index"]] = {**new_state(), "finish": None}
            add(st, ch)
            if ch.get("finish_reason"):
                st["finish"] = ch["finish_reason"]
    return folded
