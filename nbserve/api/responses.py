"""/v1/responses: the request body and its conversion to a chat `Request`, on the same text
layer and engine as chat completions, and the routes (`POST`, and `GET`/`DELETE` of a stored
response); `responses_stream.py` turns the engine's events into the Responses event sequence.

`input` is a string or a list of items: messages (text parts), `function_call` and
`function_call_output` (reasoning items are dropped: the thought is not sent back).
`instructions` become the system message; `previous_response_id` puts the stored conversation
first. Function tools, `tool_choice`, `parallel_tool_calls`, `text.format` (enforced),
`reasoning.effort` (the template's thinking switch) are served; built-in tools and the fields
that would need a hosted service get a 400 naming them.
"""

from __future__ import annotations

import json

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import Response

from ..types import Constraint, InvalidRequestError, Request, ToolSpec
from .errors import APIError, error_event_to_api
from .fields import unsupported as _refuse
from .handler import CLIENT_GONE, RouteContext, answer, sse_events
from .limits import Limits
from .openapi_schemas import body_ref
from .protocol import (
    REASONING_EFFORTS,
    Message,
    ResponseFormat,
    _Body,
    _Sampling,
    function_tool,
    template_messages,
    thinking_switch,
    unique_names,
)
from .response_store import ResponseStore
from .responses_stream import ResponseBuilder
from .streams import JSONBody

BUILT_IN_TOOLS = ("web_search", "web_search_preview", "file_search", "computer_use_preview",
                  "computer", "code_interpreter", "image_generation", "mcp", "local_shell",
                  "shell", "apply_patch", "custom")


class ResponsesRequest(_Body):
    """POST /v1/responses."""

    input: str | list[JSONBody]
    instructions: str | None = None
    tools: list[JSONBody] | None = None
    tool_choice: str | JSONBody | None = None
    parallel_tool_calls: bool | None = None
    text: JSONBody | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    reasoning: JSONBody | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    stream: bool | None = False
    stream_options: JSONBody | None = None  # no-op
    metadata: JSONBody | None = None  # kept on the response
    user: str | None = None  # no-op
    safety_identifier: str | None = None  # no-op
    prompt_cache_key: str | None = None  # no-op
    prompt_cache_retention: str | None = None  # no-op
    service_tier: str | None = None  # no-op
    truncation: str | None = None
    include: list[str] | None = None
    background: bool | None = None
    conversation: object = None
    prompt: object = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None
    seed: int | None = None  # extension, as chat's
    top_k: int | None = None  # extension
    min_p: float | None = None  # extension
    repetition_penalty: float | None = None  # extension

    def refuse_unsupported(self) -> None:
        if self.background:
            raise _refuse("background", "responses run while the request is open; there is no "
                          "background queue")
        if self.conversation is not None:
            raise _refuse("conversation", "conversations are not stored; use "
                          "previous_response_id")
        if self.prompt is not None:
            raise _refuse("prompt", "stored prompt templates live on OpenAI's platform")
        if self.max_tool_calls is not None:
            raise _refuse("max_tool_calls", "nbserve runs no built-in tools")
        if self.top_logprobs:
            raise _refuse("top_logprobs", "Responses logprobs are not implemented; use chat "
                          "completions with logprobs")
        if self.truncation not in (None, "disabled"):
            raise _refuse("truncation", "only \"disabled\": a conversation over the context is "
                          "a 400 that says so")
        if self.include:
            raise _refuse("include", "the included extras come from hosted tools and storage")
        effort = (self.reasoning or {}).get("effort")
        if effort not in (None, *REASONING_EFFORTS):
            raise InvalidRequestError(f"reasoning.effort must be one of "
                                      f"{', '.join(REASONING_EFFORTS)}, got {effort!r}",
                                      param="reasoning.effort")
        unknown = set(self.reasoning or {}) - {"effort", "summary", "generate_summary"}
        if unknown:
            raise InvalidRequestError(f"reasoning has unknown fields: {', '.join(sorted(unknown))}",
                                      param="reasoning")

    # ------------------------------------------------------------------ conversion

    def chat_tools(self) -> list[ToolSpec] | None:
        """Function tools in chat's shape; a built-in tool is a 400 naming it."""
        out: list[ToolSpec] = []
        for i, tool in enumerate(self.tools or []):
            kind = tool.get("type")
            if kind != "function":
                why = "nbserve runs no built-in tools; define a function tool instead" \
                    if kind in BUILT_IN_TOOLS else "only function tools are served"
                raise _refuse(f"tools[{i}].type", f"{kind!r}: {why}")
            out.append(function_tool(tool, f"tools[{i}]"))
        unique_names(out)
        return out or None

    def choice(self, tools: list[ToolSpec] | None) -> tuple[str, str | None, bool]:
        """(tool_choice for the Request, the forced function's name, whether tools are used)."""
        c = self.tool_choice
        names = {t["function"]["name"] for t in tools or []}
        if c is None or c == "auto":
            return "auto", None, bool(tools)
        if c == "none":
            return "auto", None, False
        if c == "required":
            if not tools:
                raise InvalidRequestError("tool_choice \"required\" needs tools",
                                          param="tool_choice")
            return "required", None, True
        if isinstance(c, dict) and c.get("type") == "function":
            name = c.get("name")
            if name not in names:
                raise InvalidRequestError(f"tool_choice names the function {name!r}, which is "
                                          "not in tools", param="tool_choice")
            return "auto", str(name), True
        raise _refuse("tool_choice", f"{c!r}: only \"auto\", \"none\", \"required\" and "
                      "{\"type\": \"function\", \"name\": ...} are served")

    def input_messages(self) -> list[JSONBody]:
        """The request's own input as chat messages (before the stored conversation)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        out: list[JSONBody] = []
        for i, item in enumerate(self.input):
            where = f"input[{i}]"
            kind = item.get("type", "message" if "role" in item else None)
            if kind == "message":
                out.append(_message(item, where))
            elif kind == "function_call":
                call = {"id": str(item.get("call_id") or item.get("id") or f"call_{i}"),
                        "type": "function",
                        "function": {"name": _str(item, "name", where),
                                     "arguments": _str(item, "arguments", where)}}
                if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") and \
                        not out[-1]["content"]:
                    out[-1]["tool_calls"].append(call)
                else:
                    out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            elif kind == "function_call_output":
                output = item.get("output")
                if not isinstance(output, str):
                    output = json.dumps(output, ensure_ascii=False)
                out.append({"role": "tool", "tool_call_id": _str(item, "call_id", where),
                            "content": output})
            elif kind == "reasoning":
                continue  # the model's earlier thought is not sent back (as templates do)
            else:
                raise _refuse(f"{where}.type", f"{kind!r}: nbserve takes messages, "
                              "function_call, function_call_output and reasoning items")
        return out

    def to_request(self, limits: Limits, history: list[JSONBody],
                   request_id: str) -> Request:
        """The Request: instructions, then the stored conversation `history`, then the input."""
        self.refuse_unsupported()
        tools = self.chat_tools()
        choice, name, use_tools = self.choice(tools)
        messages = ([{"role": "system", "content": self.instructions}]
                    if self.instructions else []) + history + self.input_messages()
        checked = template_messages(_as_chat_messages(messages), limits)
        sampling = _Sampling(temperature=self.temperature, top_p=self.top_p, seed=self.seed,
                             top_k=self.top_k, min_p=self.min_p,
                             repetition_penalty=self.repetition_penalty)
        max_tokens = self.max_output_tokens if self.max_output_tokens is not None else \
            limits.max_tokens
        params = sampling._params(limits, max_tokens, "max_output_tokens", False, 0)
        fmt = (self.text or {}).get("format")
        if fmt is not None:
            params.constraint = _text_format(fmt)
            params.validate()
        req = Request(messages=checked, params=params, tools=tools if use_tools else None,
                      tool_choice=choice, tool_name=name,  # type: ignore[arg-type]
                      parallel_tool_calls=self.parallel_tool_calls is not False,
                      template_kwargs=thinking_switch((self.reasoning or {}).get("effort"),
                                                      None), request_id=request_id)
        if self.user:
            req.metadata["user"] = self.user
        return req


def _str(item: JSONBody, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise InvalidRequestError(f"{where}.{key} must be a string", param=f"{where}.{key}")
    return value


def _message(item: JSONBody, where: str) -> JSONBody:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise InvalidRequestError(f"{where}.role must be user, system, developer or assistant, "
                                  f"got {role!r}", param=f"{where}.role")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise InvalidRequestError(f"{where}.content must be a string or a list of parts",
                                  param=f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text", "refusal") and \
                isinstance(part.get("text", part.get("refusal")), str):
            texts.append(part.get("text", part.get("refusal")))
        else:
            raise _refuse(f"{where}.content[{j}].type", f"{kind!r}: nbserve serves text-only "
                          "models; send input_text parts")
    return {"role": role, "content": "\n".join(texts)}


def _as_chat_messages(messages: list[JSONBody]) -> list[Message]:
    """Plain message dicts as the chat schema's message models (so the same limits apply)."""
    from pydantic import TypeAdapter

    adapter: TypeAdapter[Message] = TypeAdapter(Message)
    out = []
    for m in messages:
        m = {**m, "role": "system" if m["role"] == "developer" else m["role"]}
        if m.get("tool_calls") and not m.get("content"):
            m["content"] = None
        out.append(adapter.validate_python(m))
    return out


def _text_format(fmt: object) -> Constraint | None:
    """`text.format` -> a Constraint (None for text)."""
    if not isinstance(fmt, dict):
        raise InvalidRequestError("text.format must be an object", param="text.format")
    kind = fmt.get("type")
    body: JSONBody
    if kind == "json_schema":
        extra = set(fmt) - {"type", "name", "schema", "strict", "description"}
        if extra:
            raise InvalidRequestError(f"text.format has unknown fields: "
                                      f"{', '.join(sorted(extra))}", param="text.format")
        body = {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items()
                                                       if k != "type"}}
    else:
        body = {"type": kind}
    try:
        rf = ResponseFormat.model_validate(body)
    except Exception:  # noqa: BLE001 - any mismatch is the caller's: say where
        raise InvalidRequestError(f"text.format {fmt!r} is not a text, json_object or "
                                  "json_schema format", param="text.format") from None
    c = rf.constraint()
    if c is not None and c.kind == "json_schema":
        from dataclasses import replace
        c = replace(c, param="text.format.schema")
    return c


def _echoed(body: ResponsesRequest) -> JSONBody:
    """The request's settings as a Response object repeats them."""
    effort = (body.reasoning or {}).get("effort")
    return {"instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "tool_choice": body.tool_choice or "auto", "tools": body.tools or [],
            "text": body.text or {"format": {"type": "text"}},
            "reasoning": {"effort": effort, "summary": None} if body.reasoning else None,
            "store": body.store is not False, "metadata": body.metadata or {},
            "truncation": "disabled", "user": body.user}


# ----------------------------------------------------------------------------- the routes


def router(base: RouteContext) -> APIRouter:
    """POST /v1/responses (streamed as named SSE events, or its final state), and GET / DELETE
    of the responses kept in memory (one store per app)."""
    r = APIRouter(prefix="/v1")
    store = ResponseStore()

    @r.post("/responses", openapi_extra=body_ref(ResponsesRequest))
    async def responses(request: HTTPRequest) -> Response:
        body, rid, ctx = await base.parse(request, ResponsesRequest)
        history: list[JSONBody] = []
        if body.previous_response_id:
            stored = store.get(body.previous_response_id)
            if stored is None:
                raise APIError(404, f"Previous response with id {body.previous_response_id!r} "
                               "not found (responses are kept in memory, a bounded number, "
                               "until the server stops).", "invalid_request_error",
                               "previous_response_id", "previous_response_not_found")
            history = stored.conversation
        req = body.to_request(ctx.limits, history, rid)
        started = await ctx.start(request, req)
        if started is None:
            return Response(status_code=CLIENT_GONE)
        first, gen = started
        trace = ctx.begin(request, rid, req.messages)
        builder = ResponseBuilder(f"resp_{rid}", ctx.backend.model_name, _echoed(body), trace,
                                  {t["function"]["name"] for t in req.tools or []} or None,
                                  req.parallel_tool_calls)
        events = builder.events(gen, first)
        keep = body.store is not False
        conversation = history + body.input_messages()

        def remember() -> None:
            if keep and builder.response["status"] in ("completed", "incomplete"):
                store.put(builder.response, conversation + builder.output_messages())

        async def fold() -> JSONBody:
            async for _ in events:
                pass
            if builder.response["status"] == "failed":
                err = builder.response["error"]
                raise error_event_to_api(err["message"], err["code"], rid)
            remember()
            return builder.response

        return await answer(request, rid, trace, bool(body.stream),
                            lambda: sse_events(events, trace, remember), fold, events.aclose)

    @r.get("/responses/{response_id}")
    async def get_response(response_id: str) -> JSONBody:
        stored = store.get(response_id)
        if stored is None:
            raise APIError(404, f"No response with id {response_id!r} is kept here.",
                           "invalid_request_error", "response_id", "not_found")
        return stored.response

    @r.delete("/responses/{response_id}")
    async def delete_response(response_id: str) -> JSONBody:
        if not store.delete(response_id):
            raise APIError(404, f"No response with id {response_id!r} is kept here.",
                           "invalid_request_error", "response_id", "not_found")
        return {"id": response_id, "object": "response", "deleted": True}

    return r
