"""Streaming text: an incremental detokenizer that never emits partial UTF-8, and a stop-string
matcher that holds back what could still become a stop string."""

from __future__ import annotations

import codecs
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from typing import Protocol, runtime_checkable

# ----------------------------------------------------------------------------- streaming text


class _Decodes(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...


@runtime_checkable
class _TokenBytes(Protocol):  # `Tokenizer` (a test's decoder may have no bytes to give)
    def token_bytes(self, i: int) -> bytes: ...


@runtime_checkable
class _SpecialIds(Protocol):  # `Tokenizer`
    special_ids: Collection[int]


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas without splitting UTF-8 characters.

    Each step decodes only a small window: the tokens of the previous delta (context for
    tokenizers whose decoding depends on the neighbour, e.g. sentencepiece's leading space)
    plus the tokens not emitted yet. Text ending in U+FFFD (an incomplete character) is held
    back until a later token completes it or `finish()` flushes it (without the bytes of a
    character the tokens never completed). The concatenation of all deltas equals
    `tokenizer.decode(all_ids)` but for that cut character; the other exception is an invalid
    byte run under a byte-fallback decoder, where the full decode replaces the whole run, even
    its valid head.
    """

    def __init__(self, tokenizer: _Decodes, skip_special_tokens: bool = False):
        self._tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._window: list[int] = []  # previous delta's tokens, then pending ones
        self._read = 0  # window[:_read] were already emitted
        self.num_tokens = 0

    def add(self, token_ids: int | Iterable[int]) -> str:
        """Feed new token ids; return the text they complete (may be "")."""
        new = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        self._window.extend(new)
        self.num_tokens += len(new)
        return self._advance(final=False)

    def finish(self) -> str:
        """Return whatever is still held back, less the bytes of a character that the tokens
        left incomplete (an answer that max_tokens cut inside a character): those are dropped
        rather than shown as U+FFFD. A U+FFFD that the tokens spell (bytes EF BF BD) stays.
        Needs a tokenizer with `token_bytes` to tell the two apart; without one, the cut shows
        as U+FFFD."""
        partial = self._drop_cut_character()
        text = self._advance(final=True)
        if partial and text.endswith("\ufffd"):
            text = text[:-1]  # the cut character's start, inside a token that holds more
        return text

    def _drop_cut_character(self) -> bool:
        """Drop the pending tokens that only hold bytes of an incomplete last character.
        Returns True when one more token holds the rest of that character's bytes after
        complete ones (a byte-level BPE piece like b" \xf0\x9f"): it stays, and its decoded
        U+FFFD (one, the decoders replace an incomplete sequence as a whole) is cut off."""
        tok = self._tokenizer
        if not isinstance(tok, _TokenBytes):
            return False
        token_bytes = tok.token_bytes
        special = tok.special_ids if self.skip_special_tokens and isinstance(tok, _SpecialIds) \
            else ()
        pending = self._window[self._read:]
        sizes = [0 if t in special else len(token_bytes(t)) for t in pending]
        raw = b"".join(token_bytes(t) for t, n in zip(pending, sizes) if n)
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        decoder.decode(raw)
        cut = len(decoder.getstate()[0])  # bytes of a valid but unfinished UTF-8 sequence
        while cut > 0 and sizes[-1] <= cut:
            cut -= sizes.pop()
            pending.pop()
        self._window = self._window[:self._read] + pending
        return cut > 0

    def _advance(self, final: bool) -> str:
        if self._read == len(self._window):
            return ""
        decode = self._tokenizer.decode
        before = decode(self._window[:self._read], skip_special_tokens=self.skip_special_tokens)
        text = decode(self._window, skip_special_tokens=self.skip_special_tokens)
        if len(text) <= len(before) or (not final and text.endswith("\ufffd")):
            return ""
        self._window = self._window[self._read:]
        self._read = len(self._window)
        return text[len(before):]


class StopStringMatcher:
    """Finds stop strings in streamed text, even when they span deltas.

    `feed` returns the text that is safe to show and the stop string once one is complete. It
    holds back the longest tail that could still begin a stop string and never returns the stop
    string or anything after it. When two stops complete, the one that ends first wins, so the
    result does not depend on how the text was chunked.

    `ends_answer(text)`, when given, says whether the whole answer may end with `text` (a
    constrained answer: its grammar accepts it); a stop string counts only where the text before
    it may end the answer, and is passed over elsewhere.
    """

    def __init__(self, stops: Iterable[str], ends_answer: Callable[[str], bool] | None = None):
        self.stops = [s for s in dict.fromkeys(stops) if s]
        self._held = ""
        self.matched: str | None = None
        self._ends_answer = ends_answer
        self._said: list[str] = []  # the text returned so far (kept for `ends_answer` only)

    def feed(self, text: str) -> tuple[str, str | None]:
        """Add a text delta; return `(text to emit, matched stop or None)`."""
        if self.matched is not None:
            return "", self.matched
        buf = self._held + text
        hit = self._first_stop(buf)
        if hit is not None:
            self._held, self.matched = "", hit[1]
            return buf[:hit[0]], hit[1]
        keep = self._partial_tail(buf)
        self._held = buf[len(buf) - keep:]
        out = buf[:len(buf) - keep]
        if self._ends_answer is not None and self.stops and out:
            self._said.append(out)
        return out, None

    def _first_stop(self, buf: str) -> tuple[int, str] | None:
        """(where, which) of the stop string in `buf` that ends first (and may end the answer
        there), or None."""
        if self._ends_answer is None:
            best: tuple[int, int, str] | None = None
            for stop in self.stops:
                at = buf.find(stop)
                if at >= 0 and (best is None or (at + len(stop), at) < best[:2]):
                    best = (at + len(stop), at, stop)
            return None if best is None else (best[1], best[2])
        hits = sorted((at + len(stop), at, stop) for stop in self.stops
                      for at in _occurrences(buf, stop))
        said = "".join(self._said) if hits else ""
        for _, at, stop in hits:
            if self._ends_answer(said + buf[:at]):
                return at, stop
        return None

    def flush(self) -> str:
        """End of stream: return the held-back tail (it never completed a stop)."""
        held, self._held = self._held, ""
        return "" if self.matched is not None else held

    def _partial_tail(self, buf: str) -> int:
        longest = max((len(s) for s in self.stops), default=1) - 1
        for k in range(min(len(buf), longest), 0, -1):
            tail = buf[-k:]
            if any(len(s) > k and s.startswith(tail) for s in self.stops):
                return k
        return 0


def _occurrences(text: str, sub: str) -> Iterator[int]:
    """Every index where `sub` starts in `text`, overlapping ones too."""
    at = text.find(sub)
    while at >= 0:
        yield at
        at = text.find(sub, at + 1)
