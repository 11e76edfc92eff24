"""LoadedModel: what every loader returns, and what the engine is built from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class LoadedModel:
    """A model ready to serve: the StepModel, its tokenizer, chat template and stop ids."""

    model: Any  # nbserve.models.base.StepModel
    tokenizer: Any  # nbserve.text.Tokenizer
    template: Any | None  # nbserve.text.ChatTemplate, None when the model has none
    name: str
    stop_token_ids: list[int] = field(default_factory=list)
    source: str = ""
