"""The error a bad request raises wherever it is found (the frontend's checks, the image processing): a
ValueError naming the offending value, which the server turns into a 400 in OpenAI's error shape."""

from __future__ import annotations

__all__ = ["InputError"]


class InputError(ValueError):
    """A bad request: `param` names the field (OpenAI's error shape), `code` is OpenAI's code if any."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code
