"""Engine events -> OpenAI chunks (one code path), and the folds that make the non-streaming
answers out of those same chunks. Also the merge of several requests (completions lists)."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..text.reasoning import ReasoningSplitter
from ..text.tool_calls import FORMATS, HERMES, Piece, ToolCallParser
from ..types import (
    Delta,
    ErrorEvent,
    Event,
    Finished,
    PromptLogprobs,
    Started,
    TokenLogprob,
    Usage,
)
from .trace import Trace

_LOGPROB_FLOOR = -9999.0  # OpenAI's stand-in for -inf (JSON has no infinity)
_FINISH = {"stop": "stop", "length": "length", "cancelled": "stop", "error": "stop"}


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

    def usage(self) -> dict[str, Any]:
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


def _lp(value: float) -> float:
    return max(_LOGPROB_FLOOR, value)


def chat_logprobs(info: StreamInfo, lps: list[TokenLogprob]) -> list[dict[str, Any]]:
    return [{"token": lp.token, "logprob": _lp(lp.logprob),
             "bytes": lp.bytes if lp.bytes is not None else info.bytes_of(lp.token_id, lp.token),
             "top_logprobs": [{"token": t, "logprob": _lp(v), "bytes": info.bytes_of(i, t)}
                              for i, t, v in lp.top]}
            for lp in lps]


# ----------------------------------------------------------------------------- chat


async def chat_chunks(events: AsyncIterator[Event], first: Event, info: StreamInfo, n: int,
                      tools: set[str] | None = None, parallel_tool_calls: bool = True,
                      ) -> AsyncIterator[dict[str, Any]]:
    """`chat.completion.chunk` dicts for one request; the last one (choices=[]) has the usage.
    Raises StreamFailed on an ErrorEvent. Closing this closes `events` (aborting the request)."""
    base = {"id": info.id, "object": "chat.completion.chunk", "created": info.created,
            "model": info.model, "system_fingerprint": None}
    opened = [False] * n
    parsers: list[ToolCallParser] | None = None
    thoughts: list[ReasoningSplitter] | None = None
    trace = info.trace

    def chunk(index: int, delta: dict[str, Any], logprobs: Any = None,
              finish: str | None = None) -> dict[str, Any]:
        return {**base, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                     "finish_reason": finish}]}

    def role(index: int) -> dict[str, Any]:
        opened[index] = True
        return chunk(index, {"role": "assistant", "content": ""})

    def text_out(index: int, text: str, lps: Any = None, final: bool = False
                 ) -> list[dict[str, Any]]:
        """Chunks for new model text: its thought (reasoning_content, and vLLM's name
        reasoning), then its answer, read for tool calls when the request has tools."""
        out = []
        if thoughts:
            thought, text = thoughts[index].finish() if final else thoughts[index].feed(text)
            if thought:
                out.append(chunk(index, {"reasoning_content": thought, "reasoning": thought}))
        if parsers:
            pieces = parsers[index].feed(text) if text else []
            if final:
                pieces += parsers[index].finish()
            return out + pieces_out(index, pieces, lps)
        if text or lps:
            trace.text(index, text)
            out.append(chunk(index, {"content": text}, lps))
        return out

    def pieces_out(index: int, pieces: list[Piece], lps: Any = None
                   ) -> list[dict[str, Any]]:
        text = "".join(p.text for p in pieces if p.kind == "content")
        out = [chunk(index, {"content": text}, lps)] if text or lps else []
        if text:
            trace.text(index, text)
        for p in pieces:
            if p.kind == "start":
                out.append(chunk(index, {"tool_calls": [{
                    "index": p.index, "id": p.call_id, "type": "function",
                    "function": {"name": p.name, "arguments": ""}}]}))
            elif p.kind == "args":
                out.append(chunk(index, {"tool_calls": [{
                    "index": p.index, "function": {"arguments": p.text}}]}))
        return out

    try:
        ev: Event | None = first
        while ev is not None:
            if isinstance(ev, Started):
                trace.prompt_tokens = ev.prompt_tokens
                if tools and parsers is None:
                    fmt = FORMATS.get(ev.tool_format or "", HERMES)
                    parsers = [fmt.parser(tools, parallel_tool_calls) for _ in range(n)]
                if ev.reasoning and thoughts is None:
                    thoughts = [ReasoningSplitter(ev.thought_open) for _ in range(n)]
                for i in range(n):
                    if not opened[i]:
                        yield role(i)
            elif isinstance(ev, Delta):
                i = ev.index
                if not opened[i]:
                    yield role(i)
                trace.token(i, len(ev.token_ids))
                lps = {"content": chat_logprobs(info, ev.logprobs)} if ev.logprobs else None
                for c in text_out(i, ev.text, lps):
                    yield c
            elif isinstance(ev, Finished):
                i = ev.index
                if not opened[i]:
                    yield role(i)
                reason = _FINISH.get(ev.reason, "stop")
                for c in text_out(i, "", final=True):
                    yield c
                if parsers and parsers[i].calls and reason == "stop":
                    reason = "tool_calls"
                trace.finish_reasons.append(reason)
                info.record_usage(0, ev.usage)
                yield chunk(i, {}, None, reason)
            elif isinstance(ev, ErrorEvent):
                trace.error = ev.kind
                raise StreamFailed(ev)
            ev = await anext(events, None)
        yield {**base, "choices": [], "usage": info.usage()}
    finally:
        await events.aclose()  # type: ignore[attr-defined]


async def fold_chat(chunks: AsyncIterator[dict[str, Any]]) -> dict[str, Any]:
    """The non-streaming `chat.completion` built from the stream's chunks."""
    head: dict[str, Any] = {}
    choices: dict[int, dict[str, Any]] = {}
    usage = None
    async for c in chunks:
        head = head or c
        if not c["choices"]:
            usage = c.get("usage")
        for ch in c["choices"]:
            st = choices.setdefault(ch["index"], {"text": [], "calls": {}, "lps": None,
                                                  "finish": None, "thought": None})
            d = ch["delta"]
            if d.get("content"):
                st["text"].append(d["content"])
            if d.get("reasoning_content"):
                st["thought"] = (st["thought"] or "") + d["reasoning_content"]
            for call in d.get("tool_calls") or ():
                if call["index"] not in st["calls"]:
                    st["calls"][call["index"]] = {"id": call["id"], "type": "function",
                                                  "function": {"name": call["function"]["name"],
                                                               "arguments": ""}}
                st["calls"][call["index"]]["function"]["arguments"] += \
                    call["function"].get("arguments", "")
            if ch.get("logprobs"):
                st["lps"] = (st["lps"] or []) + ch["logprobs"]["content"]
            if ch.get("finish_reason"):
                st["finish"] = ch["finish_reason"]
    out_choices = []
    for i in sorted(choices):
        st = choices[i]
        content = "".join(st["text"])
        msg: dict[str, Any] = {"role": "assistant",
                               "content": content if content or not st["calls"] else None,
                               "refusal": None}
        if st["thought"] is not None:
            msg["reasoning_content"] = msg["reasoning"] = st["thought"]
        if st["calls"]:
            msg["tool_calls"] = [st["calls"][k] for k in sorted(st["calls"])]
        out_choices.append({"index": i, "message": msg,
                            "logprobs": None if st["lps"] is None else {"content": st["lps"]},
                            "finish_reason": st["finish"]})
    return {"id": head.get("id"), "object": "chat.completion", "created": head.get("created"),
            "model": head.get("model"), "system_fingerprint": None, "choices": out_choices,
            "usage": usage}


# ----------------------------------------------------------------------------- completions


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
                            ) -> AsyncIterator[dict[str, Any]]:
    """`text_completion` chunk dicts; choice index = prompt index * n + choice.
    `echo` holds each prompt's text to send first; with `logprobs` it goes out with the
    prompt's log-probabilities (the first token's null, as OpenAI did), once the engine has
    them. The last chunk (choices=[]) has the usage."""
    base = {"id": info.id, "object": "text_completion", "created": info.created,
            "model": info.model, "system_fingerprint": None}
    offsets: dict[int, int] = {}
    first_tokens: dict[int, list[int]] = {}  # each prompt's first token id
    trace = info.trace

    def chunk(index: int, text: str, lps: Any = None, finish: str | None = None
              ) -> dict[str, Any]:
        return {**base, "choices": [{"index": index, "text": text, "logprobs": lps,
                                     "finish_reason": finish}]}

    def legacy(index: int, items: list[TokenLogprob], first: str | None = None
               ) -> dict[str, Any]:
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
            out["token_logprobs"].append(_lp(lp.logprob))
            top = {t: _lp(v) for _, t, v in lp.top}
            top.setdefault(lp.token, _lp(lp.logprob))
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
                reason = _FINISH.get(ev.reason, "stop")
                trace.finish_reasons.append(reason)
                info.record_usage(k, ev.usage)
                yield chunk(k * n + ev.index, "", None, reason)
            elif isinstance(ev, ErrorEvent):
                trace.error = ev.kind
                raise StreamFailed(ev)
        yield {**base, "choices": [], "usage": info.usage()}
    finally:
        await events.aclose()  # type: ignore[attr-defined]


async def fold_completion(chunks: AsyncIterator[dict[str, Any]]) -> dict[str, Any]:
    """The non-streaming `text_completion` built from the stream's chunks."""
    head: dict[str, Any] = {}
    choices: dict[int, dict[str, Any]] = {}
    usage = None
    async for c in chunks:
        head = head or c
        if not c["choices"]:
            usage = c.get("usage")
        for ch in c["choices"]:
            st = choices.setdefault(ch["index"], {"text": [], "lps": None, "finish": None})
            st["text"].append(ch["text"])
            if ch.get("logprobs"):
                if st["lps"] is None:
                    st["lps"] = {k: [] for k in ch["logprobs"]}
                for key, vals in ch["logprobs"].items():
                    st["lps"][key].extend(vals)
            if ch.get("finish_reason"):
                st["finish"] = ch["finish_reason"]
    return {"id": head.get("id"), "object": "text_completion", "created": head.get("created"),
            "model": head.get("model"), "system_fingerprint": None,
            "choices": [{"index": i, "text": "".join(choices[i]["text"]),
                         "logprobs": choices[i]["lps"], "finish_reason": choices[i]["finish"]}
                        for i in sorted(choices)],
            "usage": usage}
