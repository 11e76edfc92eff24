"""Engine events -> Anthropic's Messages event sequence (one code path, streamed or not):
`message_start` and a `ping`, then per content block `content_block_start`, its
`content_block_delta`s (`thinking_delta` then a `signature_delta`, `text_delta`,
`input_json_delta`) and `content_block_stop`, last `message_delta` (stop_reason,
stop_sequence, usage) and `message_stop`; an engine error is an `error` event instead. The
thought (text/reasoning.py's splitter) is a thinking block, the answer a text block, each tool
call (text/tool_calls.py's parser, in the model's own format) a tool_use block. The
non-streamed answer is the fold of the same events (`MessageBuilder.fold`)."""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from ..text.answer_split import AnswerSplit
from ..types import Delta, ErrorEvent, Event, Finished, Started, Usage
from .anthropic_errors import anthropic_error_shape
from .errors import APIError, error_event_to_api
from .streams import JSONBody
from .trace import Trace

NamedEvent = tuple[str, JSONBody]
# The finish reason the request log and metrics count for each stop_reason (chat's names, so
# that one counter reads the same whatever API asked).
TRACE_REASONS = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length",
                 "tool_use": "tool_calls"}


def signature(thought: str) -> str:
    """A thinking block's `signature`: a digest of its thought (nbserve signs nothing; a
    signature sent back is not checked)."""
    return "nbserve-" + hashlib.sha256(thought.encode()).hexdigest()[:32]


def _usage(u: Usage, output_tokens: int) -> JSONBody:
    """Anthropic's usage: input_tokens are the prompt's tokens not read from the prefix cache
    (those are cache_read_input_tokens), as Anthropic counts them."""
    return {"input_tokens": u.prompt_tokens - u.cached_tokens, "output_tokens": output_tokens,
            "cache_read_input_tokens": u.cached_tokens, "cache_creation_input_tokens": 0}


class MessageBuilder:
    """Builds one message from the events of its request: `events()` yields (name, data)."""

    def __init__(self, message_id: str, model: str, trace: Trace, stop: list[str],
                 tool_names: set[str] | None, parallel: bool, request_id: str):
        self.trace, self.stop, self.request_id = trace, stop, request_id
        self.tool_names, self.parallel = tool_names, parallel
        self.message: JSONBody = {
            "id": message_id, "type": "message", "role": "assistant", "model": model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": _usage(Usage(), 0)}
        self.error: APIError | None = None  # what ended the request, if it failed
        self._split = AnswerSplit(False, False, None, None)  # Started gives the model's own
        self._open: JSONBody | None = None  # the open content block
        self._blocks = 0  # content blocks started
        self._call_blocks: dict[int, int] = {}  # the parser's call index -> its block index
        self._pending: list[NamedEvent] = []

    # -- events

    def _emit(self, name: str, **data: Any) -> None:
        self._pending.append((name, {"type": name, **data}))

    def _start(self, block: JSONBody) -> int:
        self._stop()
        index = self._blocks
        self._blocks += 1
        self._open = {"index": index, "type": block["type"], "text": ""}
        self._emit("content_block_start", index=index, content_block=block)
        return index

    def _stop(self) -> None:
        block, self._open = self._open, None
        if block is None:
            return
        if block["type"] == "thinking":
            self._emit("content_block_delta", index=block["index"], delta={
                "type": "signature_delta", "signature": signature(block["text"])})
        self._emit("content_block_stop", index=block["index"])

    def _delta(self, kind: str, text: str) -> None:
        """A text or thinking delta of the open block, opening one of `kind` if needed."""
        if self._open is None or self._open["type"] != kind:
            self._start({"type": "text", "text": ""} if kind == "text" else
                        {"type": "thinking", "thinking": "", "signature": ""})
        assert self._open is not None
        self._open["text"] += text
        key = "text" if kind == "text" else "thinking"
        self._emit("content_block_delta", index=self._open["index"],
                   delta={"type": f"{key}_delta", key: text})

    def _say(self, text: str) -> None:
        if not text or ((self._open is None or self._open["type"] != "text") and
                        not text.strip()):
            return  # no text block for mere whitespace
        self.trace.text(0, text)
        self._delta("text", text)

    def _text(self, text: str, final: bool = False) -> None:
        """New model text: thought, then answer (read for tool calls when there are tools)."""
        thought, pieces = self._split.feed(text, final)
        if thought:
            self._delta("thinking", thought)
        for p in pieces:
            if p.kind == "content":
                self._say(p.text)
            elif p.kind == "start":
                self._call_blocks[p.index] = self._start({
                    "type": "tool_use", "id": "toolu_" + p.call_id.removeprefix("call_"),
                    "name": p.name, "input": {}})
            elif p.kind == "args" and p.text:
                self._emit("content_block_delta", index=self._call_blocks[p.index],
                           delta={"type": "input_json_delta", "partial_json": p.text})

    # -- the request's events

    async def events(self, events: AsyncIterator[Event], first: Event
                     ) -> AsyncGenerator[NamedEvent, None]:
        """(event name, data) in Anthropic's order, ending with message_stop (or error)."""
        try:
            ev: Event | None = first
            while ev is not None:
                if isinstance(ev, Started):
                    self.trace.prompt_tokens = ev.prompt_tokens
                    self.trace.cached_tokens = ev.cached_tokens
                    self._split = AnswerSplit(ev.reasoning, ev.thought_open, ev.tool_format,
                                              self.tool_names, self.parallel)
                    self.message["usage"] = _usage(Usage(ev.prompt_tokens, 0, ev.cached_tokens),
                                                   0)
                    self._emit("message_start", message=copy.deepcopy(self.message))
                    self._emit("ping")
                elif isinstance(ev, Delta):
                    self.trace.token(0, len(ev.token_ids))
                    self._text(ev.text)
                elif isinstance(ev, Finished):
                    self._finish(ev)
                    ev = None
                elif isinstance(ev, ErrorEvent):
                    self.trace.error = ev.kind
                    self.error = error_event_to_api(ev.message, ev.kind, self.request_id)
                    self._pending.append(("error", anthropic_error_shape(self.error,
                                                                         self.request_id)))
                    ev = None
                for item in self._pending:
                    yield item
                self._pending = []
                if ev is not None:
                    ev = await anext(events, None)
        finally:
            await events.aclose()  # type: ignore[attr-defined]

    def _finish(self, ev: Finished) -> None:
        self._text("", final=True)
        self._stop()
        stop_sequence = ev.stop_matched if isinstance(ev.stop_matched, str) and \
            ev.stop_matched in self.stop else None
        if ev.reason == "length":
            reason = "max_tokens"
        elif stop_sequence is not None:
            reason = "stop_sequence"
        elif self._call_blocks:
            reason = "tool_use"
        else:
            reason = "end_turn"
        u = ev.usage
        self.trace.prompt_tokens, self.trace.cached_tokens = u.prompt_tokens, u.cached_tokens
        self.trace.completion_tokens = u.completion_tokens
        self.trace.finish_reasons.append(TRACE_REASONS[reason])
        self._emit("message_delta", delta={"stop_reason": reason,
                                           "stop_sequence": stop_sequence},
                   usage=_usage(u, u.completion_tokens))
        self._emit("message_stop")

    # -- the fold

    async def fold(self, events: AsyncIterator[NamedEvent]) -> JSONBody:
        """The non-streamed message: the events applied in order, as a client accumulates
        them; an `error` event raises the request's APIError."""
        message: JSONBody = {}
        partial: dict[int, str] = {}
        async for name, data in events:
            if name == "message_start":
                message = copy.deepcopy(data["message"])
            elif name == "content_block_start":
                message["content"].append(dict(data["content_block"]))
            elif name == "content_block_delta":
                index, delta = data["index"], data["delta"]
                block = message["content"][index]
                if delta["type"] == "input_json_delta":
                    partial[index] = partial.get(index, "") + delta["partial_json"]
                elif delta["type"] == "signature_delta":
                    block["signature"] = delta["signature"]
                else:
                    key = delta["type"].removesuffix("_delta")
                    block[key] += delta[key]
            elif name == "content_block_stop" and data["index"] in partial:
                message["content"][data["index"]]["input"] = _input(partial.pop(data["index"]))
            elif name == "message_delta":
                message.update(data["delta"])
                message["usage"].update(data["usage"])
            elif name == "error":
                assert self.error is not None
                raise self.error
        return message


def _input(arguments: str) -> JSONBody:
    """A tool call's streamed arguments as its `input` object ({} if max_tokens cut them)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
