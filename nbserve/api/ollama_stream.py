"""Ollama's answers as newline-delimited JSON: the engine's events read through the chat
stream's own machinery (`chat.chat_chunks`: the thought split off, tool calls parsed), each
chunk as Ollama's record (`message` for /api/chat, `response` for /api/generate), then the
final record with its counts and durations measured as the events arrived; the fold of the
same records into the non-streaming answer; the NDJSON response.

Durations (nanoseconds, Ollama's unit): `load_duration` from the HTTP request's arrival to
the engine's Started (the model is resident: this is parsing and waiting for a slot),
`prompt_eval_duration` from there to the first token (the prefill), `eval_duration` from the
first token to the Finished event, `total_duration` from arrival to the final record."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Literal

from fastapi.responses import JSONResponse, Response

from ..types import Delta, Event, Finished, JSONObject, Started
from .chat import add_tool_call_piece
from .errors import APIError
from .handler import SSEResponse, guarded_frames
from .streams import JSONBody
from .trace import Trace

Shape = Literal["chat", "generate"]


class NDJSONResponse(SSEResponse):
    """Ollama's stream: one JSON object per line (closed like the SSE streams)."""

    media_type = "application/x-ndjson"


def ndjson_line(obj: JSONBody) -> bytes:
    """One record as a line (JSON escapes every line break inside it)."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


def one_record(rec: JSONBody, stream: bool, rid: str) -> Response:
    """An answer of one record: a one-line stream, or the record as JSON."""
    if not stream:
        return JSONResponse(rec, headers={"X-Request-ID": rid})

    async def line() -> AsyncGenerator[bytes, None]:
        yield ndjson_line(rec)

    return NDJSONResponse(line(), rid=rid)


def error_record(err: APIError, request_id: str = "") -> JSONObject:
    """Ollama's error body, `{"error": message}`: the route family's error shape under /api/
    (its status and headers are the error's own), also the last line of a stream that
    fails."""
    return {"error": err.message}


def created_at() -> str:
    """Ollama's timestamp: RFC 3339 in UTC."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _ns(seconds: float) -> int:
    return max(0, round(seconds * 1e9))


@dataclass(slots=True)
class Timings:
    """When a request's events arrived (perf_counter seconds), and the tokens they held."""

    arrived: float  # the HTTP request (the middleware's clock)
    started: float  # the engine's Started event: the request holds a slot
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    first_token: float | None = None
    finished: float | None = None

    @classmethod
    def of(cls, trace: Trace, first: Event) -> Timings:
        """The timings of a request whose first event `first` arrived just now."""
        return cls(trace.start, time.perf_counter(),
                   list(first.prompt_ids) if isinstance(first, Started) else [])

    async def watch(self, events: AsyncGenerator[Event, None]) -> AsyncGenerator[Event, None]:
        """`events` passed on, their times and token ids noted; closing this closes them."""
        try:
            async for ev in events:
                if isinstance(ev, Delta) and ev.token_ids:
                    if self.first_token is None:
                        self.first_token = time.perf_counter()
                    self.output_ids.extend(ev.token_ids)
                elif isinstance(ev, Finished):
                    self.finished = time.perf_counter()
                yield ev
        finally:
            await events.aclose()

    def durations(self) -> JSONBody:
        """Ollama's four durations, in nanoseconds, as of now."""
        now = time.perf_counter()
        finished = self.finished or now
        first = self.first_token or finished
        return {"total_duration": _ns(now - self.arrived),
                "load_duration": _ns(self.started - self.arrived),
                "prompt_eval_duration": _ns(first - self.started),
                "eval_duration": _ns(finished - first)}


@dataclass(slots=True)
class RecordMaker:
    """Ollama's records of one answer: what every record carries, and where its text goes."""

    shape: Shape
    model: str
    timings: Timings
    context: bool = False  # the final record holds the token ids (/api/generate)

    def piece(self, content: str = "", thinking: str = "",
              tool_calls: list[JSONBody] | None = None, done: bool = False) -> JSONBody:
        rec: JSONBody = {"model": self.model, "created_at": created_at()}
        if self.shape == "chat":
            msg: JSONBody = {"role": "assistant", "content": content}
            if thinking:
                msg["thinking"] = thinking
            if tool_calls:
                msg["tool_calls"] = tool_calls
            rec["message"] = msg
        else:
            rec["response"] = content
            if thinking:
                rec["thinking"] = thinking
        rec["done"] = done
        return rec

    def final(self, reason: str, usage: JSONBody | None) -> JSONBody:
        rec = self.piece(done=True)
        rec["done_reason"] = reason
        if self.context:
            rec["context"] = self.timings.prompt_ids + self.timings.output_ids
        rec.update(self.timings.durations())
        rec["prompt_eval_count"] = (usage or {}).get("prompt_tokens", 0)
        rec["eval_count"] = (usage or {}).get("completion_tokens", 0)
        return rec

    def load(self) -> JSONBody:
        """The answer to a request with nothing to generate: Ollama's "load" record."""
        rec = self.piece(done=True)
        rec["done_reason"] = "load"
        return rec


def _call(index: int, call: JSONBody) -> JSONBody | None:
    """An OpenAI tool call (arguments as JSON text) as Ollama's (an object); None when the
    arguments are not a whole object (a call cut by the token limit)."""
    try:
        args = json.loads(call["function"]["arguments"] or "{}")
    except ValueError:
        return None
    if not isinstance(args, dict):
        return None
    return {"id": call["id"], "function": {"index": index,
                                           "name": call["function"]["name"],
                                           "arguments": args}}


async def ollama_records(chunks: AsyncGenerator[JSONBody, None], maker: RecordMaker
                         ) -> AsyncGenerator[JSONBody, None]:
    """Ollama's records of one answer from its chat chunks: thought and text as they come,
    the tool calls once whole (one record, before the last), then the final record."""
    calls: dict[int, JSONBody] = {}
    finish, usage = "stop", None
    try:
        async for c in chunks:
            if not c["choices"]:
                usage = c.get("usage")
                continue
            ch = c["choices"][0]
            d = ch["delta"]
            if d.get("reasoning_content") or d.get("content"):
                yield maker.piece(d.get("content") or "", d.get("reasoning_content") or "")
            for call in d.get("tool_calls") or ():
                add_tool_call_piece(calls, call)
            if ch.get("finish_reason"):
                finish = "length" if ch["finish_reason"] == "length" else "stop"
        whole = [_call(k, calls[k]) for k in sorted(calls)]
        if calls:
            done = [c for c in whole if c is not None]
            cut = [calls[k]["function"]["arguments"] for k, c in zip(sorted(calls), whole)
                   if c is None]
            yield maker.piece("".join(cut), tool_calls=done or None)
        yield maker.final(finish, usage)
    finally:
        await chunks.aclose()


async def ndjson_frames(records: AsyncGenerator[JSONBody, None], trace: Trace, rid: str
                        ) -> AsyncGenerator[bytes, None]:
    """The records as NDJSON lines; a failure after the start ends the stream with Ollama's
    `{"error": ...}` line (the `ollama` client raises it as a ResponseError)."""
    async with contextlib.aclosing(guarded_frames(records, ndjson_line, error_record, trace,
                                                  rid)) as frames:
        async for f in frames:
            yield f


async def fold_records(records: AsyncIterator[JSONBody], shape: Shape) -> JSONBody:
    """The non-streaming answer: the final record with all the text, thought and calls."""
    text: list[str] = []
    thought: list[str] = []
    calls: list[JSONBody] = []
    last: JSONBody = {}
    async for rec in records:
        part = rec["message"] if shape == "chat" else rec
        text.append(part.get("content" if shape == "chat" else "response") or "")
        thought.append(part.get("thinking") or "")
        calls.extend(part.get("tool_calls") or ())
        last = rec
    out = dict(last)
    if shape == "chat":
        msg: JSONBody = {"role": "assistant", "content": "".join(text)}
        if any(thought):
            msg["thinking"] = "".join(thought)
        if calls:
            msg["tool_calls"] = calls
        out["message"] = msg
    else:
        out["response"] = "".join(text)
        if any(thought):
            out["thinking"] = "".join(thought)
    return out
