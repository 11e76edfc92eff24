"""The HTTP layer, a route family a module (OpenAI's `chat`, `completions`, `responses`,
`models`, `tokenize`; Anthropic's Messages API, `anthropic`; each with its router, schema and
stream code; `handler` holds what they share), plus schemas, errors (in each API's shape) and
limits (tool calls are read by `nbserve.text.tool_calls`, in the model's own format)."""

from .chat import ChatCompletionRequest
from .completions import CompletionRequest
from .errors import APIError, error_body
from .handler import RouteContext, RouteFamily
from .limits import Limits

__all__ = [
    "APIError", "ChatCompletionRequest", "CompletionRequest", "Limits", "RouteContext",
    "RouteFamily", "error_body",
]
