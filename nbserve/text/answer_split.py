"""AnswerSplit: one answer's text as it streams, split into the model's thought (a thinking
model's, apart from the answer) and the answer's pieces: its text and, with tools, its calls
(each call's start and argument fragments) read in the model's own tool-call format. The
route families that build events of their own (Responses, Messages) read answers with it."""

from __future__ import annotations

from collections.abc import Set

from .reasoning import ReasoningSplitter
from .tool_calls import FORMATS, HERMES, Piece, ToolCallParser


class AnswerSplit:
    """`reasoning` / `thought_open`: the answer may open with a thought (already opened by the
    prompt); `tool_names`: the tools a call may name (None: no tools, all text);
    `tool_format`: the model's call format (`Started.tool_format`)."""

    def __init__(self, reasoning: bool, thought_open: bool, tool_format: str | None,
                 tool_names: Set[str] | None, parallel: bool = True):
        self.thought = ReasoningSplitter(thought_open) if reasoning else None
        self.calls: ToolCallParser | None = None
        if tool_names:
            fmt = FORMATS.get(tool_format or "", HERMES)
            self.calls = fmt.parser(set(tool_names), parallel)

    @property
    def in_thought(self) -> bool:
        """Whether the text read so far ends inside the thought."""
        return self.thought is not None and self.thought.in_thought

    def feed(self, text: str, final: bool = False) -> tuple[str, list[Piece]]:
        """(the thought's new text, the answer's new pieces) of `text`; `final` flushes what
        was held back (a partial marker, a call not closed)."""
        thought = ""
        if self.thought is not None:
            thought, text = self.thought.finish() if final else self.thought.feed(text)
        if self.calls is None:
            return thought, [Piece("content", text)]
        pieces = self.calls.feed(text) if text else []
        if final:
            pieces += self.calls.finish()
        return thought, pieces
