"""The data-parallel router's tuning knobs (`DPRouter(..., **tuning)`), their defaults and checks."""

from __future__ import annotations

from typing import Any

__all__ = ["DEFAULT_TUNING", "check_tuning"]

# tuning knob -> default (see pagedrs.engine.dp.router's docstring)
DEFAULT_TUNING: dict[str, Any] = {
    # Cached-prefix tokens one load token is worth: a request leaves the replica holding its prefix for one
    # holding none when the former's load exceeds the latter's by 4x the cached tokens.
    "load_penalty": 0.25,
    # Load of a request in flight besides its prompt tokens still to prefill (its decode steps).
    "request_tokens": 32,
    # The guard: load > ratio x the least load and more than abs tokens above it.
    "balance_ratio": 1.5,
    "balance_abs_tokens": 1024,
    "optimistic": True,  # count a routed prompt's blocks as cached on its replica at once
    "max_sticky_keys": 65536,  # sticky keys remembered (least recently used dropped first)
    # What a prompt block held only in a replica's KV tier is worth, as a fraction of a block its device
    # pool holds (a miss: 0): loading it costs a copy from host memory, or a file read and that copy.
    "host_tier_hit_weight": 0.5,
    "disk_tier_hit_weight": 0.25,
}


def check_tuning(tuning: dict[str, Any]) -> dict[str, Any]:
    """The knobs given over the defaults; ValueError naming an unknown knob or a bad value."""
    unknown = sorted(set(tuning) - set(DEFAULT_TUNING))
    if unknown:
        raise ValueError(f"unknown router tuning {unknown}; known: {sorted(DEFAULT_TUNING)}")
    t = {**DEFAULT_TUNING, **tuning}
    checks = (
        ("load_penalty", lambda v: v >= 0, ">= 0"),
        ("balance_ratio", lambda v: v >= 1, ">= 1"),
        ("balance_abs_tokens", lambda v: v >= 0, ">= 0"),
        ("request_tokens", lambda v: v >= 0, ">= 0"),
        ("max_sticky_keys", lambda v: isinstance(v, int) and v >= 1, "an int >= 1"),
        ("host_tier_hit_weight", lambda v: 0 <= v <= 1, "in [0, 1]"),
        ("disk_tier_hit_weight", lambda v: 0 <= v <= 1, "in [0, 1]"),
    )
    for name, ok, what in checks:
        v = t[name]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not ok(v):
            raise ValueError(f"router tuning {name} must be {what}, got {v!r}")
    if not isinstance(t["optimistic"], bool):
        raise ValueError(f"router tuning optimistic must be a bool, got {t['optimistic']!r}")
    return t
