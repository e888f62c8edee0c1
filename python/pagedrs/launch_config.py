"""What the executor builds an engine from: the engine's settings resolved and checked at the edge
(`EngineArgs.launch_config`), every config final but the scheduler's, whose context length the loaded
model bounds; the loader's options; and the few arguments the start-up log echoes as given. It crosses
to the other tensor-parallel ranks as JSON (`to_json` / `from_json`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from pagedrs.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    KVEventsConfig,
    LoRAConfig,
    ModelConfig,
    ObservabilityConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from pagedrs.loader.options import LoadOptions

__all__ = ["LaunchConfig"]


@dataclass(frozen=True)
class LaunchConfig:
    model: ModelConfig
    cache: CacheConfig
    device: DeviceConfig
    observability: ObservabilityConfig
    parallel: ParallelConfig
    lora: LoRAConfig | None
    speculative: SpeculativeConfig | None
    # The scheduler's limits as given (None: a default that depends on the context length).
    max_num_seqs: int
    max_num_batched_tokens: int | None
    enable_chunked_prefill: bool
    load: LoadOptions
    with_tokenizer: bool
    kv_events: KVEventsConfig = KVEventsConfig()
    # Echoed by the start-up log's config line as given (vLLM's names); no other effect here.
    enforce_eager: bool = False
    rope_scaling: dict | None = None
    rope_theta: float | None = None
    disable_custom_all_reduce: bool = False
    pipeline_parallel_size: int = 1

    def resolve(self, model_max_len: int) -> EngineConfig:
        """The engine's config for a model that takes `model_max_len` tokens; ValueError for a
        max_model_len beyond it."""
        max_len = self.model.max_model_len if self.model.max_model_len is not None else model_max_len
        if max_len > model_max_len:
            raise ValueError(
                f"max_model_len ({max_len}) is larger than the model's maximum length ({model_max_len})"
            )
        tokens = self.max_num_batched_tokens
        if tokens is None:
            tokens = SchedulerConfig.default_max_num_batched_tokens(max_len, self.enable_chunked_prefill)
        scheduler = SchedulerConfig(
            max_model_len=max_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=tokens,
            enable_chunked_prefill=self.enable_chunked_prefill,
        )
        return EngineConfig(
            model=self.model,
            cache=self.cache,
            scheduler=scheduler,
            device=self.device,
            observability=self.observability,
            parallel=self.parallel,
            lora=self.lora,
            speculative=self.speculative,
            kv_events=self.kv_events,
        )

    def to_json(self) -> str:
        return msgspec.json.encode(self, enc_hook=_enc_hook).decode()

    @classmethod
    def from_json(cls, text: str) -> LaunchConfig:
        return msgspec.json.decode(text.encode(), type=cls, dec_hook=_dec_hook)


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, torch.device):
        return str(obj)
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def _dec_hook(kind: type, obj: Any) -> Any:
    if kind is torch.device:
        return torch.device(obj)
    raise NotImplementedError(f"cannot decode {kind}")
