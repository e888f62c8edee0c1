"""EngineArgs: every engine setting as one flat dataclass (the keyword arguments of `LLM`), turned into
the validated, frozen configs of `pagedrs.config`."""

from __future__ import annotations

from dataclasses import dataclass, fields

from pagedrs.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    ObservabilityConfig,
    ParallelConfig,
    SchedulerConfig,
    resolve_device,
)

__all__ = ["EngineArgs"]


@dataclass
class EngineArgs:
    """Everything the engine can be configured with (the keyword arguments of `LLM`)."""

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gb: float | None = None
    swap_space: float = 0.0
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    enforce_eager: bool = False
    attention_backend: str = "auto"
    seed: int = 0
    num_threads: int | None = None
    max_logprobs: int = 20
    disable_log_stats: bool = False
    stats_log_interval: float = 5.0
    enable_log_batch_visualization: bool = False
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    liquid_gpu_range: list[int] | None = None
    liquid_total_num_shards: int | None = None
    liquid_auto: bool = False
    liquid_auto_window: int = 16
    liquid_scale_out_threshold: float = 0.9
    liquid_scale_in_threshold: float = 0.7

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def parallel_config(self) -> ParallelConfig:
        r = self.liquid_gpu_range
        shards = self.liquid_total_num_shards
        if r is not None and shards is None:
            shards = len(r)
        return ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            distributed_executor_backend=self.distributed_executor_backend,
            liquid_gpu_range=tuple(r) if r is not None else None,
            liquid_total_num_shards=shards,
            liquid_auto=self.liquid_auto,
            liquid_auto_window=self.liquid_auto_window,
            liquid_scale_out_threshold=self.liquid_scale_out_threshold,
            liquid_scale_in_threshold=self.liquid_scale_in_threshold,
        )

    def early_configs(self) -> tuple[ModelConfig, CacheConfig, DeviceConfig, ObservabilityConfig]:
        """The configs that do not depend on the model (checked before any weight is loaded)."""
        model = ModelConfig(
            model=self.model,
            tokenizer=self.tokenizer,
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            seed=self.seed,
        )
        cache = CacheConfig(
            block_size=self.block_size,
            num_kv_blocks=self.num_kv_blocks,
            gpu_memory_utilization=self.gpu_memory_utilization,
            cpu_kv_cache_gb=self.cpu_kv_cache_gb,
            swap_space=self.swap_space,
            enable_prefix_caching=self.enable_prefix_caching,
        )
        device = DeviceConfig(
            device=resolve_device(self.device),
            attention_backend=self.attention_backend,
            enforce_eager=self.enforce_eager,
            num_threads=self.num_threads,
        )
        obs = ObservabilityConfig(
            log_stats=not self.disable_log_stats,
            stats_log_interval=self.stats_log_interval,
            enable_log_batch_visualization=self.enable_log_batch_visualization,
        )
        # The scheduler limits, checked here too (the model's length limit is applied once it is loaded).
        SchedulerConfig(
            max_model_len=model.max_model_len or 2048,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=2048
            if self.max_num_batched_tokens is None
            else self.max_num_batched_tokens,
            enable_chunked_prefill=True,
        )
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be an int >= 0, got {self.max_logprobs!r}")
        self.parallel_config()
        return model, cache, device, obs

    def create_engine_config(self, model_max_len: int) -> EngineConfig:
        model, cache, device, obs = self.early_configs()
        max_len = model.max_model_len if model.max_model_len is not None else model_max_len
        if max_len > model_max_len:
            raise ValueError(
                f"max_model_len ({max_len}) is larger than the model's maximum length ({model_max_len})"
            )
        tokens = self.max_num_batched_tokens
        if tokens is None:
            tokens = SchedulerConfig.default_max_num_batched_tokens(max_len, self.enable_chunked_prefill)
        sched = SchedulerConfig(
            max_model_len=max_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=tokens,
            enable_chunked_prefill=self.enable_chunked_prefill,
        )
        return EngineConfig(
            model=model,
            cache=cache,
            scheduler=sched,
            device=device,
            observability=obs,
            parallel=self.parallel_config(),
        )
