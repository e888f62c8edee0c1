"""Anthropic's error shape: ``{"type": "error", "error": {"type": ..., "message": ...}}``, for every
error a route under ``/v1/messages`` answers (bad body, unknown model, authentication, body size, engine)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi.responses import JSONResponse

from pagedrs.entrypoints.openai.errors import APIError

PREFIX = "/v1/messages"

# Anthropic's error types by HTTP status (https status codes of its API errors)
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def is_anthropic_path(path: str) -> bool:
    return path == PREFIX or path.startswith(PREFIX + "/")


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    kind = _TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(path: str, err: APIError, headers: Mapping[str, str] | None = None) -> JSONResponse:
    """`err` in the shape the route's API uses: Anthropic's under /v1/messages, OpenAI's elsewhere."""
    body = anthropic_error_body(err.status, err.message) if is_anthropic_path(path) else err.body()
    return JSONResponse(body, status_code=err.status, headers=headers)


__all__ = ["anthropic_error_body", "error_response", "is_anthropic_path"]
