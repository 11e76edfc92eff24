"""Tools for a chat template that ignores them, written into the conversation in the Hermes/Qwen
format: the tool list in the system prompt, earlier calls as `<tool_call>` blocks, tool results
in `<tool_response>` blocks. nbserve's tool-call grammar and parser (`tool_calls.py`) make the
model write `<tool_call>` blocks and read them back. The wording is Qwen2.5's, which many small
models were tuned on.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from ..types import InvalidRequestError, JSONObject, JSONValue

_TOOLS_HEAD = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
               "You are provided with function signatures within <tools></tools> XML tags:\n"
               "<tools>\n")
_TOOLS_TAIL = ("\n</tools>\n\nFor each function call, return a json object with function name "
               "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
               '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def tools_section(tools: Sequence[JSONValue]) -> str:
    """The system-prompt section that lists `tools` (one JSON object a line) and says how to
    call them."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return _TOOLS_HEAD + listed + _TOOLS_TAIL


def _text(content: JSONValue) -> str:
    if isinstance(content, list):  # text parts (kept as a list for templates that loop)
        return "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def _with_text(content: JSONValue, text: str, sep: str) -> JSONValue:
    """`content` (a string or text parts) with `text` appended after `sep`."""
    if isinstance(content, list):
        return [*content, {"type": "text", "text": sep + text if content else text}]
    return f"{content}{sep}{text}" if content else text


def _call_block(call: JSONValue) -> str:
    fn = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(fn, dict):
        raise InvalidRequestError("an assistant message's tool_calls must be a list of "
                                  "objects", param="messages")
    body = {"name": fn.get("name"), "arguments": fn.get("arguments", {})}
    return "<tool_call>\n" + json.dumps(body, ensure_ascii=False) + "\n</tool_call>"


def tools_in_prompt(messages: list[JSONObject], tools: Sequence[JSONValue]
                    ) -> list[JSONObject]:
    """A copy of `messages` (plain dicts, as the template gets them) with the tools section
    appended to the first system message (or in a new one), each assistant `tool_calls` written
    into its content, and each tool result wrapped in `<tool_response>`."""
    out: list[JSONObject] = []
    for m in messages:
        m = dict(m)
        if m.get("role") == "assistant" and m.get("tool_calls"):
            listed = m.pop("tool_calls")
            calls = "\n".join(_call_block(c) for c in (listed if isinstance(listed, list)
                                                       else [listed]))
            m["content"] = _with_text(m.get("content"), calls, "\n")
        elif m.get("role") == "tool":
            wrapped = f"<tool_response>\n{_text(m.get('content'))}\n</tool_response>"
            m["content"] = [{"type": "text", "text": wrapped}] if isinstance(
                m.get("content"), list) else wrapped
        out.append(m)
    section = tools_section(tools)
    if out and out[0].get("role") == "system":
        out[0]["content"] = _with_text(out[0].get("content"), section, "\n\n")
    else:
        out.insert(0, {"role": "system", "content": section})
    return out
