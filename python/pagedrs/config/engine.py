"""The whole engine's configuration: one frozen bundle of the per-part configs."""

from __future__ import annotations

from dataclasses import dataclass

from pagedrs.config.model import (
    CacheConfig,
    DeviceConfig,
    ModelConfig,
    ObservabilityConfig,
    SchedulerConfig,
)
from pagedrs.config.parallel import DataParallelConfig, LoRAConfig, ParallelConfig
from pagedrs.config.speculative import KVEventsConfig, SpeculativeConfig


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    device: DeviceConfig
    observability: ObservabilityConfig
    parallel: ParallelConfig = ParallelConfig()
    lora: LoRAConfig | None = None  # None: LoRA adapters are off
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding
    kv_events: KVEventsConfig = KVEventsConfig()  # prefix-cache events: off
    data_parallel: DataParallelConfig = DataParallelConfig()  # one replica

    def __post_init__(self) -> None:
        tp = self.parallel.tensor_parallel_size
        if self.cache.kv_offloading_disk_path is not None and tp > 1:
            raise ValueError(
                f"kv_offloading_disk_path: the disk KV tier runs with tensor_parallel_size=1 only (got {tp}); "
                "drop it (the host KV tier, kv_offloading_size, runs on every rank) or serve with one rank"
            )
