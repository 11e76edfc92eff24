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
    position's; `normalize`: L2-normalise the pooled vector; `truncatable`: the model was
    trained so that the first N values are an embedding too (Matryoshka), which a request's
    `dimensions` needs (config.json's `is_matryoshka` or `matryoshka_dimensions`, as vLLM
    reads them)."""

    kind: PoolingKind = "last"
    normalize: bool = True
    truncatable: bool = False


DECODER_DEFAULT = Pooling()
