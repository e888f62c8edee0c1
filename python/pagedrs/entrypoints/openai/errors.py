"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import ValidationError


class APIError(Exception):
    """An error the server reports to the client in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = int(status)
        self.message = message
        self.type = type or _default_type(self.status)
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def _default_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status == 503:
        return "service_unavailable_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def error_body(
    message: str, *, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(HTTPStatus.BAD_REQUEST, message, param=param, code=code)


def not_found(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(HTTPStatus.NOT_FOUND, message, param=param, code=code)


def unauthorized() -> APIError:
    return APIError(
        HTTPStatus.UNAUTHORIZED,
        "Incorrect or missing API key.",
        type="invalid_request_error",
        code="invalid_api_key",
    )


def too_large(limit: int) -> APIError:
    return APIError(
        HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
        f"Request body is larger than the limit of {limit} bytes.",
        code="request_too_large",
    )


def unavailable(message: str = "The engine is not available.") -> APIError:
    return APIError(HTTPStatus.SERVICE_UNAVAILABLE, message, code="engine_unavailable")


def internal(message: str, code: str = "internal_error") -> APIError:
    return APIError(HTTPStatus.INTERNAL_SERVER_ERROR, message, code=code)


# Union branch tags pydantic puts in an error's loc; they are types, not field names.
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "bytes", "list", "dict", "tuple", "set", "none"})


def _loc_to_param(loc: tuple[Any, ...]) -> str | None:
    # Keep the field path (API fields are lowercase identifiers, list positions are ints); drop
    # union tags such as "str", "list[int]", "function-after[...]" or a model's class name.
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif (
            isinstance(item, str)
            and item.isidentifier()
            and item not in _TYPE_TAGS
            and not item[:1].isupper()
        ):
            parts.append(("." if parts else "") + item)
    return "".join(parts) or None


def from_validation_error(exc: ValidationError) -> APIError:
    """Maps the first pydantic error to a 400 whose ``param`` names the field."""
    errors = exc.errors(include_url=False)
    if not errors:
        return bad_request(str(exc))
    first = errors[0]
    param = _loc_to_param(tuple(first.get("loc", ())))
    msg = first.get("msg", "invalid value")
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    message = f"{param}: {msg}" if param else msg
    return bad_request(message, param=param, code="invalid_value")
