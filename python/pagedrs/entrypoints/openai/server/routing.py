"""What the route modules share: the documented error responses (``ERRORS``, ``streamed``) and
``respond``, which runs a serving object's ``create`` and answers JSON or server-sent events."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagedrs.engine.dp.client import SESSION_HEADER, session_key
from pagedrs.entrypoints.openai.protocol import ErrorResponse
from pagedrs.entrypoints.openai.server.state import SSE_HEADERS, SSEResponse
from pagedrs.entrypoints.openai.serving_base import ClientDisconnected

# Documented error responses of the routes that take a body.
ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 500, 503)
}


def streamed(model: type[Any]) -> dict[int | str, dict[str, Any]]:
    """Responses of a route that answers JSON, or server-sent events when the body asks to stream."""
    sse = {"text/event-stream": {"schema": {"type": "string"}}}
    return {200: {"model": model, "content": sse}, **ERRORS}


class Serving(Protocol):
    async def create(self, req: Any, raw_request: Request | None = None) -> dict[str, Any] | Any: ...


async def respond(serving: Serving, req: Any, request: Request) -> Response:
    """Runs ``serving.create``: JSON, or SSE when it streams; 499 when the client went away first."""
    # The session, for data-parallel session affinity: the X-Session-Id header, else the request's `user`.
    session_key.set(request.headers.get(SESSION_HEADER) or getattr(req, "user", None))
    try:
        result = await serving.create(req, request)
    except ClientDisconnected:
        return Response(status_code=499)
    if isinstance(result, (dict, list)):
        return JSONResponse(result)
    stream: AsyncIterator[str] = result
    return SSEResponse(stream, media_type="text/event-stream", headers=SSE_HEADERS)


__all__ = ["ERRORS", "Serving", "respond", "streamed"]
