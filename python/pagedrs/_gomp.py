"""libgomp's idle spin, set before torch is imported (importing pagedrs imports this first)."""

from __future__ import annotations

import os
import sys

__all__ = ["gomp_spin_note"]

# libgomp (torch's OpenMP on Linux) keeps an idle thread spinning for 300,000 iterations after every
# parallel torch op. Between two decode steps on a small CPU those spins hold the cores that the Rust
# kernels' own thread pool then needs (measured on the 2-core CI machine, the default model at batch 1
# with 2 threads: 23.0 ms a step as is, 19.8 ms with 10,000), while prefill's back-to-back ops still find
# their threads awake. Set before torch is first imported (later it has no effect); a user's own value
# wins. When torch came first and the user set nothing, the engine says so on a CPU (`gomp_spin_note`).
_GOMP_SPIN_TOO_LATE = "torch" in sys.modules and "GOMP_SPINCOUNT" not in os.environ
os.environ.setdefault("GOMP_SPINCOUNT", "10000")


def gomp_spin_note() -> str | None:
    """Why this process's CPU steps are slower than they could be, when torch was imported before pagedrs
    (libgomp had already read its spin count), or None."""
    if not _GOMP_SPIN_TOO_LATE:
        return None
    return (
        "torch was imported before pagedrs, so libgomp keeps its idle threads spinning after every torch "
        "op, on the cores the CPU kernels need next (a batch-1 decode step of the default model took "
        "11.0 ms instead of 7.3 on 2 cores): import pagedrs first, or set GOMP_SPINCOUNT=10000 before "
        "starting Python"
    )
