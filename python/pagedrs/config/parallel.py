"""Data, tensor (and liquid) parallelism, and multi-LoRA serving configs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedrs.config.checks import _is_int, _is_number, _require
from pagedrs.config.router_tuning import check_tuning


@dataclass(frozen=True, slots=True)
class DataParallelConfig:
    """Data parallelism: `size` engine cores (each a whole replica of the model, itself possibly a
    tensor-parallel group) behind one frontend, started by `backend` ("mp": local processes, "ray": Ray
    actors), each request sent to one of them by `routing` ("cache": where its prefix is cached, load
    considered; "least_loaded"; "round_robin"); `session_affinity`: requests of one session (the
    request's `user`, or its X-Session-Id header) go to the same replica; `router_tuning`: the router's
    knobs over their defaults (`pagedrs.config.router_tuning`); `rank`: the replica a core is (each core
    runs with its own, vLLM's `data_parallel_rank`)."""

    size: int = 1
    backend: str = "mp"
    routing: str = "cache"
    session_affinity: bool = False
    router_tuning: dict[str, Any] | None = None
    rank: int = 0

    def __post_init__(self) -> None:
        _require(
            _is_int(self.size) and self.size >= 1, "data_parallel_size", self.size, "must be an int >= 1"
        )
        _require(
            _is_int(self.rank) and self.rank >= 0, "data_parallel_rank", self.rank, "must be an int >= 0"
        )
        b = self.backend
        _require(b in ("mp", "ray"), "data_parallel_backend", b, "must be 'mp' or 'ray'")
        r = self.routing
        _require(
            r in ("cache", "least_loaded", "round_robin"),
            "dp_routing",
            r,
            "must be 'cache', 'least_loaded' or 'round_robin'",
        )
        t = self.router_tuning
        if t is not None:
            _require(isinstance(t, dict), "dp_router_config", t, "must be a JSON object")
            check_tuning(t)  # ValueError naming the knob


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """Tensor parallelism: how many ranks hold a shard of the model, and who starts their processes
    ("mp": local processes; "ray": Ray actors, on one host or several)."""

    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # None -> "mp"
    # Liquid scaling: the ranks (GPU indices; worker ranks on CPU) the model may spread over, and the
    # number of shards it is cut into. None: no liquid scaling.
    liquid_gpu_range: tuple[int, ...] | None = None
    liquid_total_num_shards: int | None = None
    liquid_auto: bool = False  # scale by the concurrent cache usage (executor/liquid/policy.py)
    liquid_auto_window: int = 16
    liquid_scale_out_threshold: float = 0.9
    liquid_scale_in_threshold: float = 0.7

    def __post_init__(self) -> None:
        tp = self.tensor_parallel_size
        _require(_is_int(tp) and tp >= 1, "tensor_parallel_size", tp, "must be an int >= 1")
        b = self.distributed_executor_backend
        _require(b in (None, "mp", "ray"), "distributed_executor_backend", b, "must be 'mp' or 'ray'")
        r = self.liquid_gpu_range
        if r is None:
            _require(not self.liquid_auto, "liquid_auto", self.liquid_auto, "needs liquid_gpu_range")
            _require(
                self.liquid_total_num_shards is None,
                "liquid_total_num_shards",
                self.liquid_total_num_shards,
                "needs liquid_gpu_range",
            )
            return
        n = len(r)
        _require(
            all(_is_int(i) and i >= 0 for i in r) and len(set(r)) == n and n >= 1 and not n & (n - 1),
            "liquid_gpu_range",
            list(r),
            "must be a list of distinct device indices, a power of two of them",
        )
        _require(
            tp == 1, "tensor_parallel_size", tp, "must be 1 with liquid_gpu_range (liquid sets the degree)"
        )
        s = self.liquid_total_num_shards
        _require(
            isinstance(s, int) and not isinstance(s, bool) and s >= n and not s & (s - 1),
            "liquid_total_num_shards",
            s,
            f"must be a power of two >= len(liquid_gpu_range) ({n})",
        )
        w = self.liquid_auto_window
        _require(_is_int(w) and w >= 1, "liquid_auto_window", w, "must be an int >= 1")
        lo, hi = self.liquid_scale_in_threshold, self.liquid_scale_out_threshold
        _require(
            _is_number(lo) and _is_number(hi) and 0 < lo < hi,
            "liquid_scale_in_threshold",
            lo,
            f"must be > 0 and below liquid_scale_out_threshold ({hi})",
        )

    @property
    def backend(self) -> str:
        return self.distributed_executor_backend or "mp"


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    """Multi-LoRA serving (vLLM's names): `max_loras` adapters resident at once (a batch mixes up to that
    many), ranks up to `max_lora_rank`, `max_cpu_loras` kept loaded on the host (default: max_loras)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        _require(
            _is_int(self.max_loras) and self.max_loras >= 1,
            "max_loras",
            self.max_loras,
            "must be an int >= 1",
        )
        r = self.max_lora_rank
        _require(_is_int(r) and r >= 1, "max_lora_rank", r, "must be an int >= 1")
        c = self.max_cpu_loras
        _require(
            c is None or (_is_int(c) and c >= self.max_loras),
            "max_cpu_loras",
            c,
            f"must be an int >= max_loras ({self.max_loras})",
        )
