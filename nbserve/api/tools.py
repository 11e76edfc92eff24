"""Tool calls in model output -> OpenAI `tool_calls`.

Understood forms: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Hermes,
Qwen2.5, SmolLM; a JSON list inside one block gives several calls) and, when tools were given,
an answer that is only `{"name": ..., "parameters": {...}}` (Llama 3.x). A block that does not
parse stays in the content, never dropped.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(TOOL_OPEN) + r"(.*?)" + re.escape(TOOL_CLOSE), re.DOTALL)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _as_call(obj: Any) -> dict[str, Any] | None:
    """{"name", "arguments"|"parameters"} -> an OpenAI tool call dict, or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            json.loads(args)
        except ValueError:
            return None
        arguments = args
    elif isinstance(args, dict):
        arguments = json.dumps(args, ensure_ascii=False)
    else:
        return None
    return {"id": new_call_id(), "type": "function",
            "function": {"name": obj["name"], "arguments": arguments}}


def _parse_block(body: str) -> list[dict[str, Any]] | None:
    try:
        obj = json.loads(body.strip())
    except ValueError:
        return None
    items = obj if isinstance(obj, list) else [obj]
    calls = [_as_call(x) for x in items]
    if not calls or any(c is None for c in calls):
        return None
    return calls  # type: ignore[return-value]


def parse_tool_calls(text: str, tool_names: set[str] | None = None
                     ) -> tuple[str | None, list[dict[str, Any]]]:
    """Split model output into (content, tool_calls). Without calls, content is `text` as is."""
    calls: list[dict[str, Any]] = []
    parts: list[str] = []
    pos = 0
    for m in _BLOCK.finditer(text):
        found = _parse_block(m.group(1))
        if found is None:
            parts.append(text[pos:m.end()])  # unparseable: keep it as content
        else:
            parts.append(text[pos:m.start()])
            calls.extend(found)
        pos = m.end()
    if not calls:
        bare = text.strip()
        if tool_names and bare.startswith("{"):
            try:
                call = _as_call(json.loads(bare))
            except ValueError:
                call = None
            if call is not None and call["function"]["name"] in tool_names:
                return None, [call]
        return text, []
    parts.append(text[pos:])
    content = "".join(parts).strip()
    return content or None, calls


class ToolCallStream:
    """Incremental parsing for streams: plain text passes through as it comes; from a
    `<tool_call>` (or a leading `{` when tools were given) on, text is held until `finish()`."""

    def __init__(self, tool_names: set[str] | None = None, parallel: bool = True):
        self.tool_names = tool_names or set()
        self.parallel = parallel
        self._buf = ""
        self._holding = False
        self._emitted = False  # any non-whitespace content sent yet

    def feed(self, text: str) -> str:
        """Add model text; return the part that is safe to show as content now."""
        self._buf += text
        if self._holding:
            return ""
        if not self._emitted:
            head = self._buf.lstrip()
            if not head:
                return ""  # only whitespace so far: cannot tell yet
            if head.startswith("{") and self.tool_names:
                self._holding = True
                return ""
        i = self._buf.find(TOOL_OPEN)
        if i >= 0:
            out, self._buf, self._holding = self._buf[:i], self._buf[i:], True
        else:
            keep = _partial_suffix(self._buf, TOOL_OPEN)
            cut = len(self._buf) - keep
            out, self._buf = self._buf[:cut], self._buf[cut:]
        if out.strip():
            self._emitted = True
        return out

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """End of output: (content not yet shown, tool calls)."""
        text, self._buf = self._buf, ""
        if not self._emitted and not self._holding:
            return text, []
        content, calls = parse_tool_calls(text, self.tool_names if not self._emitted else None)
        if calls and not self.parallel:
            calls = calls[:1]
        return content or "", calls


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def tool_call_delta(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool calls as a streaming delta: each with its `index`."""
    return [{"index": i, **c} for i, c in enumerate(calls)]
