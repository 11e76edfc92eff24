"""Engine events -> the Responses API's event sequence (one code path, streamed or not): the
thought as a reasoning item, the answer as a message item, each tool call as a function_call
item, each with its added / delta / done events, framed by response.created / in_progress and
one of response.completed / incomplete / failed. The non-streamed answer is the last event's
response."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from ..text.answer_split import AnswerSplit
from ..types import Delta, ErrorEvent, Event, Finished, Started
from .streams import JSONBody
from .trace import Trace


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class ResponseBuilder:
    """Builds one response from the events of its request; `events()` yields (name, data)."""

    def __init__(self, response_id: str, model: str, body: JSONBody, trace: Trace,
                 tool_names: set[str] | None, parallel: bool):
        self.trace = trace
        self.tool_names, self.parallel = tool_names, parallel
        self.seq = 0
        self.output: list[JSONBody] = []
        self.response: JSONBody = {
            "id": response_id, "object": "response", "created_at": int(time.time()),
            "status": "in_progress", "model": model, "output": self.output,
            "error": None, "incomplete_details": None, **body,
            "usage": None}
        self._split = AnswerSplit(False, False, None, None)  # Started gives the model's own
        self._reasoning: JSONBody | None = None  # the open reasoning item
        self._message: JSONBody | None = None  # the open message item
        self._call_items: dict[int, JSONBody] = {}  # open function_call items
        self._pending: list[tuple[str, JSONBody]] = []
        self.reasoning_tokens = 0  # tokens written while the thought was open

    # -- events

    def _emit(self, event: str, **data: Any) -> None:
        self._pending.append((event, {"type": event, "sequence_number": self.seq, **data}))
        self.seq += 1

    def _snapshot(self) -> JSONBody:
        return {**self.response, "output": [dict(x) for x in self.output]}

    def _open(self, item: JSONBody) -> int:
        self.output.append(item)
        index = len(self.output) - 1
        self._emit("response.output_item.added", output_index=index, item=dict(item))
        return index

    def _close(self, item: JSONBody) -> None:
        item["status"] = "completed" if self.response["status"] != "incomplete" else \
            "incomplete"
        if item["type"] == "reasoning":
            item.pop("status")
        self._emit("response.output_item.done", output_index=self.output.index(item),
                   item=dict(item))

    # -- text

    def _reason(self, text: str) -> None:
        if not text:
            return
        if self._reasoning is None:
            self._close_message()
            self._reasoning = {"type": "reasoning", "id": _id("rs"), "summary": [],
                               "content": [{"type": "reasoning_text", "text": ""}]}
            self._open(self._reasoning)
        self._reasoning["content"][0]["text"] += text
        self._emit("response.reasoning_text.delta", item_id=self._reasoning["id"],
                   output_index=self.output.index(self._reasoning), content_index=0,
                   delta=text)

    def _close_reasoning(self) -> None:
        item, self._reasoning = self._reasoning, None
        if item is not None:
            self._emit("response.reasoning_text.done", item_id=item["id"],
                       output_index=self.output.index(item), content_index=0,
                       text=item["content"][0]["text"])
            self._close(item)

    def _say(self, text: str) -> None:
        if not text or (self._message is None and not text.strip()):
            return  # no message item for mere whitespace
        self._close_reasoning()
        if self._message is None:
            self._message = {"type": "message", "id": _id("msg"), "status": "in_progress",
                             "role": "assistant", "content": []}
            index = self._open(self._message)
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self._message["content"].append(part)
            self._emit("response.content_part.added", item_id=self._message["id"],
                       output_index=index, content_index=0, part=dict(part))
        self.trace.text(0, text)
        self._message["content"][0]["text"] += text
        self._emit("response.output_text.delta", item_id=self._message["id"],
                   output_index=self.output.index(self._message), content_index=0, delta=text,
                   logprobs=[])

    def _close_message(self) -> None:
        item, self._message = self._message, None
        if item is not None:
            index = self.output.index(item)
            part = item["content"][0]
            self._emit("response.output_text.done", item_id=item["id"], output_index=index,
                       content_index=0, text=part["text"], logprobs=[])
            self._emit("response.content_part.done", item_id=item["id"], output_index=index,
                       content_index=0, part=dict(part))
            self._close(item)

    def _text(self, text: str, final: bool = False) -> None:
        """New model text: thought, then answer (read for calls when there are tools)."""
        thought, pieces = self._split.feed(text, final)
        self._reason(thought)
        for p in pieces:
            if p.kind == "content":
                self._say(p.text)
            elif p.kind == "start":
                self._close_reasoning()
                self._close_message()
                item = {"type": "function_call", "id": _id("fc"), "call_id": p.call_id,
                        "name": p.name, "arguments": "", "status": "in_progress"}
                self._call_items[p.index] = item
                self._open(item)
            elif p.kind == "args":
                item = self._call_items[p.index]
                item["arguments"] += p.text
                self._emit("response.function_call_arguments.delta", item_id=item["id"],
                           output_index=self.output.index(item), delta=p.text)

    def _close_calls(self) -> None:
        for item in self._call_items.values():
            self._emit("response.function_call_arguments.done", item_id=item["id"],
                       output_index=self.output.index(item), name=item["name"],
                       arguments=item["arguments"])
            self._close(item)
        self._call_items = {}

    # -- the request's events

    async def events(self, events: AsyncIterator[Event], first: Event
                     ) -> AsyncGenerator[tuple[str, JSONBody], None]:
        """(event name, data) in the Responses API's order, ending with the final state."""
        self._emit("response.created", response=self._snapshot())
        self._emit("response.in_progress", response=self._snapshot())
        try:
            ev: Event | None = first
            while ev is not None:
                if isinstance(ev, Started):
                    self.trace.prompt_tokens = ev.prompt_tokens
                    self._split = AnswerSplit(ev.reasoning, ev.thought_open, ev.tool_format,
                                              self.tool_names, self.parallel)
                elif isinstance(ev, Delta):
                    self.trace.token(0, len(ev.token_ids))
                    thinking = self._split.in_thought
                    self._text(ev.text)
                    if thinking or self._split.in_thought:
                        self.reasoning_tokens += len(ev.token_ids)
                elif isinstance(ev, Finished):
                    self._finish(ev)
                elif isinstance(ev, ErrorEvent):
                    self.trace.error = ev.kind
                    self.response["status"] = "failed"
                    self.response["error"] = {"code": ev.kind, "message": ev.message}
                    self._emit("response.failed", response=self._snapshot())
                    ev = None
                    break
                for item in self._pending:
                    yield item
                self._pending = []
                ev = await anext(events, None)
            for item in self._pending:
                yield item
            self._pending = []
        finally:
            await events.aclose()  # type: ignore[attr-defined]

    def _finish(self, ev: Finished) -> None:
        cut = ev.reason == "length"
        self.response["status"] = "incomplete" if cut else "completed"
        if cut:
            self.response["incomplete_details"] = {"reason": "max_output_tokens"}
        self._text("", final=True)
        self._close_reasoning()
        self._close_message()
        self._close_calls()
        u = ev.usage
        thought_tokens = self.reasoning_tokens
        self.response["usage"] = {
            "input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": thought_tokens},
            "total_tokens": u.prompt_tokens + u.completion_tokens}
        self.trace.completion_tokens = u.completion_tokens
        self.trace.finish_reasons.append("length" if cut else "stop")
        self._emit("response.incomplete" if cut else "response.completed",
                   response=self._snapshot())

    def output_messages(self) -> list[JSONBody]:
        """The response's output as chat messages (what a later previous_response_id adds)."""
        text = "".join(part["text"] for item in self.output if item["type"] == "message"
                       for part in item["content"])
        calls = [{"id": item["call_id"], "type": "function",
                  "function": {"name": item["name"], "arguments": item["arguments"]}}
                 for item in self.output if item["type"] == "function_call"]
        msg: JSONBody = {"role": "assistant", "content": text}
        if calls:
            msg["tool_calls"] = calls
        return [msg] if text or calls else []
