"""The chat UI's side-by-side mode: one prompt to two models of the server at once, both
answers streaming next to each other, each with its token count and speed.

It talks to the backends (`ModelDirectory`), as the chat does, never to the HTTP layer; its
turns obey the same limits and rate limit as the chat's (each side counts as one request).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field

import gradio as gr

from ..api.auth import RateLimiter
from ..api.errors import APIError
from ..api.limits import Limits
from ..types import (
    Backend,
    Delta,
    ErrorEvent,
    Finished,
    ModelDirectory,
    NbserveError,
    Request,
    SamplingParams,
)
from .ui_settings import chat_params

UPDATE_EVERY = 0.2  # seconds between redraws while the answers stream


@dataclass(slots=True)
class Side:
    """One side's answer so far and its speed line."""

    model: str
    text: str = ""
    tokens: int = 0
    start: float = field(default_factory=time.perf_counter)
    first: float | None = None
    end: float | None = None
    reason: str = ""
    error: str = ""

    def line(self) -> str:
        """`model: N tokens in S s, X tokens/s (first token after F s)`, or where it stands."""
        if self.error:
            return f"**{self.model}**: failed ({self.error})"
        now = self.end or time.perf_counter()
        elapsed = max(now - self.start, 1e-9)
        state = "" if self.end else " (answering)"
        line = (f"**{self.model}**{state}: {self.tokens} tokens in {elapsed:.2f} s, "
                f"**{self.tokens / elapsed:.1f} tokens/s**")
        if self.first is not None:
            line += f", first token after {self.first - self.start:.2f} s"
        if self.reason and self.reason != "stop":
            line += f", ended by {self.reason}"
        return line


async def _answer(backend: Backend, side: Side, request: Request) -> None:
    """Stream `request` from `backend` into `side` (closing the stream however it ends)."""
    stream = backend.generate(request)
    try:
        async for ev in stream:
            if isinstance(ev, Delta) and ev.index == 0:
                side.first = side.first or time.perf_counter()
                side.text += ev.text
                side.tokens += len(ev.token_ids)
            elif isinstance(ev, Finished) and ev.index == 0:
                side.reason = ev.reason
                side.tokens = ev.usage.completion_tokens or side.tokens
            elif isinstance(ev, ErrorEvent):
                side.error = ev.message
    except (NbserveError, APIError) as exc:
        side.error = str(exc)
    finally:
        side.end = time.perf_counter()
        if isinstance(stream, AsyncGenerator):
            await stream.aclose()


Frame = tuple[str, str, str, str]  # answer A, answer B, line A, line B


def make_compare_fn(models: ModelDirectory, *, limits: Limits | None = None,
                    rate_limiter: RateLimiter | None = None,
                    client_of: Callable[[object], str] | None = None
                    ) -> Callable[..., AsyncIterator[Frame]]:
    """The async generator the Compare tab calls: (prompt, model A, model B, temperature,
    max tokens) -> frames of both answers and their speed lines while they stream."""
    limits = limits or Limits()

    async def compare(prompt: str, model_a: str, model_b: str, temperature: float = 0.0,
                      max_tokens: float = 256, request: gr.Request | None = None
                      ) -> AsyncIterator[Frame]:
        sides = [Side(model_a or "default"), Side(model_b or "default")]
        tasks: list[asyncio.Task[None]] = []
        try:
            if not prompt or not prompt.strip():
                raise NbserveError("type a prompt to send to both models")
            limits.check_text("prompt", len(prompt), limits.max_message_chars, "The prompt")
            params = chat_params(limits, temperature, 1.0, max_tokens)
            backends = []
            for name in (model_a, model_b):
                if rate_limiter is not None:
                    rate_limiter.check(client_of(request) if client_of else "ui")
                backends.append(await models.backend(name))
            for backend, side in zip(backends, sides, strict=True):
                req = Request(messages=[{"role": "user", "content": prompt}],
                              params=_copy(params), metadata={"source": "ui-compare"})
                tasks.append(asyncio.ensure_future(_answer(backend, side, req)))
            while not all(t.done() for t in tasks):
                await asyncio.wait(tasks, timeout=UPDATE_EVERY)
                yield _frame(sides)
            for t in tasks:
                t.result()  # a bug in one side: raise it
            yield _frame(sides)
        except (NbserveError, APIError) as exc:
            for side in sides:
                side.error = side.error or str(exc)
            yield _frame(sides)
        finally:
            for t in tasks:
                t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(*tasks, return_exceptions=True)

    return compare


def _copy(params: SamplingParams) -> SamplingParams:
    return dataclasses.replace(params)  # each side's own (a sampler keeps state in it)


def _frame(sides: list[Side]) -> Frame:
    a, b = sides
    return a.text, b.text, a.line(), b.line()
