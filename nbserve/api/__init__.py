"""The OpenAI-compatible HTTP layer: schemas, routes, tool-call parsing, errors and limits."""

from .errors import APIError, error_body
from .limits import Limits
from .protocol import ChatCompletionRequest, CompletionRequest
from .routes import build_router
from .tools import ToolCallStream, parse_tool_calls

__all__ = [
    "APIError", "ChatCompletionRequest", "CompletionRequest", "Limits", "ToolCallStream",
    "build_router", "error_body", "parse_tool_calls",
]
