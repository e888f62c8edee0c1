"""The checks every config shares: each raises a `ValueError` that names the field and the offending value."""

from __future__ import annotations

import json


def _require(cond: bool, field: str, value: object, why: str) -> None:
    if not cond:
        raise ValueError(f"{field} {why}, got {value!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def json_object(value: object, field: str) -> dict | None:
    """A setting given as a dict or its JSON text (as the `--*-config` flags take it): the dict, None for
    None; ValueError naming `field` for text that is not JSON or for anything but an object."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{field} is not valid JSON, got {value!r} ({exc})") from None
    _require(isinstance(value, dict), field, value, "must be a JSON object")
    assert isinstance(value, dict)
    return value
