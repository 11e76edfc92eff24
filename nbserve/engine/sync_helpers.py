"""Blocking `complete` / `chat` helpers shared by Engine and Pool, built on `self.stream`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ..types import ChatMessage, Delta, ErrorEvent, Event, Request, SamplingParams


class SyncHelpers:
    """Mixin: blocking text helpers for any class with `stream(request) -> Iterator[Event]`."""

    def stream(self, request: Request) -> Iterator[Event]:  # pragma: no cover - overridden
        raise NotImplementedError

    def complete(self, prompt: str, **params: Any) -> str:
        """Generate a completion of raw text `prompt` and return its text (choice 0)."""
        return self._collect(Request(prompt=prompt, params=SamplingParams(**params)))

    def chat(self, messages: list[ChatMessage] | str, **params: Any) -> str:
        """Answer a conversation (or one user message) and return the reply text."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        return self._collect(Request(messages=messages, params=SamplingParams(**params)))

    def _collect(self, request: Request) -> str:
        parts: list[str] = []
        for ev in self.stream(request):
            if isinstance(ev, ErrorEvent):
                raise RuntimeError(ev.message)  # noqa: TRY004 - the public contract
            if isinstance(ev, Delta) and ev.index == 0:
                parts.append(ev.text)
        return "".join(parts)
