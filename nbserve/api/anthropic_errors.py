"""Errors in Anthropic's shape, `{"type": "error", "error": {"type", "message"}, "request_id"}`,
for every error answered under the Messages API's paths (the route family declares it: see
`RouteFamily.error_shape`). The status code stays nbserve's; the error type follows from it
as Anthropic's does."""

from __future__ import annotations

from ..types import JSONObject
from .errors import APIError

# Anthropic's error type for each status code nbserve answers with; any other 4xx is an
# invalid request, any other 5xx an api_error.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 408: "timeout_error",
               413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error", 529: "overloaded_error"}


def error_type(status: int) -> str:
    """Anthropic's error type for an HTTP status."""
    return ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def anthropic_error_shape(err: APIError, request_id: str = "") -> JSONObject:
    """`err` as Anthropic writes an error (also the data of a stream's `error` event)."""
    body: JSONObject = {"type": "error", "error": {"type": error_type(err.status),
                                                  "message": err.message}}
    if request_id:
        body["request_id"] = request_id
    return body
