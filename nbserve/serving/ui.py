"""The Gradio chat: a streaming `gr.ChatInterface` that calls the backend's `generate` directly.

`build_chat_ui(backend)` makes the Blocks, `mount_ui(app, backend)` puts them on a FastAPI app
(after its /v1 routes), and `stop_ui(app)` ends the UI's long-lived connections so that the
server can shut down at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import gradio as gr
from fastapi import FastAPI

from ..types import (
    Backend,
    Delta,
    ErrorEvent,
    Finished,
    NbserveError,
    Request,
    SamplingParams,
)

log = logging.getLogger("nbserve.ui")

ERROR_PREFIX = "⚠️ "
DEFAULT_MAX_TOKENS = 512
MAX_TOKENS_CAP = 4096
API_NAME = "chat"
FAILED_LINE = "Last answer: failed (the reason is in the chat)"


# ----------------------------------------------------------------------------- messages


def _text(content: Any) -> str:
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
    return str(getattr(content, "text", "") or "")


def _strip_error(text: str) -> str:
    """Drop an error notice that the UI appended to an answer, so it never reaches the model."""
    if text.startswith(ERROR_PREFIX):
        return ""
    cut = text.find("\n\n" + ERROR_PREFIX)
    return text if cut < 0 else text[:cut]


def to_messages(message: Any, history: Sequence[dict[str, Any]],
                system_prompt: str | None = None) -> list[dict[str, str]]:
    """OpenAI-style messages for the model: system prompt, past turns, then the new message."""
    messages: list[dict[str, str]] = []
    if system_prompt and system_prompt.strip():
        messages.append({"role": "system", "content": system_prompt.strip()})
    for turn in history:
        role = turn.get("role")
        text = _text(turn.get("content"))
        if role == "assistant":
            text = _strip_error(text)
        if role in ("user", "assistant") and text:
            messages.append({"role": role, "content": text})
    messages.append({"role": "user", "content": _text(message)})
    return messages


def _error_text(partial: str, message: str) -> str:
    notice = ERROR_PREFIX + message
    return f"{partial}\n\n{notice}" if partial else notice


# ----------------------------------------------------------------------------- the chat function


@contextlib.asynccontextmanager
async def _closing(stream: AsyncIterator[Any]) -> AsyncIterator[AsyncIterator[Any]]:
    """Close the backend's iterator however we leave (Stop, error, end): that aborts the request."""
    try:
        yield stream
    finally:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()


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


def make_chat_fn(backend: Backend):
    """The async generator Gradio calls: yields (cumulative answer, stats line)."""

    async def chat(message: Any, history: list[dict[str, Any]], system_prompt: str = "",
                   temperature: float = 0.7, top_p: float = 0.95,
                   max_tokens: float = DEFAULT_MAX_TOKENS) -> AsyncIterator[tuple[str, Any]]:
        text, tokens, first, reason = "", 0, None, ""
        start = time.perf_counter()
        shown = 0.0  # when the speed line last showed progress
        try:
            params = SamplingParams(temperature=float(temperature), top_p=float(top_p),
                                    max_tokens=int(max_tokens))
            request = Request(messages=to_messages(message, history, system_prompt),
                              params=params, metadata={"source": "ui"})
            async with _closing(backend.generate(request)) as stream:
                async for ev in stream:
                    if isinstance(ev, Delta) and ev.index == 0:
                        tokens += len(ev.token_ids)
                        first = first or time.perf_counter()
                        now = time.perf_counter()
                        text += ev.text
                        if now - shown >= PROGRESS_EVERY:
                            shown = now
                            yield text, _progress_line(tokens, start, now)
                        elif ev.text:
                            yield text, gr.skip()
                    elif isinstance(ev, Finished) and ev.index == 0:
                        reason = ev.reason
                        tokens = ev.usage.completion_tokens or tokens
                    elif isinstance(ev, ErrorEvent):
                        yield _error_text(text, ev.message), FAILED_LINE
                        return
        except NbserveError as exc:  # refused: too long, busy, bad settings, stopped
            yield _error_text(text, str(exc)), FAILED_LINE
            return
        except Exception as exc:  # a bug, not the user's fault: log it, show one line
            log.exception("chat UI request failed")
            yield _error_text(text, f"internal error ({type(exc).__name__}: {exc})"), FAILED_LINE
            return
        yield text, _speed_line(tokens, start, first, time.perf_counter(), reason)

    return chat


# ----------------------------------------------------------------------------- building


def _max_tokens_limit(backend: Backend) -> int:
    limit = getattr(backend, "max_context", None)
    if not isinstance(limit, int):
        try:
            limit = backend.stats().get("max_context")
        except Exception:  # noqa: BLE001 -- a backend without stats: use the API's cap
            limit = None
    return max(1, min(int(limit or MAX_TOKENS_CAP), MAX_TOKENS_CAP))


def _header(backend: Backend, title: str | None) -> str:
    return f"## {title or 'nbserve'}\nModel: `{backend.model_name}`"


def build_chat_ui(backend: Backend, *, title: str | None = None) -> gr.Blocks:
    """A chat window for `backend`: streaming, multi-turn, with sampling settings and Stop."""
    limit = _max_tokens_limit(backend)
    page_title = title or f"nbserve · {backend.model_name}"
    with gr.Blocks(title=page_title, analytics_enabled=False, fill_height=True) as demo:
        header = gr.Markdown(_header(backend, title), elem_id="nbserve-model")
        speed = gr.Markdown("Last answer: none yet", elem_id="nbserve-speed")
        settings = [  # render=False: ChatInterface puts them in its accordion
            gr.Textbox("", label="System prompt", lines=2, render=False,
                       placeholder="Empty: the model's default system prompt"),
            gr.Slider(0.0, 2.0, value=0.7, step=0.05, label="Temperature", render=False),
            gr.Slider(0.05, 1.0, value=0.95, step=0.05, label="Top p", render=False),
            gr.Slider(1, limit, value=min(DEFAULT_MAX_TOKENS, limit), step=1,
                      label="Max tokens", render=False),
        ]
        chat = gr.ChatInterface(
            make_chat_fn(backend),
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


def _key_checker(keys: Sequence[str]):
    def check(_username: str, password: str) -> bool:
        return any(hmac.compare_digest(password.encode(), k.encode()) for k in keys)

    return check


def mount_ui(app: FastAPI, backend: Backend, path: str = "/",
             auth_keys: Sequence[str] | None = None, *, title: str | None = None) -> FastAPI:
    """Mount the chat on `app` at `path`; call it after the /v1 routes are registered.

    With `auth_keys`, the UI asks for a login: any user name, and one of the keys as password.
    """
    keys = [k for k in (auth_keys or []) if k]
    demo = build_chat_ui(backend, title=title)
    auth = _key_checker(keys) if keys else None
    gr.mount_gradio_app(
        app, demo, path=path, auth=auth, run_history=False,
        auth_message="This server needs an API key: enter any user name and the key as password."
        if keys else None,
        footer_links=["api", "settings"],
    )
    return app


# ----------------------------------------------------------------------------- shutdown


def _gradio_apps(app: FastAPI) -> list[Any]:
    from gradio.routes import App

    return [r.app for r in app.routes if isinstance(getattr(r, "app", None), App)]


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
