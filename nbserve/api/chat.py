"""POST /v1/chat/completions: the body's schema and its conversion to a `Request`, the engine's
events as `chat.completion.chunk`s (one code path), the fold of those same chunks into the
non-streaming `chat.completion`, and the route."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Literal

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import Response

from ..text.reasoning import ReasoningSplitter
from ..text.tool_calls import FORMATS, HERMES, Piece, ToolCallParser
from ..types import (
    MAX_TOP_LOGPROBS,
    ChatMessage,
    Delta,
    ErrorEvent,
    Event,
    Finished,
    InvalidRequestError,
    Request,
    Started,
    TokenLogprob,
)
from .fields import unsupported as _refuse
from .handler import CLIENT_GONE, RouteContext, answer, sse_chunks
from .limits import Limits
from .openapi_schemas import body_ref
from .protocol import (
    REASONING_EFFORTS,
    Message,
    NamedToolChoice,
    ResponseFormat,
    Tool,
    _Sampling,
    template_messages,
    thinking_switch,
)
from .streams import (
    FINISH_REASONS,
    JSONBody,
    StreamFailed,
    StreamInfo,
    clamp_logprob,
    fold_chunks,
)


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: list[Message]
    audio: dict[str, object] | None = None
    function_call: object = None
    functions: list[object] | None = None
    logprobs: bool | None = None
    max_completion_tokens: int | None = None
    max_tokens: int | None = None
    metadata: dict[str, object] | None = None  # no-op
    modalities: list[str] | None = None
    moderation: object = None
    parallel_tool_calls: bool | None = None
    prediction: object = None
    prompt_cache_key: str | None = None  # no-op: prefixes are reused without a key
    prompt_cache_options: dict[str, object] | None = None  # no-op
    prompt_cache_retention: str | None = None  # no-op
    reasoning_effort: str | None = None
    response_format: ResponseFormat | None = None
    chat_template_kwargs: JSONBody | None = None  # extension (vLLM): template variables
    safety_identifier: str | None = None  # no-op
    service_tier: str | None = None  # no-op
    store: bool | None = None  # no-op: nothing is stored
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    tools: list[Tool] | None = None
    top_logprobs: int | None = None
    verbosity: str | None = None
    web_search_options: object = None

    @property
    def use_tools(self) -> bool:
        """Tools go to the template (and output is parsed for calls) unless tool_choice is none."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def tool_names(self) -> set[str]:
        return {t.function.name for t in self.tools or []}

    def _refuse_unsupported(self) -> None:
        if self.audio is not None:
            raise _refuse("audio", "it serves text-only models")
        if self.modalities and any(m != "text" for m in self.modalities):
            raise _refuse("modalities", "only [\"text\"] is served")
        if self.prediction is not None:
            raise _refuse("prediction", "predicted outputs are not implemented")
        if self.moderation is not None:
            raise _refuse("moderation", "it has no moderation model")
        if self.reasoning_effort not in (None, *REASONING_EFFORTS):
            raise InvalidRequestError(f"reasoning_effort must be one of "
                                      f"{', '.join(REASONING_EFFORTS)}, got "
                                      f"{self.reasoning_effort!r}", param="reasoning_effort")
        if self.verbosity not in (None, "medium"):
            raise _refuse("verbosity", "only \"medium\" (the model as it is) is served; ask "
                          "for a shorter or longer answer in the prompt")
        if self.web_search_options is not None:
            raise _refuse("web_search_options", "it has no web access")
        if self.functions is not None or self.function_call is not None:
            param = "functions" if self.functions is not None else "function_call"
            raise _refuse(param, "the deprecated functions API is not served; use tools and "
                          "tool_choice")
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise InvalidRequestError(f"tool_choice {self._choice_name()} needs tools",
                                      param="tool_choice")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs=true", param="top_logprobs")
        names = [t.function.name for t in self.tools or []]
        if isinstance(self.tool_choice, NamedToolChoice) and \
                self.tool_choice.function.name not in names:
            raise InvalidRequestError(
                f"tool_choice names the function {self.tool_choice.function.name!r}, which is "
                f"not in tools ({', '.join(names)})", param="tool_choice")
        for i, name in enumerate(names):
            if not name or names.index(name) != i:
                raise InvalidRequestError(f"tools[{i}].function.name must be a non-empty name "
                                          "that no other tool has", param=f"tools[{i}].function"
                                          ".name")

    def _format(self) -> ResponseFormat | None:
        return self.response_format

    def _choice_name(self) -> str:
        c = self.tool_choice
        return repr(c) if isinstance(c, str) else f"naming {c.function.name!r}" if c else "none"

    def template_messages(self, limits: Limits) -> list[ChatMessage]:
        """Messages as plain dicts for the chat template, after the size limits."""
        return template_messages(self.messages, limits)

    def to_request(self, limits: Limits | None = None, request_id: str | None = None) -> Request:
        """The nbserve Request for this body; InvalidRequestError (400) naming what is wrong."""
        limits = limits or Limits()
        self._refuse_unsupported()
        messages = self.template_messages(limits)
        max_tokens: int | None
        if self.max_completion_tokens is not None:
            max_tokens, param = self.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, param = self.max_tokens, "max_tokens"
        if self.top_logprobs is not None:
            limits.check_range("top_logprobs", self.top_logprobs, 0, MAX_TOP_LOGPROBS)
        params = self._params(limits, limits.max_tokens if max_tokens is None else max_tokens,
                              param, bool(self.logprobs), self.top_logprobs or 0)
        tools = [t.spec() for t in self.tools or []] if self.use_tools else None
        req = Request(messages=messages, params=params, tools=tools,
                      parallel_tool_calls=self.parallel_tool_calls is not False,
                      template_kwargs=thinking_switch(self.reasoning_effort,
                                                      self.chat_template_kwargs))
        if isinstance(self.tool_choice, NamedToolChoice):
            req.tool_name = self.tool_choice.function.name
        elif self.tool_choice == "required":
            req.tool_choice = "required"
        if request_id:
            req.request_id = request_id
        if self.user:
            req.metadata["user"] = self.user
        return req


# ----------------------------------------------------------------------------- chunks


def chat_logprobs(info: StreamInfo, lps: list[TokenLogprob]) -> list[JSONBody]:
    """Chat's logprobs entries (with each token's bytes) for `lps`."""
    return [{"token": lp.token, "logprob": clamp_logprob(lp.logprob),
             "bytes": lp.bytes if lp.bytes is not None else info.bytes_of(lp.token_id, lp.token),
             "top_logprobs": [{"token": t, "logprob": clamp_logprob(v),
                               "bytes": info.bytes_of(i, t)} for i, t, v in lp.top]}
            for lp in lps]


async def chat_chunks(events: AsyncIterator[Event], first: Event, info: StreamInfo, n: int,
                      tools: set[str] | None = None, parallel_tool_calls: bool = True,
                      ) -> AsyncGenerator[JSONBody, None]:
    """`chat.completion.chunk` dicts for one request; the last one (choices=[]) has the usage.
    Raises StreamFailed on an ErrorEvent. Closing this closes `events` (aborting the request)."""
    base = {"id": info.id, "object": "chat.completion.chunk", "created": info.created,
            "model": info.model, "system_fingerprint": None}
    opened = [False] * n
    parsers: list[ToolCallParser] | None = None
    thoughts: list[ReasoningSplitter] | None = None
    trace = info.trace

    def chunk(index: int, delta: JSONBody, logprobs: JSONBody | None = None,
              finish: str | None = None) -> JSONBody:
        return {**base, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                     "finish_reason": finish}]}

    def role(index: int) -> JSONBody:
        opened[index] = True
        return chunk(index, {"role": "assistant", "content": ""})

    def text_out(index: int, text: str, lps: JSONBody | None = None, final: bool = False
                 ) -> list[JSONBody]:
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

    def pieces_out(index: int, pieces: list[Piece], lps: JSONBody | None = None
                   ) -> list[JSONBody]:
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
                reason = FINISH_REASONS.get(ev.reason, "stop")
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


async def fold_chat(chunks: AsyncIterator[JSONBody]) -> JSONBody:
    """The non-streaming `chat.completion` built from the stream's chunks."""
    folded = await fold_chunks(chunks, lambda: {"text": [], "calls": {}, "lps": None,
                                                "thought": None}, _add_chat_chunk)
    out_choices = []
    for i in sorted(folded.choices):
        st = folded.choices[i]
        content = "".join(st["text"])
        msg: JSONBody = {"role": "assistant",
                         "content": content if content or not st["calls"] else None,
                         "refusal": None}
        if st["thought"] is not None:
            msg["reasoning_content"] = msg["reasoning"] = st["thought"]
        if st["calls"]:
            msg["tool_calls"] = [st["calls"][k] for k in sorted(st["calls"])]
        out_choices.append({"index": i, "message": msg,
                            "logprobs": None if st["lps"] is None else {"content": st["lps"]},
                            "finish_reason": st["finish"]})
    return folded.answer("chat.completion", out_choices)


def _add_chat_chunk(st: JSONBody, ch: JSONBody) -> None:
    """One choice's chunk into its folded state: text, thought, tool-call pieces, logprobs."""
    d = ch["delta"]
    if d.get("content"):
        st["text"].append(d["content"])
    if d.get("reasoning_content"):
        st["thought"] = (st["thought"] or "") + d["reasoning_content"]
    for call in d.get("tool_calls") or ():
        add_tool_call_piece(st["calls"], call)
    if ch.get("logprobs"):
        st["lps"] = (st["lps"] or []) + ch["logprobs"]["content"]


def add_tool_call_piece(calls: dict[int, JSONBody], piece: JSONBody) -> None:
    """One streamed tool-call delta into the calls so far, by index: the first piece of a
    call names it, the others add to its arguments (JSON text)."""
    if piece["index"] not in calls:
        calls[piece["index"]] = {"id": piece["id"], "type": "function",
                                 "function": {"name": piece["function"]["name"],
                                              "arguments": ""}}
    calls[piece["index"]]["function"]["arguments"] += piece["function"].get("arguments", "")


# ----------------------------------------------------------------------------- the route


def router(base: RouteContext) -> APIRouter:
    """POST /v1/chat/completions: streamed as SSE chunks, or folded into one answer."""
    r = APIRouter(prefix="/v1")

    @r.post("/chat/completions", openapi_extra=body_ref(ChatCompletionRequest))
    async def chat_completions(request: HTTPRequest) -> Response:
        body, rid, ctx = await base.parse(request, ChatCompletionRequest)
        req = body.to_request(ctx.limits, request_id=rid)
        started = await ctx.start(request, req)
        if started is None:
            return Response(status_code=CLIENT_GONE)
        first, gen = started
        trace = ctx.begin(request, rid, req.messages)
        info = StreamInfo(f"chatcmpl-{rid}", ctx.backend.model_name, int(time.time()), trace,
                          ctx.token_bytes)
        tools = body.tool_names if body.use_tools else None
        chunks = chat_chunks(gen, first, info, req.params.n, tools,
                             body.parallel_tool_calls is not False)
        return await answer(request, rid, trace, bool(body.stream),
                            lambda: sse_chunks(chunks, body.include_usage, trace, rid),
                            lambda: fold_chat(chunks), gen.aclose)

    return r
