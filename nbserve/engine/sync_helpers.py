"""Blocking `complete` / `chat` / `embed` helpers shared by Engine and Pool, built on
`self.stream`."""

from __future__ import annotations

from collections.abc import Generator, Iterator
from typing import Any

from ..types import (
    ChatMessage,
    Delta,
    Embedded,
    EmbedSpec,
    ErrorEvent,
    Event,
    Request,
    SamplingParams,
)


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

    def embed(self, texts: str | list[str], dimensions: int | None = None
              ) -> list[list[float]]:
        """The embedding of each text (pooled as the model declares; cut to `dimensions`), in
        order. Every text is submitted before any is read, so their prefills batch."""
        items = [texts] if isinstance(texts, str) else list(texts)
        streams: list[Iterator[Event]] = []
        try:
            for text in items:
                streams.append(self.stream(Request(prompt=text, embed=EmbedSpec(dimensions))))
            out: list[list[float]] = []
            for events in streams:
                for ev in events:
                    if isinstance(ev, ErrorEvent):
                        raise RuntimeError(ev.message)  # noqa: TRY004 - as complete's
                    if isinstance(ev, Embedded):
                        out.append(ev.values)
            return out
        finally:
            for events in streams:  # a refusal or an error: the others are cancelled
                if isinstance(events, Generator):  # Engine's and Pool's streams are
                    events.close()

    def _collect(self, request: Request) -> str:
        parts: list[str] = []
        for ev in self.stream(request):
            if isinstance(ev, ErrorEvent):
                raise RuntimeError(ev.message)  # noqa: TRY004 - the public contract
            if isinstance(ev, Delta) and ev.index == 0:
                parts.append(ev.text)
        return "".join(parts)
