"""How an embedding request pools the model's final hidden states (vLLM's `PoolingParams`)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["POOLING_TYPES", "PoolingParams"]

# last: the last prompt token (causal LMs); mean: every prompt position; cls / first: the first position.
POOLING_TYPES = ("last", "mean", "cls", "first")


@dataclass
class PoolingParams:
    """`pooling_type` and `normalize` None: the engine's defaults (`EngineArgs(pooling_type=...,
    normalize=...)`). `dimensions`: keep the first N values, then normalize again (OpenAI's
    `dimensions`)."""

    pooling_type: str | None = None
    normalize: bool | None = None
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise ValueError(
                f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}"
            )
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a bool, got {self.normalize!r}")
        d = self.dimensions
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 1):
            raise ValueError(f"dimensions must be an int >= 1, got {d!r}")

    def resolved(self, pooling_type: str, normalize: bool) -> PoolingParams:
        return PoolingParams(
            self.pooling_type or pooling_type,
            normalize if self.normalize is None else self.normalize,
            self.dimensions,
        )
