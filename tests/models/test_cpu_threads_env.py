"""What importing pagedrs does to the OpenMP runtime torch loads (see pagedrs/__init__.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

_PRINT = "import os, pagedrs; print(os.environ.get('GOMP_SPINCOUNT'))"


def _run(env: dict[str, str]) -> str:
    out = subprocess.run(
        [sys.executable, "-c", _PRINT], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    return out.stdout.strip()


@pytest.mark.parametrize("user_value", [None, "777"])
def test_import_shortens_gomp_spin_unless_the_user_set_it(user_value: str | None) -> None:
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    if user_value is not None:
        env["GOMP_SPINCOUNT"] = user_value
    assert _run(env) == (user_value or "10000")


@pytest.mark.parametrize(
    ("code", "user_value", "note"),
    [
        ("import torch, pagedrs", None, True),  # too late: libgomp read its spin count with torch
        ("import torch, pagedrs", "777", False),  # the user's own value is in force
        ("import pagedrs, torch", None, False),
    ],
)
def test_engine_notes_a_spin_count_set_too_late(code: str, user_value: str | None, note: bool) -> None:
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    if user_value is not None:
        env["GOMP_SPINCOUNT"] = user_value
    out = subprocess.run(
        [sys.executable, "-c", f"{code}; print(pagedrs._gomp.gomp_spin_note())"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.strip()
    assert (out != "None") == note, out
    if note:
        assert "import pagedrs first" in out and "GOMP_SPINCOUNT" in out
