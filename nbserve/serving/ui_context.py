"""Fit a chat-UI conversation into the server's size limits and the model's context by leaving
out its oldest whole turns (a user message with its answers); the system prompt and the newest
message always stay.

A long chat would otherwise fail on every later turn once its history outgrows the context.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..api.limits import Limits
from ..types import InvalidRequestError

Message = dict[str, str]
# The note starts the answer it belongs to; ui.to_messages cuts it off before the next turn.
NOTE_START = "_(Older turns were left out"


@dataclass(slots=True)
class Fitted:
    """The messages to send, how many old turns were left out, and the note to show ("" when
    none were)."""

    messages: list[Message]
    dropped: int
    note: str


def split_turns(history: Sequence[Message]) -> list[list[Message]]:
    """The history as turns: each starts at a user message (answers before any user message
    form a turn of their own)."""
    turns: list[list[Message]] = []
    for m in history:
        if m["role"] == "user" or not turns:
            turns.append([m])
        else:
            turns[-1].append(m)
    return turns


def _check_kept(limits: Limits, head: list[Message], newest: Message) -> None:
    """The parts that are never left out must fit the limits on their own."""
    for m, what in [*((m, "The system prompt") for m in head), (newest, "The message")]:
        param = "system_prompt" if m is not newest else "message"
        limits.check_text(param, len(m["content"]), limits.max_message_chars, what)
    kept = len(head) + 1
    if kept > limits.max_messages:
        raise InvalidRequestError(f"the chat needs {kept} messages; the limit is "
                                  f"{limits.max_messages}", param="messages")
    chars = sum(len(m["content"]) for m in [*head, newest])
    limits.check_text("messages", chars, limits.max_conversation_chars, "The conversation")


def _fewest_for_limits(limits: Limits, turns: list[list[Message]], kept_messages: int,
                       kept_chars: int) -> int:
    """The fewest oldest turns to leave out so that the rest meets every size limit."""
    count, chars = kept_messages, kept_chars
    for k in range(len(turns), 0, -1):  # add turns newest first while the limits hold
        turn = turns[k - 1]
        count += len(turn)
        chars += sum(len(m["content"]) for m in turn)
        longest = max(len(m["content"]) for m in turn)
        if (count > limits.max_messages or chars > limits.max_conversation_chars
                or longest > limits.max_message_chars):
            return k
    return 0


def fit_conversation(messages: Sequence[Message], *, limits: Limits, max_tokens: int,
                     count_tokens: Callable[[list[Message]], int | None] | None = None,
                     max_context: int | None = None) -> Fitted:
    """`messages` (an optional system prompt first, the newest user message last) with the
    fewest oldest turns left out so that the size limits hold and, given `count_tokens` and
    `max_context`, the prompt plus `max_tokens` fits the context (a count of None: the backend
    cannot count, and nothing is left out for the context).

    Raises InvalidRequestError when the system prompt or the newest message alone breaks a
    size limit. When even the newest message alone does not fit the context, every old turn is
    left out and the backend's context-length error tells the user.
    """
    head = [m for m in messages[:1] if m["role"] == "system"]
    newest = messages[-1]
    turns = split_turns(messages[len(head):-1])
    _check_kept(limits, head, newest)
    kept_chars = sum(len(m["content"]) for m in [*head, newest])
    by_limits = _fewest_for_limits(limits, turns, len(head) + 1, kept_chars)

    def build(k: int) -> list[Message]:
        return [*head, *(m for turn in turns[k:] for m in turn), newest]

    dropped = by_limits
    if count_tokens is not None and max_context:
        budget = max_context - max_tokens
        tokens: dict[int, int | None] = {}

        def fits(k: int) -> bool:
            if k not in tokens:
                tokens[k] = count_tokens(build(k))
            n = tokens[k]
            return n is None or n <= budget

        if not fits(by_limits):
            # fewer tokens with every turn left out: the fewest that fit, by bisection
            lo, hi = by_limits + 1, len(turns)
            if fits(hi):
                while lo < hi:
                    mid = (lo + hi) // 2
                    if fits(mid):
                        hi = mid
                    else:
                        lo = mid + 1
            if hi > by_limits:
                return Fitted(build(hi), hi,
                              f"{NOTE_START} to fit the model's {max_context}-token context.)_")
    note = f"{NOTE_START} to fit the server's conversation size limits.)_" if dropped else ""
    return Fitted(build(dropped), dropped, note)
