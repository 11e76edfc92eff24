"""POST /v1/completions (the legacy text API): the body's schema and its conversion to one
`Request` per prompt, the merge of those requests' events, the events as `text_completion`
chunks (one code path), the fold of those same chunks into the non-streaming answer, and the
route.

A list of prompts answers once any prompt has its first event: the others may still wait for
a slot, and one refused after the stream started ends it with an error event.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import replace
from typing import Any

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import Response

from ..types import (
    Delta,
    ErrorEvent,
    Event,
    Finished,
    InvalidRequestError,
    PromptLogprobs,
    Request,
    Started,
    TokenLogprob,
)
from .errors import APIError, error_event_to_api
from .fields import unsupported as _refuse
from .handler import CLIENT_GONE, RouteContext, answer, sse_chunks, unless_disconnected
from .limits import Limits
from .openapi_schemas import body_ref
from .protocol import PromptInput, _Sampling, prompt_list
from .streams import (
    FINISH_REASONS,
    JSONBody,
    StreamFailed,
    StreamInfo,
    clamp_logprob,
    fold_chunks,
)


class CompletionRequest(_Sampling):
    """POST /v1/completions (the legacy text API)."""

    prompt: PromptInput
    best_of: int | None = None
    echo: bool | None = False
    logprobs: int | None = None
    max_tokens: int | None = 16
    suffix: str | None = None

    def prompts(self, limits: Limits) -> list[str | list[int]]:
        """The prompt as a list: one string or token-id list per prompt."""
        return prompt_list(self.prompt, "prompt", limits.max_prompts, limits)

    def to_requests(self, limits: Limits | None = None, request_id: str = "cmpl"
                    ) -> list[Request]:
        """One Request per prompt, ids `{request_id}-{i}` when there are several."""
        limits = limits or Limits()
        if self.suffix:
            raise _refuse("suffix", "insertion (fill-in-the-middle) is not implemented")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise _refuse("best_of", "ranking several samples is not implemented; use n")
        if self.logprobs is not None:
            limits.check_range("logprobs", self.logprobs, 0, 5)
        scored = bool(self.echo) and self.logprobs is not None  # the prompt's logprobs too
        if self.max_tokens == 0 and not scored:
            raise InvalidRequestError("max_tokens 0 only scores a prompt: send it with echo "
                                      "and logprobs", param="max_tokens")
        items = self.prompts(limits)
        max_tokens = self.max_tokens if self.max_tokens is not None else 16
        params = self._params(limits, max_tokens or None, "max_tokens",
                              self.logprobs is not None, self.logprobs or 0)
        if scored:
            params.prompt_logprobs = self.logprobs
            params.max_tokens = max_tokens
            params.validate()
        out = []
        for i, item in enumerate(items):
            rid = request_id if len(items) == 1 else f"{request_id}-{i}"
            p = replace(params, stop=list(params.stop))
            if isinstance(item, str):
                r = Request(prompt=item, params=p, request_id=rid)
            else:
                r = Request(prompt_ids=list(item), params=p, request_id=rid)
            if self.user:
                r.metadata["user"] = self.user
            out.append(r)
        return out

    def to_request(self, limits: Limits | None = None, request_id: str = "cmpl") -> Request:
        """The Request for a single prompt (see `to_requests` for lists)."""
        reqs = self.to_requests(limits, request_id)
        if len(reqs) != 1:
            raise InvalidRequestError("to_request() needs a single prompt; use to_requests()",
                                      param="prompt")
        return reqs[0]


# ----------------------------------------------------------------------------- events and chunks


class Merge:
    """The events of several requests (a completions list) as one stream of (request index,
    event), in arrival order.

    A task per request reads its events but holds at most one that the consumer has not taken:
    the rest wait in the backend, whose `max_backlog` still cancels the request of a client
    that stops reading. The consumer takes events as they come, so the requests that have a
    slot stream while the others wait for one. `first()` waits until some request has an
    event and raises the refusal of any request refused so far (an exception, or an
    ErrorEvent before any other event), while the response has not started. `aclose()`
    closes every request; it is idempotent.
    """

    def __init__(self, streams: Sequence[AsyncIterator[Event]]):
        self._ready: deque[tuple[int, Any]] = deque()  # (request, event | exception | _END)
        self._wake = asyncio.Event()
        self._taken = [asyncio.Event() for _ in streams]
        self._live = len(streams)
        # Each task submits its request in its first step: with a backend that submits before
        # its first await (Engine, Pool), every request is submitted, or refused, before any
        # event can arrive from the engine thread.
        self._tasks = [asyncio.ensure_future(self._pump(k, s)) for k, s in enumerate(streams)]

    async def _pump(self, k: int, stream: AsyncIterator[Event]) -> None:
        try:
            async for ev in stream:
                taken = self._taken[k]
                taken.clear()
                self._put(k, ev)
                await taken.wait()
        except Exception as exc:  # noqa: BLE001 - raised by the consumer
            self._put(k, exc)
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
            self._put(k, _END)

    def _put(self, k: int, item: Any) -> None:
        self._ready.append((k, item))
        self._wake.set()

    async def _wait(self) -> None:
        while not self._ready:
            self._wake.clear()
            await self._wake.wait()

    async def first(self) -> None:
        """Wait until some request has an event (or ended); raise the first refusal seen:
        the request's exception, or StreamFailed for an ErrorEvent (or for a request that
        ended without any event). Nothing is taken: the events stay in order."""
        await self._wait()
        for _, item in self._ready:  # nothing was taken yet: each is its request's first
            if isinstance(item, Exception):
                raise item
            if isinstance(item, ErrorEvent):
                raise StreamFailed(item)
            if item is _END:
                raise StreamFailed(ErrorEvent("the backend ended the request without any "
                                              "event"))

    async def events(self) -> AsyncIterator[tuple[int, Event]]:
        """(request index, event) until every request has ended; raises a request's exception.
        Closing it closes every request."""
        try:
            while self._live:
                await self._wait()
                k, item = self._ready.popleft()
                if item is _END:
                    self._live -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    self._taken[k].set()
                    yield k, item
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


_END = object()  # a Merge request's stream has ended


async def completion_chunks(events: AsyncIterator[tuple[int, Event]], info: StreamInfo, n: int,
                            echo: list[str] | None = None, logprobs: bool = False
                            ) -> AsyncGenerator[JSONBody, None]:
    """`text_completion` chunk dicts; choice index = prompt index * n + choice.
    `echo` holds each prompt's text to send first; with `logprobs` it goes out with the
    prompt's log-probabilities (the first token's null, as OpenAI did), once the engine has
    them. The last chunk (choices=[]) has the usage."""
    base = {"id": info.id, "object": "text_completion", "created": info.created,
            "model": info.model, "system_fingerprint": None}
    offsets: dict[int, int] = {}
    first_tokens: dict[int, list[int]] = {}  # each prompt's first token id
    trace = info.trace

    def chunk(index: int, text: str, lps: JSONBody | None = None, finish: str | None = None
              ) -> JSONBody:
        return {**base, "choices": [{"index": index, "text": text, "logprobs": lps,
                                     "finish_reason": finish}]}

    def legacy(index: int, items: list[TokenLogprob], first: str | None = None
               ) -> JSONBody:
        """OpenAI's legacy logprobs of `items`; `first`: the text of a prompt's first token,
        whose logprob is null."""
        out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                     "text_offset": []}
        if first is not None:
            out["tokens"].append(first)
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            out["text_offset"].append(offsets.get(index, 0))
            offsets[index] = offsets.get(index, 0) + len(first)
        for lp in items:
            out["tokens"].append(lp.token)
            out["token_logprobs"].append(clamp_logprob(lp.logprob))
            top = {t: clamp_logprob(v) for _, t, v in lp.top}
            top.setdefault(lp.token, clamp_logprob(lp.logprob))
            out["top_logprobs"].append(top)
            out["text_offset"].append(offsets.get(index, 0))
            offsets[index] = offsets.get(index, 0) + len(lp.token)
        return out

    try:
        async for k, ev in events:
            if isinstance(ev, Started):
                trace.prompt_tokens += ev.prompt_tokens
                first_tokens[k] = ev.prompt_ids[:1]
                if echo is not None and not logprobs:
                    for j in range(n):
                        offsets[k * n + j] = len(echo[k])
                        yield chunk(k * n + j, echo[k])
            elif isinstance(ev, PromptLogprobs):
                if echo is not None:
                    head = info.decode(first_tokens.get(k, []))
                    scored = [lp for lp in ev.logprobs if lp is not None]
                    for j in range(n):
                        yield chunk(k * n + j, echo[k], legacy(k * n + j, scored, head))
            elif isinstance(ev, Delta):
                i = k * n + ev.index
                trace.token(i, len(ev.token_ids))
                lps = legacy(i, ev.logprobs) if logprobs and ev.logprobs else None
                if ev.text or lps:
                    trace.text(i, ev.text)
                    yield chunk(i, ev.text, lps)
            elif isinstance(ev, Finished):
                reason = FINISH_REASONS.get(ev.reason, "stop")
                trace.finish_reasons.append(reason)
                info.record_usage(k, ev.usage)
                yield chunk(k * n + ev.index, "", None, reason)
            elif isinstance(ev, ErrorEvent):
                trace.error = ev.kind
                raise StreamFailed(ev)
        yield {**base, "choices": [], "usage": info.usage()}
    finally:
        await events.aclose()  # type: ignore[attr-defined]


async def fold_completion(chunks: AsyncIterator[JSONBody]) -> JSONBody:
    """The non-streaming `text_completion` built from the stream's chunks."""
    folded = await fold_chunks(chunks, lambda: {"text": [], "lps": None}, _add_completion_chunk)
    return folded.answer("text_completion", [
        {"index": i, "text": "".join(st["text"]), "logprobs": st["lps"],
         "finish_reason": st["finish"]} for i, st in sorted(folded.choices.items())])


def _add_completion_chunk(st: JSONBody, ch: JSONBody) -> None:
    """One choice's chunk into its folded state: its text and logprobs."""
    st["text"].append(ch["text"])
    if ch.get("logprobs"):
        if st["lps"] is None:
            st["lps"] = {k: [] for k in ch["logprobs"]}
        for key, vals in ch["logprobs"].items():
            st["lps"][key].extend(vals)


async def first_of_merged(merged: Merge, request_id: str) -> bool:
    """Wait for the first event of any request in `merged`; a request refused so far (bad
    input, busy queue, queue timeout, shutdown) becomes its HTTP error. Returns True."""
    try:
        await merged.first()
    except StreamFailed as exc:
        raise error_event_to_api(exc.event.message, exc.event.kind, request_id) from None
    return True


# ----------------------------------------------------------------------------- the route


def router(base: RouteContext) -> APIRouter:
    """POST /v1/completions: streamed as SSE chunks, or folded into one answer."""
    r = APIRouter(prefix="/v1")

    @r.post("/completions", openapi_extra=body_ref(CompletionRequest))
    async def completions(request: HTTPRequest) -> Response:
        body, rid, ctx = await base.parse(request, CompletionRequest)
        reqs = body.to_requests(ctx.limits, request_id=rid)
        echo = None
        if body.echo:
            echo = [r.prompt if r.prompt is not None else _decode(ctx, r.prompt_ids)
                    for r in reqs]
        merged = Merge([ctx.backend.generate(r) for r in reqs])
        started = None
        try:
            started = await unless_disconnected(request, first_of_merged(merged, rid))
        finally:
            if started is None:  # refused, or the client left
                await merged.aclose()
        if started is None:
            return Response(status_code=CLIENT_GONE)
        trace = ctx.begin(request, rid, [r.prompt or r.prompt_ids for r in reqs])
        info = StreamInfo(f"cmpl-{rid}", ctx.backend.model_name, int(time.time()), trace,
                          ctx.token_bytes, ctx.detokenize)
        chunks = completion_chunks(merged.events(), info, reqs[0].params.n, echo,
                                   body.logprobs is not None)
        return await answer(request, rid, trace, bool(body.stream),
                            lambda: sse_chunks(chunks, body.include_usage, trace, rid),
                            lambda: fold_completion(chunks), merged.aclose)

    return r


def _decode(ctx: RouteContext, ids: list[int] | None) -> str:
    """The text of a token-id prompt to echo; ids outside the vocabulary are the 400 the
    engine gives them (checked here: decoding them first would fail)."""
    tokenizer = ctx.backend.tokenizer
    if tokenizer is None:
        raise APIError(400, "echo with a token-id prompt needs a backend with a tokenizer",
                       param="echo")
    vocab = ctx.backend.vocab_size or tokenizer.vocab_size
    bad = [t for t in ids or [] if not 0 <= t < vocab]
    if bad:
        raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab}), got "
                                  f"{bad[0]}", param="prompt")
    return tokenizer.decode(ids or [])
