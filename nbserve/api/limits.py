"""Limits: what one HTTP request may ask for (sizes and parameter ranges), all configurable.

The defaults come from a public chat server that got abused; raise them for trusted clients.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..types import InvalidRequestError


@dataclass(slots=True)
class Limits:
    """Per-request limits enforced by the HTTP layer before anything reaches the engine."""

    max_messages: int = 500
    max_message_chars: int = 8_000
    max_conversation_chars: int = 32_000  # chat: all messages; completions: each prompt
    max_prompts: int = 32  # /v1/completions' list of prompts; /v1/rerank's documents
    max_embedding_inputs: int = 2048  # /v1/embeddings' input list (OpenAI's own limit)
    min_temperature: float = 0.0
    max_temperature: float = 2.0
    max_top_k: int = 200  # 0 or absent = off
    max_tokens: int = 4096
    max_n: int = 8
    max_stop: int = 16
    max_body_bytes: int = 2 * 1024 * 1024

    def __post_init__(self) -> None:
        values = asdict(self)
        for name in ("max_messages", "max_message_chars", "max_conversation_chars", "max_prompts",
                     "max_embedding_inputs", "max_top_k", "max_tokens", "max_n", "max_stop",
                     "max_body_bytes"):
            value = values[name]
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Limits.{name} must be an integer >= 1, got {value!r}")
        if not 0 <= self.min_temperature <= self.max_temperature:
            raise ValueError("Limits needs 0 <= min_temperature <= max_temperature, got "
                             f"{self.min_temperature} and {self.max_temperature}")

    # ------------------------------------------------------------------ checks

    def check_range(self, param: str, value: float | None, lo: float, hi: float) -> None:
        """Raise a 400-style error naming `param` unless lo <= value <= hi (None passes)."""
        if value is not None and not lo <= value <= hi:
            raise InvalidRequestError(f"{param} must be between {lo} and {hi}, got {value}",
                                      param=param)

    def check_sampling(self, *, temperature: float | None, top_k: int | None, n: int | None,
                       max_tokens: int | None, max_tokens_param: str = "max_tokens",
                       stop: list[str] | None = None) -> None:
        """Range checks shared by chat and completions."""
        self.check_range("temperature", temperature, self.min_temperature, self.max_temperature)
        if top_k is not None and top_k != 0:
            self.check_range("top_k", top_k, 1, self.max_top_k)
        self.check_range("n", n, 1, self.max_n)
        self.check_range(max_tokens_param, max_tokens, 1, self.max_tokens)
        if stop is not None and len(stop) > self.max_stop:
            raise InvalidRequestError(
                f"stop may hold at most {self.max_stop} sequences, got {len(stop)}", param="stop")

    def check_text(self, param: str, chars: int, limit: int, what: str) -> None:
        if chars > limit:
            raise InvalidRequestError(
                f"{what} is {chars} characters long; the limit is {limit}. Shorten it or ask "
                "the server operator to raise Limits.", param=param)
