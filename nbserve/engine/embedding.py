"""Prefill-only requests (`EmbedSpec`): what the engine checks at submission, the pooling of a
prompt's hidden states chunk by chunk as its prefill runs, and the vector it answers.

Kept apart from the step (step.py), which only hands each chunk's states here and asks for
the answer after the last chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.base import SlotModel
from ..models.pooling import Pooling
from ..types import EmbedSpec, InvalidRequestError, Request


def check_embed(request: Request, spec: EmbedSpec, model: SlotModel, vocab_size: int,
                pooling: Pooling) -> None:
    """Refuse (400) what an embedding request cannot be served with here: several choices,
    tools, a constraint or prompt log-probabilities (nothing is sampled), a model that gives
    no hidden states (a user's StepModel, an adapter), `dimensions` outside [1, hidden
    size] or below it for a model not trained for it (`Pooling.truncatable`), or token
    scores without an LM head or with ids outside the vocabulary."""
    if request.params.n != 1:
        raise InvalidRequestError("an embedding request has one answer: n must be 1", param="n")
    if request.tools or request.params.constraint is not None:
        raise InvalidRequestError("an embedding request generates nothing: it takes no tools "
                                  "or output constraint", param="tools")
    if request.params.prompt_logprobs is not None:
        raise InvalidRequestError("an embedding request answers a vector, not the prompt's "
                                  "log-probabilities", param="prompt_logprobs")
    if spec.score_token_ids is not None:
        if not model.has_lm_head:
            raise InvalidRequestError("this model has no LM head (an embedding model's "
                                      "backbone): it cannot score tokens", param="model")
        ids = spec.score_token_ids
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if not ids or bad:
            raise InvalidRequestError(f"score_token_ids must be one or more ids in "
                                      f"[0, {vocab_size}), got {list(ids)}", param="model")
        return
    hidden = model.hidden_size
    if hidden is None:
        raise InvalidRequestError(f"this model ({type(model).__name__}) gives no hidden states, "
                                  "so it serves no embeddings: nbserve's own model families "
                                  "do", param="model")
    if spec.dimensions is not None and not 1 <= spec.dimensions <= hidden:
        raise InvalidRequestError(f"dimensions must be between 1 and the model's hidden size "
                                  f"{hidden}, got {spec.dimensions}", param="dimensions")
    if spec.dimensions is not None and spec.dimensions < hidden and not pooling.truncatable:
        raise InvalidRequestError(
            f"this model does not declare Matryoshka training (is_matryoshka or "
            f"matryoshka_dimensions in its config.json), so its first {spec.dimensions} values "
            f"are not an embedding: leave dimensions out (or set it to {hidden})",
            param="dimensions")


@dataclass(eq=False)
class Pooler:
    """One request's pooled state, fed its prompt's chunks in order (a chunk that starts at
    position 0 starts over: the sequence was recomputed after a preemption). "mean" and
    "cls" need every position computed (the scheduler takes no cached prefix for them);
    "last" reads the last chunk only."""

    pooling: Pooling
    prompt_len: int
    total: torch.Tensor | None = None  # float32 (H,): the sum, the first or the last state

    @property
    def whole_prompt(self) -> bool:
        """Whether every position must be computed (no prefix from the cache)."""
        return self.pooling.kind != "last"

    def add(self, start: int, states: torch.Tensor) -> None:
        """The final-norm states (T, H) of a chunk that starts at position `start`."""
        kind = self.pooling.kind
        if kind == "mean":
            chunk = states.float().sum(0)
            self.total = chunk if start == 0 or self.total is None else self.total + chunk
        elif kind == "cls":
            if start == 0:
                self.total = states[0].float().clone()
        elif start + states.shape[0] == self.prompt_len:
            self.total = states[-1].float().clone()

    def vector(self, dimensions: int | None) -> list[float]:
        """The pooled vector, cut to `dimensions` and then L2-normalised where the model
        normalises (a Matryoshka cut is normalised again, as OpenAI's `dimensions`)."""
        assert self.total is not None, "pooled before its prompt's chunks ran"
        v = self.total / self.prompt_len if self.pooling.kind == "mean" else self.total
        if dimensions is not None:
            v = v[:dimensions]
        if self.pooling.normalize:
            v = torch.nn.functional.normalize(v, dim=0)
        return [float(x) for x in v.cpu().tolist()]


def scores(logits: torch.Tensor, token_ids: tuple[int, ...]) -> list[float]:
    """The last position's logits (V,) of `token_ids`, in their order."""
    return [float(x) for x in logits[list(token_ids)].float().cpu().tolist()]
