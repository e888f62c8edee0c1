"""Engine configuration: frozen, validated once at the edge, then passed down through constructors.

Every check raises a `ValueError` that names the field and the offending value.
"""

from pagedrs.config.engine import EngineConfig
from pagedrs.config.model import (
    FP8_MAX,
    KV_CACHE_DTYPES,
    CacheConfig,
    DeviceConfig,
    ModelConfig,
    ObservabilityConfig,
    SchedulerConfig,
    as_bytes,
    default_swap_space,
    kv_cache_torch_dtype,
    resolve_device,
)
from pagedrs.config.parallel import DataParallelConfig, LoRAConfig, ParallelConfig
from pagedrs.config.speculative import SPEC_METHODS, KVEventsConfig, SpeculativeConfig

__all__ = [
    "CacheConfig",
    "DataParallelConfig",
    "DeviceConfig",
    "EngineConfig",
    "FP8_MAX",
    "KV_CACHE_DTYPES",
    "KVEventsConfig",
    "LoRAConfig",
    "ModelConfig",
    "ObservabilityConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "SpeculativeConfig",
    "SPEC_METHODS",
    "as_bytes",
    "default_swap_space",
    "kv_cache_torch_dtype",
    "resolve_device",
]
