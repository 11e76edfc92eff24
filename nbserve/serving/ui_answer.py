"""What the chat UI shows of a conversation and of one answer: the chat's history as the
engine's messages (`to_messages`), an answer's text, collapsed thought and tool calls
(`ShownMessage`, `tool_call_message`), and the notices an error adds."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypedDict

from ..text.reasoning import ReasoningSplitter
from ..text.tool_calls import FORMATS, HERMES, Piece, ToolCallParser
from .ui_context import NOTE_START, Message

ERROR_PREFIX = "⚠️ "
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



# ----------------------------------------------------------------------------- an answer


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
class Answer:
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

