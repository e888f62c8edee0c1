"""Engine-side failures as HTTP errors in OpenAI's shape: only the caller's errors are 4xx."""

from __future__ import annotations

import logging

from pagedrs.engine.async_engine import (
    EngineCoreDiedError,
    EngineDeadError,
    EngineDrainingError,
    RequestAbortedError,
)
from pagedrs.engine.frontend.input_processor import InputError
from pagedrs.entrypoints.openai.errors import APIError, bad_request, internal, unavailable

__all__ = ["ENGINE_CORE_DIED", "to_api_error"]

logger = logging.getLogger("pagedrs.serving")


def to_api_error(exc: BaseException) -> APIError:
    """Maps engine-side failures to HTTP errors: only the caller's errors are 4xx; anything else is a 500
    whose traceback is logged."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InputError):
        return bad_request(str(exc), param=exc.param, code=exc.code)
    if isinstance(exc, EngineDrainingError):
        return unavailable("The server is shutting down.")
    if isinstance(exc, EngineCoreDiedError):
        return internal(f"The engine core failed: {exc}", code=ENGINE_CORE_DIED)
    if isinstance(exc, EngineDeadError):
        return unavailable(f"The engine is not running: {exc}")
    if isinstance(exc, RequestAbortedError):
        return unavailable(str(exc))
    if isinstance(exc, (ValueError, OverflowError)):
        return bad_request(str(exc) or type(exc).__name__)
    logger.error("internal error", exc_info=exc)
    return internal(f"{type(exc).__name__}: {exc}")


ENGINE_CORE_DIED = "engine_core_died"  # the request was lost with the core process; a retry is served
