"""Pooling: how a model turns a prompt's hidden states into one embedding, as its checkpoint
declares it (sentence-transformers' `modules.json` and `1_Pooling/config.json` in an HF
directory; `<arch>.pooling_type` in a GGUF file). A decoder that declares nothing is pooled
at its last token and L2-normalised, as decoder embedding models (Qwen3-Embedding, gte-Qwen2)
are used."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

PoolingKind = Literal["last", "mean", "cls"]


@dataclass(frozen=True, slots=True)
class Pooling:
    """`kind`: the last position's hidden state, the mean over the prompt, or the first
    position's; `normalize`: L2-normalise the pooled vector."""

    kind: PoolingKind = "last"
    normalize: bool = True


DECODER_DEFAULT = Pooling()
