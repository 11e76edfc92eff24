"""Fakes for unit tests that run the real Engine without a real model (milliseconds a test).

- `ScriptedModel`: a StepModel whose logits follow a script over the tokens the row can see
  (by default "always favour (last id + 1) % V"). Its KV cache stores the token ids
  themselves, so the script reads exactly what the engine's bookkeeping left in the slot, and
  a read of a position nobody wrote fails the forward (the engine reports it as an error).
- `letter_tokenizer()`: one lowercase letter per token id (a = 0 ... z = 25).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from nbserve.models.base import LoadedModel
from nbserve.text import Tokenizer

LETTERS = "abcdefghijklmnopqrstuvwxyz"
CPU = torch.device("cpu")
VOCAB = len(LETTERS)

Script = Callable[[list[int]], int]  # the tokens a position sees (itself last) -> favoured id


def next_letter(context: list[int]) -> int:
    return (context[-1] + 1) % VOCAB


def sum_of_context(context: list[int]) -> int:
    """A script that depends on every cached token: a slot holding wrong keys/values (a prefix
    reuse or n > 1 copy gone wrong) changes the output."""
    return sum(context) % VOCAB


def greedy(script: Script, prompt: list[int], n_tokens: int) -> list[int]:
    """What greedy decoding under `script` must produce (a model with a perfect cache)."""
    ctx = list(prompt)
    for _ in range(n_tokens):
        ctx.append(script(ctx))
    return ctx[len(prompt):]


def ids(text: str) -> list[int]:
    return [LETTERS.index(c) for c in text]


def text(token_ids: list[int]) -> str:
    return "".join(LETTERS[i] for i in token_ids)


class _Letters:
    """The duck-typed tokenizer nbserve.text.Tokenizer.from_any adopts."""

    vocab_size = VOCAB

    def encode(self, s: str) -> list[int]:
        return ids(s)

    def decode(self, token_ids: list[int]) -> str:
        return text(list(token_ids))


def letter_tokenizer() -> Tokenizer:
    return Tokenizer.from_any(_Letters())


class TokenCache:
    """The KV cache of a ScriptedModel: the token id at each (slot, position), None if unset."""

    def __init__(self, max_batch: int, max_context: int):
        self.tokens: list[list[int | None]] = [[None] * max_context for _ in range(max_batch)]
        self.nbytes = max_batch * max_context * 8
        self.copies: list[tuple[int, int, int]] = []

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        self.tokens[dst][:length] = self.tokens[src][:length]
        self.copies.append((src, dst, length))


@dataclass(frozen=True)
class Row:
    """One row of one forward call, as the model saw it."""

    slot: int
    positions: list[int]
    ids: list[int]


@dataclass(eq=False)
class ScriptedModel:
    """A StepModel with scripted logits. `hold`: set it to a cleared Event to park the engine
    thread inside its next forward (`entered` tells when it got there) until the test sets it.
    `poison`: a token id whose appearance in a forward makes that forward raise."""

    script: Script = next_letter
    max_context: int = 64
    vocab_size: int = VOCAB
    device: torch.device = CPU
    dtype: torch.dtype = torch.float32
    poison: int | None = None
    calls: list[list[Row]] = field(default_factory=list)
    hold: threading.Event | None = None
    entered: threading.Event = field(default_factory=threading.Event)

    def make_cache(self, max_batch: int, max_context: int) -> TokenCache:
        return TokenCache(max_batch, max_context)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                cache: TokenCache, logit_index: torch.Tensor | None = None) -> torch.Tensor:
        self.entered.set()
        if self.hold is not None and not self.hold.wait(10):
            raise TimeoutError("the test never released the held forward")
        B, T = ids.shape
        rows = [Row(int(slots[b]), positions[b].tolist(), ids[b].tolist()) for b in range(B)]
        self.calls.append(rows)
        if self.poison is not None and any(self.poison in r.ids for r in rows):
            raise RuntimeError(f"poisoned token {self.poison}")
        logits = torch.zeros(B, T, self.vocab_size)
        for b, row in enumerate(rows):
            stored = cache.tokens[row.slot]
            for t, (p, tok) in enumerate(zip(row.positions, row.ids)):
                stored[p] = tok
                context = stored[:p + 1]
                if None in context:
                    raise AssertionError(f"slot {row.slot} position {context.index(None)} is "
                                         "read before anything was written there")
                logits[b, t, self.script(context)] = 1.0
        if logit_index is not None:
            return logits[torch.arange(B), logit_index]
        return logits


def loaded(model: ScriptedModel | None = None, stop_token_ids: list[int] = (),
           template: object | None = None) -> LoadedModel:
    return LoadedModel(model or ScriptedModel(), letter_tokenizer(), template, "scripted",
                       list(stop_token_ids))
