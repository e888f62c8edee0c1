"""The automatic liquid policy (opt-in, `liquid_auto=True`), the rule of vLLM 0.5's liquid fork.

Each step (and each idle tick behind the server) records the *concurrent cache usage*: (used blocks +
waiting prompt tokens / block size) / total blocks; above 1 it means requests wait for room. Over a
window of that many samples, the mean passing `scale_out_threshold` doubles the active ranks; the mean
staying under `scale_in_threshold` halves them, if the used blocks fit the smaller pool. Events happen
between steps, one at a time, and the window starts over after each.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["LiquidAutoPolicy"]


@dataclass
class LiquidAutoPolicy:
    max_degree: int
    window: int = 16
    scale_out_threshold: float = 0.9
    scale_in_threshold: float = 0.7
    samples: deque[float] = field(default_factory=deque)

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"liquid_auto_window must be >= 1, got {self.window}")
        if not 0 < self.scale_in_threshold < self.scale_out_threshold:
            raise ValueError(
                f"liquid thresholds must satisfy 0 < scale_in ({self.scale_in_threshold}) < "
                f"scale_out ({self.scale_out_threshold})"
            )
        self.samples = deque(maxlen=self.window)

    def observe(self, usage: float) -> None:
        self.samples.append(float(usage))

    def reset(self) -> None:
        self.samples.clear()

    def decide(
        self, degree: int, used_blocks: int, blocks_at: Callable[[int], int]
    ) -> tuple[int, str] | None:
        """(target degree, why) when the window says to move, else None."""
        if len(self.samples) < self.window:
            return None
        mean = sum(self.samples) / len(self.samples)
        n = len(self.samples)
        if mean > self.scale_out_threshold and degree < self.max_degree:
            return degree * 2, (
                f"mean concurrent cache usage {mean:.2f} over the last {n} samples > "
                f"{self.scale_out_threshold}: scale out {degree} -> {degree * 2}"
            )
        if mean < self.scale_in_threshold and degree > 1:
            room = blocks_at(degree // 2)
            if used_blocks <= room:
                return degree // 2, (
                    f"mean concurrent cache usage {mean:.2f} over the last {n} samples < "
                    f"{self.scale_in_threshold} and {used_blocks} used blocks fit {room}: "
                    f"scale in {degree} -> {degree // 2}"
                )
        return None
