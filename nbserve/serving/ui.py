"""The Gradio chat: a streaming `gr.ChatInterface` that calls the backend's `generate` directly.

`build_chat_ui(backend)` makes the Blocks, `mount_ui(app, backend)` puts them on a FastAPI app
(after its /v1 routes), and `stop_ui(app)` ends the UI's long-lived connections so that the
server can shut down at once. The chat, and its gradio API ("Use via API"), obey the app's
`Limits`, rate limit and API keys like /v1, and leave out old turns that no longer fit.

Two settings ask for structured answers: "JSON answer" (any JSON object, or a JSON schema the
answer must match) and "Tools" (OpenAI function tools the model may call). The engine enforces
both with a grammar; tool calls are shown as collapsible "Tool call" messages holding their
arguments, not as the model's raw call text.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import math
import os
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, TypedDict

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import gradio as gr
from fastapi import FastAPI
from starlette.routing import Mount

from ..api.auth import KeyAuth, RateLimiter
from ..api.errors import APIError
from ..api.limits import Limits
from ..text.reasoning import ReasoningSplitter
from ..text.tool_calls import FORMATS, HERMES, Piece, ToolCallParser
from ..types import (
    Backend,
    ChatMessage,
    Constraint,
    Delta,
    ErrorEvent,
    Event,
    Finished,
    FunctionSpec,
    InvalidRequestError,
    JSONValue,
    NbserveError,
    Request,
    SamplingParams,
    Started,
    ToolSpec,
)
from .ui_context import NOTE_START, Message, fit_conversation

if TYPE_CHECKING:
    from gradio.routes import App

log = logging.getLogger("nbserve.ui")

ERROR_PREFIX = "⚠️ "
DEFAULT_MAX_TOKENS = 512
API_NAME = "chat"
FAILED_LINE = "Last answer: failed (the reason is in the chat)"
JSON_BOX = "JSON answer"  # the settings' labels, which errors about them name
TOOLS_BOX = "Tools"
TOOL_CALL_TITLE = "🔧 Tool call: "  # a tool-call message's title: this, then the function name
THOUGHT_TITLE = "💭 Thought"  # a thinking model's thought, shown collapsed above the answer


# ----------------------------------------------------------------------------- messages


class _Shown(TypedDict):
    role: str
    content: str


class ShownMessage(_Shown, total=False):
    """A message as the chat shows it; `metadata` ("title", "status") makes it a collapsible
    block with that title."""

    metadata: dict[str, str]


def _text(content: object) -> str:
    """The text of a Gradio message content (a string, a text part, or a list of parts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        if isinstance(content.get("text"), str):
            return content["text"]
        return ""  # a file or a component: nothing the model can read
    if isinstance(content, (list, tuple)):
        return "".join(_text(part) for part in content)
    # a gradio message object (not a dict) carries its text as an attribute
    return str(getattr(content, "text", "") or "")


def _strip_note(text: str) -> str:
    """Drop the note on left-out turns that starts an answer: it is for the user, not the model."""
    if not text.startswith(NOTE_START):
        return text
    cut = text.find("\n\n")
    return "" if cut < 0 else text[cut + 2:]


def _strip_error(text: str) -> str:
    """Drop an error notice that the UI appended to an answer, so it never reaches the model."""
    if text.startswith(ERROR_PREFIX):
        return ""
    cut = text.find("\n\n" + ERROR_PREFIX)
    return text if cut < 0 else text[:cut]


def _title(turn: Mapping[str, object]) -> str:
    """The title of a Gradio message's metadata ("" when it has none)."""
    metadata = turn.get("metadata")
    # gradio's metadata is a dict, or an object with the same fields as attributes
    title = metadata.get("title") if isinstance(metadata, dict) else getattr(metadata, "title",
                                                                             None)
    return title if isinstance(title, str) else ""


def _unfence(text: str) -> str:
    """The text inside a Markdown code block (the text itself when it is not one)."""
    body = text.strip()
    if body.startswith("```") and body.endswith("```") and len(body) >= 6:
        body = body[3:-3]
        first, _, rest = body.partition("\n")
        body = rest if first.strip().isidentifier() or not first.strip() else body
    return body.strip()


def _called_text(name: str, arguments: str) -> str:
    """How a shown tool call goes back to the model: a short note of the call, in one line."""
    try:
        arguments = json.dumps(json.loads(arguments), ensure_ascii=False)
    except ValueError:
        pass  # as the model wrote it (an answer cut short mid-call)
    return f"(called {name} with {arguments})"


def to_messages(message: object, history: Sequence[Mapping[str, object]],
                system_prompt: str | None = None) -> list[Message]:
    """OpenAI-style messages for the model: system prompt, past turns, then the new message.

    A tool-call message of the chat (titled `TOOL_CALL_TITLE` and the name) goes back as the
    assistant's text "(called NAME with ARGUMENTS)", not as its display text, and not as a real
    `tool_calls` message: the chat runs no tools, so no tool result could follow it, which some
    chat templates refuse. An answer's text and its calls (separate chat messages) become one
    assistant message, as the model wrote them.
    """
    messages: list[Message] = []
    if system_prompt and system_prompt.strip():
        messages.append({"role": "system", "content": system_prompt.strip()})
    for turn in history:
        role = turn.get("role")
        text = _text(turn.get("content"))
        title = _title(turn)
        if role == "assistant" and title == THOUGHT_TITLE:
            continue  # a thought is not sent back, as chat templates leave earlier thoughts out
        if role == "assistant" and title.startswith(TOOL_CALL_TITLE):
            text = _called_text(title[len(TOOL_CALL_TITLE):].strip(), _unfence(text))
        elif role == "assistant":
            text = _strip_error(_strip_note(text))
        if not isinstance(role, str) or role not in ("user", "assistant") or not text:
            continue
        if role == "assistant" and messages and messages[-1]["role"] == "assistant":
            messages[-1]["content"] += "\n\n" + text
        else:
            messages.append({"role": role, "content": text})
    messages.append({"role": "user", "content": _text(message)})
    return messages


def _error_text(partial: str, message: str) -> str:
    notice = ERROR_PREFIX + message
    return f"{partial}\n\n{notice}" if partial else notice


# ----------------------------------------------------------------------------- the chat function


@contextlib.asynccontextmanager
async def _closing(stream: AsyncIterator[Event]) -> AsyncIterator[AsyncIterator[Event]]:
    """Close the backend's iterator however we leave (Stop, error, end): that aborts the request."""
    try:
        yield stream
    finally:
        if isinstance(stream, AsyncGenerator):
            await stream.aclose()


PROGRESS_EVERY = 0.5  # seconds between updates of the speed line while an answer streams
ANSWERING = "Answering: "


def _progress_line(tokens: int, start: float, now: float) -> str:
    elapsed = max(now - start, 1e-9)
    return f"{ANSWERING}{tokens} tokens in {elapsed:.1f} s, **{tokens / elapsed:.1f} tokens/s**"


def mark_stopped(line: str) -> str:
    """The speed line after Stop (the answer's generator is cancelled and yields no more)."""
    if line and line.startswith(ANSWERING):
        return "Last answer (stopped): " + line[len(ANSWERING):]
    return "Last answer: stopped before the first token"


def _speed_line(tokens: int, start: float, first: float | None, end: float, reason: str) -> str:
    elapsed = max(end - start, 1e-9)
    line = f"Last answer: {tokens} tokens in {elapsed:.2f} s, **{tokens / elapsed:.1f} tokens/s**"
    if first is not None:
        line += f" (first token after {first - start:.2f} s)"
    if reason and reason != "stop":
        line += f", ended by {reason}"
    return line


def _number(name: str, value: object) -> float:
    try:
        number = float(value) if isinstance(value, (int, float, str)) else math.nan
    except ValueError:
        number = math.nan
    if not math.isfinite(number):
        raise InvalidRequestError(f"{name} must be a number, got {value!r}", param=name)
    return number


def chat_params(limits: Limits, temperature: object, top_p: object, max_tokens: object,
                constraint: Constraint | None = None) -> SamplingParams:
    """The sampling settings of one chat turn, checked against the same `limits` as /v1."""
    params = SamplingParams(temperature=_number("temperature", temperature),
                            top_p=_number("top_p", top_p),
                            max_tokens=int(_number("max_tokens", max_tokens)),
                            constraint=constraint)
    limits.check_sampling(temperature=params.temperature, top_k=None, n=None,
                          max_tokens=params.max_tokens)
    params.validate()
    return params


# ----------------------------------------------------------------------------- structured answers


def _box_json(box: str, text: str, limits: Limits, want: str) -> JSONValue:
    """The JSON value a settings box holds; a readable error naming the box when it is none."""
    limits.check_text(box, len(text), limits.max_conversation_chars, f"The {box} box")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"{box}: not valid JSON ({exc.msg} at line {exc.lineno}, "
                                  f"column {exc.colno}); {want}", param=box) from None


def _json_type(value: object) -> str:
    """The JSON name of a value's type, for errors."""
    names = {dict: "an object", list: "a list", str: "a string", bool: "true/false",
             int: "a number", float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def answer_constraint(text: object, limits: Limits | None = None) -> Constraint | None:
    """What the "JSON answer" box asks for: empty, free text (None); `json` or `{}`, any JSON
    object; otherwise the JSON schema it holds, which the answer must match."""
    raw = text.strip() if isinstance(text, str) else ""
    if not raw:
        return None
    if raw.lower() == "json":
        return Constraint("json_object", param=JSON_BOX)
    want = "leave it empty for free text, write json for any JSON object, or give a JSON schema"
    schema = _box_json(JSON_BOX, raw, limits or Limits(), want)
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"{JSON_BOX}: a JSON schema is a JSON object ({{...}}), got "
                                  f"{_json_type(schema)}; {want}", param=JSON_BOX)
    if not schema:
        return Constraint("json_object", param=JSON_BOX)
    return Constraint("json_schema", schema, param=JSON_BOX)


_TOOL_KEYS = ("name", "description", "parameters", "strict")


def _tool(i: int, item: JSONValue, names: set[str]) -> ToolSpec:
    """Tool `i` of the "Tools" box as an OpenAI function tool (a bare function is wrapped)."""
    where = f"{TOOLS_BOX}: tool {i + 1}"
    if not isinstance(item, dict):
        raise InvalidRequestError(f"{where} is {_json_type(item)}, not an object", TOOLS_BOX)
    fn = item
    if "type" in item or "function" in item:
        if item.get("type") != "function" or not isinstance(item.get("function"), dict):
            raise InvalidRequestError(f'{where} must be {{"type": "function", "function": '
                                      '{...}} or a bare function {"name", "description", '
                                      '"parameters"}', TOOLS_BOX)
        inner = item["function"]
        fn = inner if isinstance(inner, dict) else {}  # (checked just above)
    unknown = sorted(set(fn) - set(_TOOL_KEYS))
    if unknown:
        raise InvalidRequestError(f"{where} has unknown keys ({', '.join(unknown)}); a function "
                                  f"has {', '.join(_TOOL_KEYS)}", TOOLS_BOX)
    name = fn.get("name")
    if not isinstance(name, str) or not name.strip():
        raise InvalidRequestError(f'{where} needs a "name" (a non-empty string)', TOOLS_BOX)
    if name in names:
        raise InvalidRequestError(f"{where}: another tool is named {name!r} too", TOOLS_BOX)
    names.add(name)
    function: FunctionSpec = {"name": name}
    for key, kind, what in (("description", str, "a string"), ("parameters", dict,
                                                                "a JSON schema object"),
                            ("strict", bool, "true or false")):
        value = fn.get(key)
        if value is not None and not isinstance(value, kind):
            raise InvalidRequestError(f"{where} ({name}): {key} must be {what}, got "
                                      f"{_json_type(value)}", TOOLS_BOX)
    description, parameters, strict = fn.get("description"), fn.get("parameters"), fn.get(
        "strict")
    if isinstance(description, str):
        function["description"] = description
    if isinstance(parameters, dict):
        function["parameters"] = parameters
    if isinstance(strict, bool):
        function["strict"] = strict
    return {"type": "function", "function": function}


def chat_tools(text: object, limits: Limits | None = None) -> list[ToolSpec] | None:
    """The tools of the "Tools" box, as OpenAI function tools: None when empty; else a JSON
    list of tools (or one tool), each `{"type": "function", "function": {...}}` or the bare
    function `{"name", "description", "parameters"}`."""
    raw = text.strip() if isinstance(text, str) else ""
    if not raw:
        return None
    want = ('give a list of functions such as [{"name": "get_weather", "description": "...", '
            '"parameters": {"type": "object", "properties": {...}}}], or leave it empty')
    value = _box_json(TOOLS_BOX, raw, limits or Limits(), want)
    items = [value] if isinstance(value, dict) else value
    if not isinstance(items, list) or not items:
        raise InvalidRequestError(f"{TOOLS_BOX}: got {_json_type(value)}"
                                  f"{' with no tools' if value == [] else ''}; {want}",
                                  param=TOOLS_BOX)
    names: set[str] = set()
    return [_tool(i, item, names) for i, item in enumerate(items)]


def _pretty_arguments(arguments: str) -> str:
    """A call's arguments for the chat: indented JSON in a code block (as written while they
    are still incomplete)."""
    try:
        arguments = json.dumps(json.loads(arguments), indent=2, ensure_ascii=False)
    except ValueError:
        pass
    return f"```json\n{arguments}\n```"


def tool_call_message(name: str, arguments: str) -> ShownMessage:
    """A tool call as a chat message: a collapsible block titled with the function's name that
    holds its arguments. It has no "pending" status while it streams: a spinner would stay on
    after Stop, which ends the answer without a last update."""
    return {"role": "assistant", "content": _pretty_arguments(arguments),
            "metadata": {"title": TOOL_CALL_TITLE + name}}


@dataclass
class _Answer:
    """What the chat shows of one answer: the note on left-out turns (`lead`), a thinking
    model's thought, its text, and, when the turn has tools, the calls a parser reads out of
    the model's text."""

    lead: str = ""
    tools: set[str] | None = None
    parallel: bool = True
    text: str = ""
    thought: str = ""
    calls: list[tuple[str, str]] = field(default_factory=list)  # (name, arguments so far)
    parser: ToolCallParser | None = None
    splitter: ReasoningSplitter | None = None

    def started(self, tool_format: str | None, reasoning: bool = False,
                thought_open: bool = False) -> None:
        """Read calls in the format the backend says the model writes (Hermes if unsaid),
        and the thought apart when the model thinks."""
        if self.tools and self.parser is None:
            self.parser = FORMATS.get(tool_format or "", HERMES).parser(self.tools,
                                                                        self.parallel)
        if reasoning and self.splitter is None:
            self.splitter = ReasoningSplitter(thought_open)

    def add(self, delta: str) -> bool:
        """Take new model text; True when what the chat shows changed."""
        thought = ""
        if self.splitter is not None:
            thought, delta = self.splitter.feed(delta)
            self.thought += thought
        return self._answer(delta) or bool(thought)

    def _answer(self, delta: str) -> bool:
        if not self.tools:
            self.text += delta
            return bool(delta)
        self.started(None)
        assert self.parser is not None
        return self._apply(self.parser.feed(delta))

    def finish(self) -> None:
        """The answer ended: what the splitter and the parser held back is shown now."""
        if self.splitter is not None:
            thought, rest = self.splitter.finish()
            self.thought += thought
            self._answer(rest)
        if self.parser is not None:
            self._apply(self.parser.finish())

    def _apply(self, pieces: list[Piece]) -> bool:
        for p in pieces:
            if p.kind == "content":
                self.text += p.text
            elif p.kind == "start":
                self.calls.append((p.name, ""))
            elif p.kind == "args" and p.index < len(self.calls):
                name, args = self.calls[p.index]
                self.calls[p.index] = (name, args + p.text)
        return bool(pieces)

    def shown(self, error: str | None = None) -> str | list[ShownMessage]:
        """The chat's value for the answer: its text (with `error` after it) while it has no
        calls or thought, as ever; else a list of messages: the thought (collapsed), the text,
        one per call, then the error."""
        if not self.calls and not self.thought:
            if error is None:
                return self.lead + self.text
            return _error_text(self.lead + self.text if self.text else "", error)
        out: list[ShownMessage] = []
        if self.thought:
            out.append({"role": "assistant", "content": self.thought,
                        "metadata": {"title": THOUGHT_TITLE, "status": "done"}})
        text = self.text.strip()  # the space between text and calls is no part of either
        if self.lead or text:
            out.append({"role": "assistant", "content": self.lead + text})
        out += [tool_call_message(name, args) for name, args in self.calls]
        if error is not None:
            out.append({"role": "assistant", "content": ERROR_PREFIX + error})
        return out


class UILogin:
    """The UI's login check (gradio `auth`): any user name, and one of the API keys or the UI
    password as password. It remembers which key each user name logged in with, so that the
    rate limit counts a user's chat turns in the bucket of that key, which /v1 requests with
    the key share."""

    def __init__(self, keys: KeyAuth | None = None, password: str | None = None):
        self.keys = keys if keys else None
        self._password = hashlib.sha256(password.encode()).digest() if password else None
        self._key_of: dict[str, str] = {}  # user name -> id of the key of its latest login

    def __bool__(self) -> bool:
        return self.keys is not None or self._password is not None

    def __call__(self, username: str, password: str) -> bool:
        key_id = self.keys.match(password) if self.keys is not None else None
        if key_id is not None:
            self._key_of[username] = key_id
            return True
        digest = hashlib.sha256(password.encode()).digest()
        if self._password is None or not hmac.compare_digest(digest, self._password):
            return False
        self._key_of.pop(username, None)  # a password login: counted by client address
        return True

    def key_of(self, username: str | None) -> str | None:
        return self._key_of.get(username) if username is not None else None

    @property
    def message(self) -> str:
        if self.keys is not None and self._password is not None:
            return "This chat needs a login: any user name, and the password or an API key."
        if self.keys is not None:
            return "This server needs an API key: enter any user name and the key as password."
        return "This chat needs a password: enter any user name and the password."


def rate_limit_client(request: object, login: UILogin | None) -> str:
    """Whose bucket a chat turn takes from: the key the user logged in with, else the client
    address (what /v1 uses without a key)."""
    # `request` is gradio's (None when the chat function is called directly): its user name
    # and client are there only when gradio knows them
    key_id = login.key_of(getattr(request, "username", None)) if login is not None else None
    if key_id is not None:
        return key_id
    client = getattr(request, "client", None)
    return getattr(client, "host", None) or "unknown"


def _token_counter(backend: Backend, params: SamplingParams,
                   tools: list[ToolSpec] | None = None
                   ) -> Callable[[list[Message]], int | None]:
    """Counts a conversation's prompt tokens through the backend (with the tools, which the
    prompt describes); None where the backend cannot."""
    return lambda messages: backend.count_prompt_tokens(
        Request(messages=_chat_messages(messages), params=params, tools=tools))


def _chat_messages(messages: Sequence[Message]) -> list[ChatMessage]:
    """The chat's text messages as the backend takes them."""
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _max_context(backend: Backend) -> int | None:
    limit = backend.max_context
    if limit is None:
        try:
            found = backend.stats().get("max_context")
        except Exception:  # noqa: BLE001 -- a backend without stats: no context known
            found = None
        limit = found if isinstance(found, int) else None
    return int(limit) if limit else None


def _calls_note(answer: _Answer) -> str:
    """The speed line's note on the calls of an answer ("" without any)."""
    n = len(answer.calls)
    return "" if not n else f", {n} tool call{'s' if n > 1 else ''}"


def make_chat_fn(backend: Backend, *, limits: Limits | None = None,
                 rate_limiter: RateLimiter | None = None, login: UILogin | None = None,
                 tool_choice: Literal["auto", "required"] = "auto"):
    """The async generator Gradio calls: yields (cumulative answer, stats line).

    Each turn takes one request from `rate_limiter` (the app's, shared with /v1), is checked
    against `limits` (default `Limits()`), and leaves out the oldest turns that do not fit;
    a refusal is shown in the chat. The answer is the text so far, or, once the model calls
    tools (given in the "Tools" box; `tool_choice` "required" makes it call one at least), a
    list of chat messages: the text, then one per call (see `tool_call_message`).
    """
    limits = limits or Limits()

    async def chat(message: object, history: list[dict[str, object]], system_prompt: str = "",
                   temperature: float = 0.7, top_p: float = 0.95,
                   max_tokens: float = DEFAULT_MAX_TOKENS, json_answer: str = "",
                   tools_json: str = "", request: gr.Request | None = None
                   ) -> AsyncIterator[tuple[str | list[ShownMessage], str | dict[str, object]]]:
        answer = _Answer()
        tokens, first, reason = 0, None, ""
        start = time.perf_counter()
        shown = 0.0  # when the speed line last showed progress
        try:
            if rate_limiter is not None:
                rate_limiter.check(rate_limit_client(request, login))
            params = chat_params(limits, temperature, top_p, max_tokens,
                                 answer_constraint(json_answer, limits))
            tools = chat_tools(tools_json, limits)
            fitted = fit_conversation(to_messages(message, history, system_prompt),
                                      limits=limits, max_tokens=params.max_tokens or 1,
                                      count_tokens=_token_counter(backend, params, tools),
                                      max_context=_max_context(backend))
            answer.lead = fitted.note + "\n\n" if fitted.note else ""
            answer.tools = {t["function"]["name"] for t in tools} if tools else None
            generation = Request(messages=_chat_messages(fitted.messages), params=params,
                                 tools=tools,
                                 tool_choice=tool_choice if tools else "auto",
                                 metadata={"source": "ui"})
            async with _closing(backend.generate(generation)) as stream:
                async for ev in stream:
                    if isinstance(ev, Started):
                        answer.started(ev.tool_format, ev.reasoning, ev.thought_open)
                    elif isinstance(ev, Delta) and ev.index == 0:
                        tokens += len(ev.token_ids)
                        first = first or time.perf_counter()
                        now = time.perf_counter()
                        changed = answer.add(ev.text)
                        if now - shown >= PROGRESS_EVERY:
                            shown = now
                            yield answer.shown(), _progress_line(tokens, start, now)
                        elif changed:
                            yield answer.shown(), gr.skip()
                    elif isinstance(ev, Finished) and ev.index == 0:
                        reason = ev.reason
                        tokens = ev.usage.completion_tokens or tokens
                        answer.finish()
                    elif isinstance(ev, ErrorEvent):
                        yield answer.shown(ev.message), FAILED_LINE
                        return
        except (NbserveError, APIError) as exc:  # refused: too long, busy, bad settings, limits
            yield answer.shown(str(exc)), FAILED_LINE
            return
        except Exception as exc:  # a bug, not the user's fault: log it, show one line
            log.exception("chat UI request failed")
            yield answer.shown(f"internal error ({type(exc).__name__}: {exc})"), FAILED_LINE
            return
        line = _speed_line(tokens, start, first, time.perf_counter(), reason)
        yield answer.shown(), line + _calls_note(answer)

    return chat


# ----------------------------------------------------------------------------- building


def _max_tokens_range(backend: Backend, limits: Limits) -> tuple[int, int]:
    """(slider maximum, default): up to the context and the limit; by default at most half
    the context, so that a chat keeps some history."""
    context = _max_context(backend) or limits.max_tokens
    top = max(1, min(context, limits.max_tokens))
    return top, max(1, min(DEFAULT_MAX_TOKENS, top, context // 2))


def _header(backend: Backend, title: str | None) -> str:
    return f"## {title or 'nbserve'}\nModel: `{backend.model_name}`"


def build_chat_ui(backend: Backend, *, title: str | None = None, limits: Limits | None = None,
                  rate_limiter: RateLimiter | None = None,
                  login: UILogin | None = None) -> gr.Blocks:
    """A chat window for `backend`: streaming, multi-turn, with sampling settings, a JSON answer
    and tools, and Stop; its turns obey `limits` and `rate_limiter` (see `make_chat_fn`)."""
    limits = limits or Limits()
    top, default = _max_tokens_range(backend, limits)
    page_title = title or f"nbserve · {backend.model_name}"
    with gr.Blocks(title=page_title, analytics_enabled=False, fill_height=True) as demo:
        header = gr.Markdown(_header(backend, title), elem_id="nbserve-model")
        speed = gr.Markdown("Last answer: none yet", elem_id="nbserve-speed")
        # render=False: ChatInterface puts them in its accordion
        settings: list[str | gr.components.Component] = [
            gr.Textbox("", label="System prompt", lines=2, render=False,
                       placeholder="Empty: the model's default system prompt"),
            gr.Slider(limits.min_temperature, limits.max_temperature,
                      value=min(max(0.7, limits.min_temperature), limits.max_temperature),
                      step=0.05, label="Temperature", render=False),
            gr.Slider(0.05, 1.0, value=0.95, step=0.05, label="Top p", render=False),
            gr.Slider(1, top, value=default, step=1, label="Max tokens", render=False),
            gr.Textbox("", label=JSON_BOX, lines=2, max_lines=12, render=False,
                       placeholder="Empty: free text. json: any JSON object. Or a JSON schema "
                       "that the answer must match"),
            gr.Textbox("", label=TOOLS_BOX, lines=2, max_lines=12, render=False,
                       placeholder='Empty: none. Or a JSON list of functions the model may '
                       'call: [{"name": ..., "description": ..., "parameters": {...}}]'),
        ]
        chat = gr.ChatInterface(
            make_chat_fn(backend, limits=limits, rate_limiter=rate_limiter, login=login),
            chatbot=gr.Chatbot(label="Chat", render=False,
                               placeholder="Ask the model anything. Stop ends an answer early."),
            textbox=gr.Textbox(placeholder="Type a message...", submit_btn=True, stop_btn=True,
                               autofocus=True, scale=7, elem_id="nbserve-input", render=False),
            additional_inputs=settings,
            additional_inputs_accordion=gr.Accordion("Model settings", open=False, render=False),
            additional_outputs=[speed],
            api_name=API_NAME,
            concurrency_limit=None,
            analytics_enabled=False,
            fill_height=True,
        )
        chat.textbox.stop(mark_stopped, [speed], [speed], queue=False,
                          api_visibility="undocumented")
        # The model can be swapped while serving (Server.update): show the current name.
        demo.load(lambda: _header(backend, title), None, header, queue=False,
                  show_progress="hidden", api_visibility="undocumented")
    return demo


def mount_ui(app: FastAPI, backend: Backend, path: str = "/",
             auth_keys: Sequence[str] | None = None, *, title: str | None = None,
             password: str | None = None) -> FastAPI:
    """Mount the chat on `app` at `path`; call it after the /v1 routes are registered.

    The chat uses the app's `Limits` and rate limiter (`app.state.limits`,
    `app.state.rate_limiter`, set by `create_app`). It asks for a login (any user name) when
    the app has API keys (`app.state.key_auth`; or `auth_keys`, if given, instead) or a
    `password` is set: one of the keys or the password is accepted as password.
    """
    if password is not None and (not isinstance(password, str) or not password.strip()):
        raise ValueError("mount_ui(password=...) must be a non-empty string (or None)")
    keys = [k for k in (auth_keys or []) if k]
    # create_app's state (an app of the caller's own has none of it)
    key_auth = KeyAuth(keys) if keys else getattr(app.state, "key_auth", None)
    login = UILogin(key_auth, password)
    demo = build_chat_ui(backend, title=title, limits=getattr(app.state, "limits", None),
                         rate_limiter=getattr(app.state, "rate_limiter", None),
                         login=login if login else None)
    gr.mount_gradio_app(
        app, demo, path=path, auth=login if login else None, run_history=False,
        auth_message=login.message if login else None,
        footer_links=["api", "settings"],
    )
    calm_queue(demo)
    return app


QUEUE_POLL_S = 0.02  # how often an idle UI queue looks for new chat events
PROGRESS_POLL_S = 0.1  # and for progress to send


def calm_queue(demo: gr.Blocks) -> None:
    """Make gradio's event queue poll every QUEUE_POLL_S instead of every millisecond (and
    its progress loop every PROGRESS_POLL_S instead of 10 ms). Those loops run on the server's
    event loop even with nobody in the UI: a thousand wake-ups a second take the GIL and a
    core's time slices from the engine's kernels. A chat event starts at most 20 ms later."""
    queue = getattr(demo, "_queue", None)
    if queue is None:
        return
    if hasattr(queue, "sleep_when_free"):
        queue.sleep_when_free = max(queue.sleep_when_free, QUEUE_POLL_S)
    if hasattr(queue, "progress_update_sleep_when_free"):
        queue.progress_update_sleep_when_free = max(queue.progress_update_sleep_when_free,
                                                    PROGRESS_POLL_S)


# ----------------------------------------------------------------------------- shutdown


def _gradio_apps(app: FastAPI) -> list[App]:
    from gradio.routes import App

    return [r.app for r in app.routes if isinstance(r, Mount) and isinstance(r.app, App)]


def reset_ui(app: FastAPI) -> None:
    """Give each mounted UI a fresh stop event; call on the loop that will serve `app`."""
    for gradio_app in _gradio_apps(app):
        gradio_app.stop_event = asyncio.Event()


def stop_ui(app: FastAPI, loop: asyncio.AbstractEventLoop | None = None) -> None:
    """End the UI's heartbeat streams (which otherwise hold shutdown for its whole timeout).

    `loop` is the loop serving `app`; the event is set on it, so this is safe from any thread.
    """
    for gradio_app in _gradio_apps(app):
        event = gradio_app.stop_event
        if loop is not None and loop.is_running():
            loop.call_soon_threadsafe(event.set)
        else:
            event.set()
