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
import logging
import os
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Literal

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import gradio as gr
from fastapi import FastAPI
from starlette.routing import Mount, Router
from starlette.types import ASGIApp

from ..api.auth import KeyAuth, RateLimiter
from ..api.errors import APIError
from ..api.limits import Limits
from ..types import (
    Backend,
    ChatMessage,
    Delta,
    ErrorEvent,
    Event,
    Finished,
    ModelDirectory,
    NbserveError,
    Request,
    SamplingParams,
    Started,
    ToolSpec,
)
from .ui_answer import Answer, ShownMessage, to_messages
from .ui_compare import make_compare_fn
from .ui_context import Message, fit_conversation
from .ui_settings import JSON_BOX, TOOLS_BOX, answer_constraint, chat_params, chat_tools

if TYPE_CHECKING:
    from gradio.routes import App

log = logging.getLogger("nbserve.ui")

DEFAULT_MAX_TOKENS = 512
API_NAME = "chat"
FAILED_LINE = "Last answer: failed (the reason is in the chat)"


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


def loading_line(model: str) -> str:
    """The speed line while a model that is not loaded loads for this turn."""
    return f"Loading {model} (its first request loads it)..."


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


def _calls_note(answer: Answer) -> str:
    """The speed line's note on the calls of an answer ("" without any)."""
    n = len(answer.calls)
    return "" if not n else f", {n} tool call{'s' if n > 1 else ''}"


def make_chat_fn(backend: Backend, *, limits: Limits | None = None,
                 rate_limiter: RateLimiter | None = None, login: UILogin | None = None,
                 tool_choice: Literal["auto", "required"] = "auto",
                 models: ModelDirectory | None = None):
    """The async generator Gradio calls: yields (cumulative answer, stats line).

    Each turn takes one request from `rate_limiter` (the app's, shared with /v1), is checked
    against `limits` (default `Limits()`), and leaves out the oldest turns that do not fit;
    a refusal is shown in the chat. The answer is the text so far, or, once the model calls
    tools (given in the "Tools" box; `tool_choice` "required" makes it call one at least), a
    list of chat messages: the text, then one per call (see `tool_call_message`). With
    `models`, `model` picks which of the server's models answers ("": the default).
    """
    limits = limits or Limits()

    async def chat(message: object, history: list[dict[str, object]], system_prompt: str = "",
                   temperature: float = 0.7, top_p: float = 0.95,
                   max_tokens: float = DEFAULT_MAX_TOKENS, json_answer: str = "",
                   tools_json: str = "", model: str = "", request: gr.Request | None = None
                   ) -> AsyncIterator[tuple[str | list[ShownMessage], str | dict[str, object]]]:
        answer = Answer()
        tokens, first, reason = 0, None, ""
        start = time.perf_counter()
        shown = 0.0  # when the speed line last showed progress
        try:
            if rate_limiter is not None:
                rate_limiter.check(rate_limit_client(request, login))
            if models is not None and model and models.loaded(model) is None:
                yield answer.shown(), loading_line(model)  # its first request loads it
            serving = await models.backend(model) if models is not None else backend
            params = chat_params(limits, temperature, top_p, max_tokens,
                                 answer_constraint(json_answer, limits))
            tools = chat_tools(tools_json, limits)
            fitted = fit_conversation(to_messages(message, history, system_prompt),
                                      limits=limits, max_tokens=params.max_tokens or 1,
                                      count_tokens=_token_counter(serving, params, tools),
                                      max_context=_max_context(serving))
            answer.lead = fitted.note + "\n\n" if fitted.note else ""
            answer.tools = {t["function"]["name"] for t in tools} if tools else None
            generation = Request(messages=_chat_messages(fitted.messages), params=params,
                                 tools=tools,
                                 tool_choice=tool_choice if tools else "auto",
                                 metadata={"source": "ui"})
            async with _closing(serving.generate(generation)) as stream:
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


def _model_choices(models: ModelDirectory | None) -> list[str]:
    return [e.name for e in models.entries()] if models is not None else []


def build_chat_ui(backend: Backend, *, title: str | None = None, limits: Limits | None = None,
                  rate_limiter: RateLimiter | None = None,
                  login: UILogin | None = None, models: ModelDirectory | None = None
                  ) -> gr.Blocks:
    """A chat window for `backend`: streaming, multi-turn, with sampling settings, a JSON answer
    and tools, and Stop; its turns obey `limits` and `rate_limiter` (see `make_chat_fn`).
    With `models` holding several, a model picker and a Compare tab (one prompt to two
    models, side by side: `ui_compare.py`)."""
    limits = limits or Limits()
    top, default = _max_tokens_range(backend, limits)
    page_title = title or f"nbserve · {backend.model_name}"
    choices = _model_choices(models)
    several = len(choices) > 1
    with gr.Blocks(title=page_title, analytics_enabled=False, fill_height=True) as demo:
        header = gr.Markdown(_header(backend, title), elem_id="nbserve-model")
        picker = gr.Dropdown(choices, value=choices[0], label="Model", visible=several,
                             elem_id="nbserve-picker", allow_custom_value=True) \
            if choices else None
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
            *([picker] if picker is not None else []),  # rendered above: it stays there
        ]
        chat = gr.ChatInterface(
            make_chat_fn(backend, limits=limits, rate_limiter=rate_limiter, login=login,
                         models=models),
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
        if models is not None and picker is not None:
            compare = _compare_tab(models, choices, limits, rate_limiter, login, top)

            def on_load() -> tuple[dict[str, object], dict[str, object]]:
                """Models added or removed since: the picker and Compare follow."""
                names = _model_choices(models)
                return (gr.update(choices=names, visible=len(names) > 1),
                        gr.update(visible=len(names) > 1))

            demo.load(on_load, None, [picker, compare], queue=False, show_progress="hidden",
                      api_visibility="undocumented")
    return demo


def _compare_tab(models: ModelDirectory, choices: list[str], limits: Limits,
                 rate_limiter: RateLimiter | None, login: UILogin | None, top: int
                 ) -> gr.Accordion:
    """The side-by-side mode, in an accordion under the chat (hidden with one model)."""
    with gr.Accordion("Compare two models side by side", open=False,
                      visible=len(choices) > 1, elem_id="nbserve-compare") as box:
        with gr.Row():
            model_a = gr.Dropdown(choices, value=choices[0] if choices else None,
                                  label="Model A", allow_custom_value=True)
            model_b = gr.Dropdown(choices, value=choices[1] if len(choices) > 1 else None,
                                  label="Model B", allow_custom_value=True)
        with gr.Row():
            prompt = gr.Textbox(label="Prompt", lines=2, scale=5,
                                elem_id="nbserve-compare-prompt")
            temperature = gr.Slider(limits.min_temperature, limits.max_temperature, value=0.0,
                                    step=0.05, label="Temperature", scale=1)
            max_tokens = gr.Slider(1, top, value=min(256, top), step=1,
                                   label="Max tokens", scale=1)
        send = gr.Button("Send to both", variant="primary", elem_id="nbserve-compare-send")
        with gr.Row():
            with gr.Column():
                answer_a = gr.Markdown(elem_id="nbserve-compare-a")
                line_a = gr.Markdown(elem_id="nbserve-compare-a-speed")
            with gr.Column():
                answer_b = gr.Markdown(elem_id="nbserve-compare-b")
                line_b = gr.Markdown(elem_id="nbserve-compare-b-speed")
        fn = make_compare_fn(models, limits=limits, rate_limiter=rate_limiter,
                             client_of=lambda request: rate_limit_client(request, login))
        send.click(fn, [prompt, model_a, model_b, temperature, max_tokens],
                   [answer_a, answer_b, line_a, line_b], api_name="compare",
                   concurrency_limit=None)
    return box


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
                         login=login if login else None,
                         models=getattr(app.state, "models", None))
    gr.mount_gradio_app(
        app, demo, path=path, auth=login if login else None, run_history=False,
        auth_message=login.message if login else None,
        footer_links=["api", "settings"],
    )
    calm_queue(demo)
    return app


def mount_ui_late(app: FastAPI, backend: Backend, *,
                  password: str | None = None) -> ASGIApp:
    """Mount the chat (as `mount_ui`) on an app whose lifespan already runs, so the API can
    serve before gradio is even imported; returns an ASGI app whose lifespan is the chat's
    own startup and shutdown (gradio's queue), for the caller to run beside the app's."""
    served = app.router.lifespan_context
    app.router.lifespan_context = _no_lifespan  # what gradio wraps: the chat's part alone
    try:
        mount_ui(app, backend, password=password)
        chat_lifespan = app.router.lifespan_context
    finally:
        app.router.lifespan_context = served
    return Router(lifespan=chat_lifespan)


@contextlib.asynccontextmanager
async def _no_lifespan(app: object) -> AsyncIterator[None]:
    yield


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
