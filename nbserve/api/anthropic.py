"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens, a thin route
family over the same backend, request types and limits as the OpenAI routes.

The body's schema, and its conversion to nbserve's chat `Request`: `system` becomes the system
message; a user turn's `text` blocks its content and each `tool_result` a "tool" message (its
`is_error` written into it); an assistant turn's `text`, `tool_use` (its tool_calls) and
`thinking` (its reasoning, as chat's `reasoning_content` reaches templates); `tools` and
`tool_choice` are chat's tools, enforced by the same grammars; `thinking` is the template's
thinking switch. `anthropic_stream.py` turns the engine's events into Anthropic's event
sequence; `anthropic_errors.py` writes errors in Anthropic's shape on these paths. What would
change the answer and is not served (images, documents, server tools, MCP servers, a final
assistant turn to continue) is a 400 that says so; unknown fields are a 400 naming them.
"""

from __future__ import annotations

import json
from typing import Literal

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import Response
from pydantic import Field

from ..text.chat_template import plain_json
from ..types import Constraint, InvalidRequestError, Request, ToolSpec
from .anthropic_errors import anthropic_error_shape
from .anthropic_stream import MessageBuilder
from .errors import APIError
from .fields import unsupported as _refuse
from .handler import CLIENT_GONE, RouteContext, answer, sse_events
from .limits import Limits
from .openapi_schemas import body_ref
from .protocol import (
    AssistantMessage,
    ContentPart,
    FunctionCall,
    Message,
    SystemMessage,
    ToolCall,
    ToolMessage,
    UserMessage,
    _Body,
    _Sampling,
    _Schema,
    function_tool,
    template_messages,
    unique_names,
)
from .streams import JSONBody

PATHS = frozenset({"/v1/messages"})  # and the paths below it: errors in Anthropic's shape

# The fields each served block type may hold besides `type` (required ones first).
_BLOCK_FIELDS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "text": (frozenset({"text"}), frozenset({"cache_control", "citations"})),
    "tool_use": (frozenset({"id", "name", "input"}), frozenset({"cache_control"})),
    "tool_result": (frozenset({"tool_use_id"}),
                    frozenset({"content", "is_error", "cache_control"})),
    "thinking": (frozenset({"thinking"}), frozenset({"signature"})),
}
# Where each served block type may appear.
_BLOCK_PLACES = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use", "thinking")}
_TEXT_ONLY = ("nbserve serves text-only models: images and documents are not read; send their "
              "text in a text block")
_REFUSED_BLOCKS = {
    "image": _TEXT_ONLY, "document": _TEXT_ONLY, "search_result": _TEXT_ONLY,
    "redacted_thinking": "its thought is encrypted by Anthropic and nbserve's model cannot "
                         "read it; drop the block",
    "server_tool_use": "nbserve runs no server tools", "web_search_tool_result":
    "nbserve runs no server tools", "container_upload": "nbserve runs no code containers",
}


class Block(_Schema):
    """One content block of any type; `check` says which fields its type takes."""

    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, object] | None = None
    tool_use_id: str | None = None
    content: str | list[Block] | None = None
    is_error: bool | None = None
    thinking: str | None = None
    signature: str | None = None
    source: object = None  # image, document: refused for their type
    title: object = None
    context: object = None
    data: object = None
    citations: object = None  # no-op: a text block's citations change nothing here
    cache_control: dict[str, object] | None = None  # no-op: prefixes are cached without hints

    def check(self, where: str, allowed: tuple[str, ...]) -> None:
        """A 400 for a block of a type not served here, or with a field its type lacks."""
        if self.type in _REFUSED_BLOCKS:
            raise _refuse(f"{where}.type", f"{self.type!r} blocks: {_REFUSED_BLOCKS[self.type]}")
        if self.type not in allowed:
            raise InvalidRequestError(f"{where}.type: {self.type!r} blocks are not served "
                                      f"here; send {', '.join(allowed)} blocks",
                                      param=f"{where}.type")
        required, optional = _BLOCK_FIELDS[self.type]
        given = {k for k in self.model_fields_set - {"type"} if getattr(self, k) is not None}
        missing, foreign = sorted(required - given), sorted(given - required - optional)
        if missing:
            raise InvalidRequestError(f"Missing required field: {where}.{missing[0]} (a "
                                      f"{self.type} block needs it)",
                                      param=f"{where}.{missing[0]}")
        if foreign:
            raise InvalidRequestError(f"{where}.{foreign[0]} is not a field of a {self.type} "
                                      "block", param=f"{where}.{foreign[0]}")


class AnthropicMessage(_Schema):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class ToolChoice(_Schema):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(_Schema):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None
    display: Literal["summarized", "omitted"] | None = None


class OutputFormat(_Schema):
    type: Literal["json_schema"]
    schema_: dict[str, object] = Field(alias="schema")


class OutputConfig(_Schema):
    format: OutputFormat | None = None
    effort: str | None = None


class Metadata(_Schema):
    user_id: str | None = None


class CountTokensRequest(_Body):
    """POST /v1/messages/count_tokens: the prompt part of a Messages body."""

    messages: list[AnthropicMessage]
    system: str | list[Block] | None = None
    tools: list[JSONBody] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None  # format: enforced as chat's response_format
    cache_control: dict[str, object] | None = None  # no-op: prefixes are cached without hints
    speed: str | None = None  # no-op
    mcp_servers: object = None

    # ------------------------------------------------------------------ conversion

    def refuse_unsupported(self) -> None:
        if self.mcp_servers is not None:
            raise _refuse("mcp_servers", "nbserve connects to no MCP servers; run the tools in "
                          "the client and send their results as tool_result blocks")

    def chat_tools(self) -> list[ToolSpec] | None:
        """`tools` as chat's function tools; a server tool (a typed one) is a 400 naming it."""
        out: list[ToolSpec] = []
        for i, tool in enumerate(self.tools or []):
            where = f"tools[{i}]"
            kind = tool.get("type", "custom")
            if kind != "custom":
                raise _refuse(f"{where}.type", f"{kind!r}: nbserve runs no server tools; "
                              "define a custom tool (name, description, input_schema) instead")
            # cache_control and eager_input_streaming change nothing here (the input streams
            # as it comes): accepted; `strict` is enforced as a strict function's schema
            spec = function_tool(tool, where, "input_schema", (
                "description", "strict", "cache_control", "eager_input_streaming"))
            if "parameters" not in spec["function"]:
                raise InvalidRequestError(f"Missing required field: {where}.input_schema",
                                          param=f"{where}.input_schema")
            out.append(spec)
        unique_names(out)
        return out or None

    def choice(self, tools: list[ToolSpec] | None) -> tuple[Literal["auto", "required"],
                                                            str | None, bool, bool]:
        """(tool_choice for the Request, the forced tool's name, whether the tools are used,
        whether parallel calls are allowed)."""
        c = self.tool_choice
        parallel = c is None or not c.disable_parallel_tool_use
        if c is not None and c.type != "tool" and c.name is not None:
            raise InvalidRequestError(f"tool_choice.name goes with a tool_choice of type "
                                      f"'tool', not {c.type!r}", param="tool_choice.name")
        if c is None or c.type == "auto":
            return "auto", None, bool(tools), parallel
        if c.type == "none":
            return "auto", None, False, parallel
        if not tools:
            raise InvalidRequestError(f"tool_choice of type {c.type!r} needs tools",
                                      param="tool_choice")
        if c.type == "any":
            return "required", None, True, parallel
        names = [t["function"]["name"] for t in tools]
        if c.name is None:
            raise InvalidRequestError("Missing required field: tool_choice.name (a tool_choice "
                                      "of type 'tool' names the tool)", param="tool_choice.name")
        if c.name not in names:
            raise InvalidRequestError(f"tool_choice names the tool {c.name!r}, which is not in "
                                      f"tools ({', '.join(names)})", param="tool_choice.name")
        return "auto", c.name, True, parallel

    def template_kwargs(self) -> JSONBody:
        """The template's thinking switch (Qwen3's and SmolLM3's `enable_thinking`): on for
        `enabled` and `adaptive`, off for `disabled`; the template's default without it."""
        if self.thinking is None:
            return {}
        return {"enable_thinking": self.thinking.type != "disabled"}

    def chat_messages(self, limits: Limits) -> list[Message]:
        """`system` and `messages` as chat messages, in order (see the module's docstring).
        Each message's size is checked here, where its index is the client's."""
        out: list[Message] = []
        if self.system:
            limits.check_text("system", _chars(self.system), limits.max_message_chars,
                              "system")
            out.append(SystemMessage(role="system", content=self.system if isinstance(
                self.system, str) else _texts(self.system, "system")))
        if not self.messages:
            raise InvalidRequestError("messages must hold at least one message",
                                      param="messages")
        for i, m in enumerate(self.messages):
            where = f"messages[{i}]"
            if not m.content and not isinstance(m.content, str):
                raise InvalidRequestError(f"{where}.content must hold at least one block",
                                          param=f"{where}.content")
            limits.check_text(f"{where}.content", _chars(m.content), limits.max_message_chars,
                              where)
            if isinstance(m.content, str):
                out.append(UserMessage(role="user", content=m.content) if m.role == "user" else
                           AssistantMessage(role="assistant", content=m.content))
            elif m.role == "user":
                out += _user_turn(m.content, where)
            else:
                out.append(_assistant_turn(m.content, where))
        if self.messages[-1].role == "assistant":
            raise _refuse(f"messages[{len(self.messages) - 1}].role", "a final assistant turn "
                          "asks to continue it (a prefill), which nbserve cannot do; end the "
                          "conversation with a user turn")
        return out

    def prompt_request(self, limits: Limits) -> Request:
        """The Request of this prompt (what count_tokens counts, before the sampling)."""
        self.refuse_unsupported()
        tools = self.chat_tools()
        choice, name, use_tools, parallel = self.choice(tools)
        return Request(messages=template_messages(self.chat_messages(limits), limits),
                       tools=tools if use_tools else None, tool_choice=choice, tool_name=name,
                       parallel_tool_calls=parallel, template_kwargs=self.template_kwargs())


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: Metadata | None = None  # user_id is kept in the request's metadata
    service_tier: str | None = None  # no-op: one tier here
    diagnostics: dict[str, object] | None = None  # no-op: no cache-miss reports
    inference_geo: str | None = None  # no-op: it runs here
    container: object = None
    context_management: object = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.container is not None:
            raise _refuse("container", "nbserve runs no code containers")
        if self.context_management is not None:
            raise _refuse("context_management", "nbserve does not edit the conversation; "
                          "send the turns the model should see")
        if self.output_config is not None and self.output_config.effort is not None:
            raise _refuse("output_config.effort", "a local model has no effort setting; use "
                          "thinking (enabled or disabled) and max_tokens")
        t = self.thinking
        if t is not None and t.display == "omitted":
            raise _refuse("thinking.display", "\"omitted\" hides a thought that nbserve "
                          "cannot sign; use \"summarized\" (the whole thought) or leave it out")
        if t is not None and t.type == "enabled":
            if t.budget_tokens is None:
                raise InvalidRequestError("Missing required field: thinking.budget_tokens (a "
                                          "thinking of type 'enabled' needs it)",
                                          param="thinking.budget_tokens")
            if not 1 <= t.budget_tokens < self.max_tokens:
                raise InvalidRequestError(f"thinking.budget_tokens must be at least 1 and less "
                                          f"than max_tokens ({self.max_tokens}), got "
                                          f"{t.budget_tokens}", param="thinking.budget_tokens")
        elif t is not None and t.budget_tokens is not None:
            raise InvalidRequestError(f"thinking.budget_tokens goes with a thinking of type "
                                      f"'enabled', not {t.type!r}", param="thinking.budget_tokens")

    def to_request(self, limits: Limits, request_id: str) -> Request:
        """The nbserve Request for this body; InvalidRequestError (400) naming what is wrong."""
        req = self.prompt_request(limits)
        if self.stop_sequences is not None and len(self.stop_sequences) > limits.max_stop:
            raise InvalidRequestError(f"stop_sequences may hold at most {limits.max_stop} "
                                      f"sequences, got {len(self.stop_sequences)}",
                                      param="stop_sequences")
        sampling = _Sampling(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                             stop=self.stop_sequences)
        req.params = sampling._params(limits, self.max_tokens, "max_tokens", False, 0)
        fmt = self.output_config.format if self.output_config is not None else None
        if fmt is not None:
            req.params.constraint = Constraint("json_schema", plain_json(fmt.schema_),
                                               strict=True, param="output_config.format.schema")
            req.params.validate()
        req.request_id = request_id
        if self.metadata is not None and self.metadata.user_id:
            req.metadata["user"] = self.metadata.user_id
        return req


Block.model_rebuild()


def _chars(content: str | list[Block] | None) -> int:
    """The characters of a message's text, thoughts and tool results."""
    if content is None or isinstance(content, str):
        return len(content or "")
    return sum(_chars(b.content) if b.type == "tool_result" else
               len(b.text or "") + len(b.thinking or "") for b in content)


def _texts(blocks: list[Block], where: str) -> list[ContentPart]:
    """Text blocks as chat's text parts (any other type is a 400 naming it)."""
    parts = []
    for j, block in enumerate(blocks):
        block.check(f"{where}[{j}]", ("text",))
        parts.append(ContentPart(type="text", text=block.text))
    return parts


def _user_turn(blocks: list[Block], where: str) -> list[Message]:
    """A user turn's blocks in order: runs of text blocks as user messages, each tool_result
    as a "tool" message."""
    out: list[Message] = []
    texts: list[ContentPart] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        block.check(at, _BLOCK_PLACES["user"])
        if block.type == "text":
            texts.append(ContentPart(type="text", text=block.text))
            continue
        if texts:
            out.append(UserMessage(role="user", content=texts))
            texts = []
        result = block.content
        text = result if isinstance(result, str) or result is None else \
            "\n".join(str(p.text) for p in _texts(result, f"{at}.content"))
        if block.is_error:
            text = f"Error: {text}"
        out.append(ToolMessage(role="tool", content=text or "",
                               tool_call_id=str(block.tool_use_id)))
    if texts:
        out.append(UserMessage(role="user", content=texts))
    return out


def _assistant_turn(blocks: list[Block], where: str) -> AssistantMessage:
    """An assistant turn's blocks as one message: its text, its tool calls, its thought."""
    texts: list[ContentPart] = []
    calls: list[ToolCall] = []
    thoughts: list[str] = []
    for j, block in enumerate(blocks):
        block.check(f"{where}.content[{j}]", _BLOCK_PLACES["assistant"])
        if block.type == "text":
            texts.append(ContentPart(type="text", text=block.text))
        elif block.type == "tool_use":
            calls.append(ToolCall(id=str(block.id), function=FunctionCall(
                name=str(block.name), arguments=json.dumps(block.input, ensure_ascii=False))))
        else:
            thoughts.append(str(block.thinking))
    return AssistantMessage(role="assistant", content=texts or None, tool_calls=calls or None,
                            reasoning_content="\n".join(thoughts) or None)


# ----------------------------------------------------------------------------- the routes


def router(base: RouteContext) -> APIRouter:
    """POST /v1/messages (streamed as Anthropic's named SSE events, or their fold) and
    POST /v1/messages/count_tokens."""
    r = APIRouter(prefix="/v1")

    @r.post("/messages", openapi_extra=body_ref(MessagesRequest))
    async def messages(request: HTTPRequest) -> Response:
        body, rid, ctx = await base.parse(request, MessagesRequest)
        req = body.to_request(ctx.limits, rid)
        started = await ctx.start(request, req)
        if started is None:
            return Response(status_code=CLIENT_GONE)
        first, gen = started
        trace = ctx.begin(request, rid, req.messages)
        builder = MessageBuilder(f"msg_{rid}", ctx.backend.model_name, trace, req.params.stop,
                                 {t["function"]["name"] for t in req.tools or []} or None,
                                 req.parallel_tool_calls, rid)
        events = builder.events(gen, first)
        return await answer(request, rid, trace, bool(body.stream),
                            lambda: sse_events(events, trace), lambda: builder.fold(events),
                            events.aclose)

    @r.post("/messages/count_tokens", openapi_extra=body_ref(CountTokensRequest))
    async def count_tokens(request: HTTPRequest) -> JSONBody:
        body, _, ctx = await base.parse(request, CountTokensRequest)
        n = ctx.backend.count_prompt_tokens(body.prompt_request(ctx.limits))
        if n is None:
            raise APIError(501, "this backend cannot count a prompt's tokens here",
                           "server_error", None, "unsupported")
        return {"input_tokens": n}

    return r


__all__ = ["PATHS", "CountTokensRequest", "MessagesRequest", "anthropic_error_shape", "router"]
