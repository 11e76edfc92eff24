"""Thoughts apart from the answer, for models that think between `<think>` and `</think>`
(Qwen3, SmolLM3, the DeepSeek-R1 distills, QwQ).

A template that writes the tags says the model is one of them (`thinks`). Some templates open
the thought in the generation prompt (the R1 distills end it with `<think>\\n`), so the answer
starts inside it (`starts_inside`); `thought_rule` says how a constrained answer may think.
`ReasoningSplitter` then cuts a streamed answer into reasoning and content as it comes,
holding back only what may be the start of a tag.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

OPEN, CLOSE = "<think>", "</think>"


def thinks(template_source: str | None) -> bool:
    """Whether a chat template is a reasoning model's (it writes thinking tags)."""
    src = template_source or ""
    return CLOSE in src or OPEN in src


def starts_inside(prompt_text: str) -> bool:
    """Whether a rendered prompt leaves the answer inside an open thought."""
    tail = prompt_text.rstrip()
    return tail.endswith(OPEN)


ThoughtRule = Literal["open", "optional", "none"]


def thought_rule(prompt_text: str, thinking: bool = True) -> ThoughtRule:
    """How a thinking model's answer may think, read off the end of its rendered prompt:
    `open`, the prompt opened the thought and the answer must close it; `none`, thinking is
    off (`thinking` False: the request's `enable_thinking`, or the empty thought that a
    template writes then ends the prompt); `optional`, the answer may start with a thought."""
    if starts_inside(prompt_text):
        return "open"
    if not thinking or prompt_text.rstrip().endswith(CLOSE):
        return "none"
    return "optional"


def _partial(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


@dataclass
class ReasoningSplitter:
    """`feed(text)` -> (reasoning, content) as soon as each is certain; `finish()` at the end.

    A thought is recognised at the very start of the answer (after whitespace) or from the
    start when `inside`; the content after `</think>` starts after its leading newlines. An
    answer that starts with text is content throughout: tags inside it stay as written. A
    thought that `max_tokens` cuts is reasoning, and the content is empty.
    """

    inside: bool = False
    _state: str = "start"  # start | thought | answer | content
    _buf: str = ""
    _began: bool = False  # any of the thought sent (its leading newlines are not)

    def __post_init__(self) -> None:
        if self.inside:
            self._state = "thought"

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        reasoning, content = [], []
        while True:
            if self._state == "start":
                head = self._buf.lstrip()
                if not head:
                    break
                if head.startswith(OPEN):
                    self._buf, self._state = head[len(OPEN):], "thought"
                    continue
                if OPEN.startswith(head):
                    break  # may still become the tag
                self._state = "content"
                continue
            if self._state == "thought":
                if not self._began:
                    self._buf = self._buf.lstrip("\n")
                i = self._buf.find(CLOSE)
                if i >= 0:
                    reasoning.append(self._buf[:i].rstrip("\n"))
                    self._buf, self._state = self._buf[i + len(CLOSE):], "answer"
                    continue
                keep = _partial(self._buf, CLOSE)
                body = self._buf[:len(self._buf) - keep]
                sent = body.rstrip("\n")  # newlines just before </think> are not the thought's
                reasoning.append(sent)
                self._began = self._began or bool(sent)
                self._buf = self._buf[len(sent):]
                break
            if self._state == "answer":  # newlines after </think> are not the answer's
                stripped = self._buf.lstrip("\n")
                if not stripped:
                    self._buf = ""
                    break
                self._buf, self._state = stripped, "content"
                continue
            content.append(self._buf)
            self._buf = ""
            break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        rest, self._buf = self._buf, ""
        if self._state == "thought":
            return rest.rstrip("\n") if self._began else rest.strip("\n"), ""
        if self._state == "answer":
            return "", rest.lstrip("\n")
        return "", rest

    @property
    def in_thought(self) -> bool:
        return self._state == "thought"
