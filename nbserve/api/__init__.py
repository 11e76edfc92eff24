"""The OpenAI-compatible HTTP layer: schemas, routes, errors and limits (tool calls are read by
`nbserve.text.tool_calls`, in the model's own format)."""

from .errors import APIError, error_body
from .limits import Limits
from .protocol import ChatCompletionRequest, CompletionRequest
from .routes import build_router

__all__ = [
    "APIError", "ChatCompletionRequest", "CompletionRequest", "Limits", "build_router",
    "error_body",
]
