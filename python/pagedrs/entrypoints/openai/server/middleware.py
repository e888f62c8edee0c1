"""Pure ASGI middleware: API key on /v1 routes, body size limit, access log, HTTP metrics.

Pure ASGI (not BaseHTTPMiddleware) so streaming responses and client disconnects pass through
untouched.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from pagedrs.entrypoints.anthropic.errors import anthropic_error_body, is_anthropic_path
from pagedrs.entrypoints.openai.errors import APIError, too_large, unauthorized

access_logger = logging.getLogger("pagedrs.access")

Scope = dict[str, Any]
Receive = Callable[[], Any]
Send = Callable[[dict[str, Any]], Any]

# A body this much over the limit is not read at all before the 413 (the connection closes).
_DISCARD_LIMIT = 256 * 1024 * 1024


async def _send_error(send: Send, err: APIError, path: str) -> None:
    """`err` in the shape of the path's API (Anthropic's under /v1/messages, OpenAI's elsewhere)."""
    shaped = anthropic_error_body(err.status, err.message) if is_anthropic_path(path) else err.body()
    body = json.dumps(shaped).encode()
    await send(
        {
            "type": "http.response.start",
            "status": err.status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


class ServerMiddleware:
    def __init__(
        self,
        app: Any,
        *,
        api_key: str | None,
        max_body_bytes: int,
        on_response: Callable[[str, str, int], None] | None = None,
    ) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.on_response = on_response

    def _authorized(self, scope: Scope) -> bool:
        """`Authorization: Bearer KEY` (OpenAI's clients) or `x-api-key: KEY` (Anthropic's)."""
        if self.api_key is None:
            return True
        bearer, x_api_key = b"", b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                bearer = value
            elif name == b"x-api-key":
                x_api_key = value
        # Constant-time: compare_digest's time does not depend on where the bytes differ.
        return hmac.compare_digest(bearer, b"Bearer " + self.api_key) | hmac.compare_digest(
            x_api_key, self.api_key
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status_holder = [0]

        async def send_wrapper(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status_holder[0] = int(message["status"])
            await send(message)

        try:
            path: str = scope.get("path", "")
            if path.startswith("/v1") and not self._authorized(scope):
                await _send_error(send_wrapper, unauthorized(), path)
                return
            limited = await self._limit_body(scope, receive, send_wrapper)
            if limited is None:
                return
            await self.app(scope, limited, send_wrapper)
        finally:
            # 499: the client went away before any response was sent (nginx's convention).
            self._log(scope, status_holder[0] or 499, time.perf_counter() - start)

    async def _limit_body(self, scope: Scope, receive: Receive, send: Send) -> Receive | None:
        """A receive that replays the body if it had to be read; None once a 413 was sent."""
        limit = self.max_body_bytes
        if limit <= 0 or scope.get("method") in ("GET", "HEAD", "DELETE", "OPTIONS"):
            return receive
        length = None
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    length = None
                break
        if length is not None and length <= limit:
            return receive
        # Over the limit, or chunked (unknown length): read up to the limit before deciding.
        chunks: list[bytes] = []
        total = 0
        over = length is not None and length > limit
        if over and length is not None and length > _DISCARD_LIMIT:
            await _send_error(send, too_large(limit), scope.get("path", ""))
            return None
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            body = message.get("body", b"")
            total += len(body)
            more = message.get("more_body", False)
            if total > limit:
                over = True
                if total > _DISCARD_LIMIT:
                    break
            if not over:
                chunks.append(body)
        if over:
            await _send_error(send, too_large(limit), scope.get("path", ""))
            return None
        replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay_receive() -> dict[str, Any]:
            if replay:
                return replay.pop()
            return await receive()

        return replay_receive

    def _log(self, scope: Scope, status: int, elapsed: float) -> None:
        client = scope.get("client")
        who = f"{client[0]}:{client[1]}" if client else "-"
        query = scope.get("query_string", b"")
        target = scope.get("path", "") + (f"?{query.decode('latin-1')}" if query else "")
        access_logger.info(
            '%s "%s %s HTTP/%s" %d %.1fms',
            who,
            scope.get("method", "-"),
            target,
            scope.get("http_version", "1.1"),
            status,
            elapsed * 1000.0,
        )
        if self.on_response is not None:
            route = scope.get("route")
            route_path = getattr(route, "path", None) or "other"
            self.on_response(scope.get("method", "-"), route_path, status)
