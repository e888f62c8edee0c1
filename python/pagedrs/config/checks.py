"""The checks every config shares: each raises a `ValueError` that names the field and the offending value."""

from __future__ import annotations


def _require(cond: bool, field: str, value: object, why: str) -> None:
    if not cond:
        raise ValueError(f"{field} {why}, got {value!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
