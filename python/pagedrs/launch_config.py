"""What an engine core is built from: the engine's settings resolved and checked once, at the edge
(`EngineArgs.launch_config`), every config final but the scheduler's, whose context length the loaded
model bounds; the loader's options; and the few arguments the start-up log echoes as given. It is what
crosses a process line (vLLM's `EngineCore(vllm_config)`): to an engine core process or Ray actor, to the
other tensor-parallel ranks, to the API server processes of `--api-server-count`, always as JSON
(`to_json` / `from_json`). A data-parallel replica's config is the engine's with that replica's fields
set (`for_replica`); a core placed on another machine settles an "auto" device there (`on_device`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from pagedrs.config import (
    CacheConfig,
    DataParallelConfig,
    DeviceConfig,
    EngineConfig,
    KVEventsConfig,
    LoRAConfig,
    ModelConfig,
    ObservabilityConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    default_swap_space,
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
    # Data parallelism: the replicas, their routing, and which replica this config's core is.
    data_parallel: DataParallelConfig = DataParallelConfig()
    max_logprobs: int = 20  # the most logprobs a request may ask for
    max_num_encoder_input_tokens: int | None = None  # the image-encoder budget of a step, as given
    device_name: str = "auto"  # the device as given ("auto" is settled where the core runs: `on_device`)

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
            max_num_encoder_input_tokens=self.max_num_encoder_input_tokens,
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
            data_parallel=self.data_parallel,
        )

    def for_replica(self, rank: int, num_threads: int | None) -> LaunchConfig:
        """Replica `rank`'s config: its rank (stamped on its prefix-cache events), its CPU threads, and its
        prefix-cache changes on every step message when the router routes by cache."""
        events = self.kv_events.step_events or self.data_parallel.routing == "cache"
        return dataclasses.replace(
            self,
            data_parallel=dataclasses.replace(self.data_parallel, rank=rank),
            kv_events=dataclasses.replace(self.kv_events, step_events=events, data_parallel_rank=rank),
            device=dataclasses.replace(self.device, num_threads=num_threads),
        )

    def on_device(self, device: str) -> LaunchConfig:
        """This config on `device` ("cpu" or "cuda"), with the swap space that device defaults to when none
        was given: where a core runs decides what an "auto" device is."""
        dev = torch.device(device)
        cache = self.cache
        if cache.swap_space_is_default:
            cache = dataclasses.replace(cache, swap_space=default_swap_space(dev.type))
        return dataclasses.replace(
            self, device=dataclasses.replace(self.device, device=dev), cache=cache, device_name=device
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
