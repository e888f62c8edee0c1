"""EngineArgs: every engine setting as one flat dataclass (the keyword arguments of `LLM`), turned into
the validated, frozen configs of `pagedrs.config`."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, fields
from typing import Any

from pagedrs.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ObservabilityConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    resolve_device,
)

__all__ = ["LOAD_FORMATS", "EngineArgs", "default_swap_space"]

LOAD_FORMATS = ("auto", "safetensors", "pt", "gguf", "dummy")


def default_swap_space(device_type: str) -> float:
    """GiB of CPU swap per rank when `swap_space` is not given: vLLM 0.4's 4 GiB per GPU on CUDA, so that
    preemption swaps rather than recomputes. No swap on a CPU device (vLLM's CPU backend has no swap): there the
    device pool is already host memory, and a swap pool beside it would only copy blocks within the same
    memory that could have been device blocks, so preempted requests recompute."""
    return 4.0 if device_type == "cuda" else 0.0


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
    swap_space: float | None = None  # GiB per rank; None: `default_swap_space(device)`
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    enforce_eager: bool = False
    attention_backend: str = "auto"
    batch_invariant: bool = False
    seed: int = 0
    num_threads: int | None = None
    max_logprobs: int = 20
    disable_log_stats: bool = False
    stats_log_interval: float = 5.0
    enable_log_batch_visualization: bool = False
    batch_visualization_style: str = "boxes"
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    # vLLM's names, accepted so that programs written for it run (each either works or is refused at
    # start with what to use instead; see `check_compat`).
    skip_tokenizer_init: bool = False
    tokenizer_mode: str = "auto"
    revision: str | None = None
    tokenizer_revision: str | None = None
    trust_remote_code: bool = False
    max_seq_len: int | None = None
    download_dir: str | None = None
    load_format: str = "auto"
    gguf_file: str | None = None  # which .gguf file of a Hub repo (or "org/name:Q4_K_M")
    hf_token: str | bool | None = None  # Hub token (default: HF_TOKEN or the saved login)
    pipeline_parallel_size: int = 1
    disable_custom_all_reduce: bool = False
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    rope_scaling: dict | None = None
    rope_theta: float | None = None
    served_model_name: str | list[str] | None = None
    disable_sliding_window: bool = False
    # Embeddings: which requests the engine takes, and how embedding requests pool by default.
    task: str = "auto"
    pooling_type: str | None = None  # None -> "last" (causal LMs)
    normalize: bool = True
    liquid_gpu_range: list[int] | None = None
    liquid_total_num_shards: int | None = None
    liquid_auto: bool = False
    liquid_auto_window: int = 16
    liquid_scale_out_threshold: float = 0.9
    liquid_scale_in_threshold: float = 0.7
    # LoRA adapters per request (vLLM's names); LoRA steps run eagerly (no CUDA graphs).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # Speculative decoding: {"method": "ngram" | "self_draft" | "draft_model", "num_speculative_tokens": k, ...}
    # (a dict or its JSON; `SpeculativeConfig`).
    speculative_config: dict | str | None = None

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def check_compat(self) -> None:
        """The vLLM arguments pagedrs does not implement fail here, saying what to use instead."""
        if self.tokenizer_mode not in ("auto", "slow"):
            raise ValueError(
                f"tokenizer_mode={self.tokenizer_mode!r} is not supported; use 'auto' (fast) or 'slow'"
            )
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(
                f"load_format={self.load_format!r} is not supported; one of {', '.join(LOAD_FORMATS)}"
            )
        if not isinstance(self.pipeline_parallel_size, int) or self.pipeline_parallel_size != 1:
            raise ValueError(
                f"pipeline_parallel_size={self.pipeline_parallel_size!r} is not supported (pipeline parallelism "
                "is not implemented); use tensor_parallel_size to spread a model over devices"
            )
        q = self.quantization
        if q is not None:
            from pagedrs.quantization.config import QUANTIZATION_METHODS

            if q not in QUANTIZATION_METHODS:
                raise ValueError(
                    f"quantization={q!r} is not supported; one of {', '.join(QUANTIZATION_METHODS)} "
                    "(or None: the checkpoint's own quantization_config decides)"
                )
            if q == "q8_0" and (self.model is None or self._names_a_gguf()):
                raise ValueError(
                    f"quantization='q8_0' quantizes a 16/32-bit checkpoint at load; model={self.model!r} is a "
                    "GGUF file (None: the default model's), already quantized (leave quantization unset)"
                )
            if q == "gguf" and not self._names_a_gguf():
                raise ValueError(
                    f"quantization='gguf' needs a GGUF model, got model={self.model!r}: a .gguf file, a "
                    "folder holding one, gguf_file=, or a Hub name with the file's type (org/name:Q4_K_M)"
                )
        if (
            (self.revision or self.tokenizer_revision)
            and self.model is not None
            and (self.model.startswith((".", "/", "~")) or os.path.exists(os.path.expanduser(self.model)))
        ):
            raise ValueError(
                f"revision={self.revision!r} / tokenizer_revision={self.tokenizer_revision!r} apply to hub "
                f"model names; {self.model!r} is a local path (check out the revision you want there)"
            )
        if (
            self.max_seq_len is not None
            and self.max_model_len is not None
            and self.max_seq_len != self.max_model_len
        ):
            raise ValueError(
                f"max_seq_len={self.max_seq_len} and max_model_len={self.max_model_len} disagree; give one"
            )
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, dict):
            raise ValueError(f"rope_scaling must be a dict, got {self.rope_scaling!r}")
        if self.rope_theta is not None and not (
            isinstance(self.rope_theta, (int, float)) and self.rope_theta > 0
        ):
            raise ValueError(f"rope_theta must be a number > 0, got {self.rope_theta!r}")

    def _names_a_gguf(self) -> bool:
        """The model is a GGUF file: a path to one, a local folder with one, gguf_file=, or a Hub
        name whose ":QUANT" suffix picks one (as `vllm serve org/name:Q4_K_M`)."""
        from pagedrs.loader.hub import split_quant

        model = os.path.expanduser(str(self.model or ""))
        if self.gguf_file is not None or model.lower().endswith(".gguf"):
            return True
        if os.path.isdir(model):
            return any(name.lower().endswith(".gguf") for name in os.listdir(model))
        return not os.path.exists(model) and split_quant(model)[1] is not None

    def _served_name(self) -> str | None:
        n = self.served_model_name
        if isinstance(n, (list, tuple)):
            return str(n[0]) if n else None
        return n

    def load_options(self) -> Any:
        """The loader's view of these arguments (`pagedrs.loader.LoadOptions`)."""
        from pagedrs.loader.options import LoadOptions

        return LoadOptions(
            load_format=self.load_format,
            revision=self.revision,
            tokenizer_revision=self.tokenizer_revision,
            download_dir=self.download_dir,
            gguf_file=self.gguf_file,
            token=self.hf_token,
            trust_remote_code=self.trust_remote_code,
            tokenizer_mode=self.tokenizer_mode,
            overrides=self.model_overrides(),
            seed=self.seed,
            quantization=self.quantization,
        )

    def with_local_model(self) -> EngineArgs:
        """These arguments with a Hub model or tokenizer name replaced by the local path it resolves to,
        fetching what the cache lacks. The engine's first process calls it once, so that the core process
        and every tensor-parallel rank read the same snapshot and none of them downloads; the name stays
        the served model name."""
        from pagedrs.loader import resolve_paths

        model, tokenizer = resolve_paths(self.model, self.tokenizer, self.load_options())
        return dataclasses.replace(
            self,
            model=self.model if self.model is None else model,  # None: the default model, named by its file
            tokenizer=tokenizer,
            revision=None,
            tokenizer_revision=None,
            gguf_file=None,
            hf_token=None,  # the arguments travel to other processes on their command line
            served_model_name=self.served_model_name or self.model,
        )

    def model_overrides(self) -> dict[str, Any]:
        """What the model's own config is overridden with (rope, sliding window), for every rank."""
        out: dict[str, Any] = {}
        if self.rope_scaling is not None:
            out["rope_scaling"] = dict(self.rope_scaling)
        if self.rope_theta is not None:
            out["rope_theta"] = float(self.rope_theta)
        if self.disable_sliding_window:
            out["disable_sliding_window"] = True
        return out

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
        self.check_compat()
        model = ModelConfig(
            model=self.model,
            tokenizer=self.tokenizer,
            dtype=self.dtype,
            max_model_len=self.max_model_len if self.max_model_len is not None else self.max_seq_len,
            seed=self.seed,
            served_model_name=self._served_name(),
            task=self.task,
            pooling_type=self.pooling_type or "last",
            normalize=self.normalize,
        )
        device_type = resolve_device(self.device).type
        cache = CacheConfig(
            block_size=self.block_size,
            num_kv_blocks=self.num_kv_blocks,
            gpu_memory_utilization=self.gpu_memory_utilization,
            cpu_kv_cache_gb=self.cpu_kv_cache_gb,
            swap_space=default_swap_space(device_type) if self.swap_space is None else self.swap_space,
            enable_prefix_caching=self.enable_prefix_caching,
            cache_dtype=self.kv_cache_dtype,
        )
        device = DeviceConfig(
            device=resolve_device(self.device),
            attention_backend=self.attention_backend,
            enforce_eager=self.enforce_eager or self.enable_lora,
            num_threads=self.num_threads,
            batch_invariant=self.batch_invariant,
        )
        obs = ObservabilityConfig(
            log_stats=not self.disable_log_stats,
            stats_log_interval=self.stats_log_interval,
            enable_log_batch_visualization=self.enable_log_batch_visualization,
            batch_visualization_style=self.batch_visualization_style,
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
        self.lora_config()
        self.speculative()
        return model, cache, device, obs

    def speculative(self) -> SpeculativeConfig | None:
        """The speculative-decoding settings, or None; ValueError for a setup they cannot run on."""
        spec = SpeculativeConfig.from_dict(self.speculative_config)
        if spec is not None and spec.method == "self_draft" and self.tensor_parallel_size != 1:
            raise ValueError(
                f"speculative_config method 'self_draft' needs tensor_parallel_size=1 (got "
                f"{self.tensor_parallel_size}); 'ngram' and 'draft_model' run under tensor parallelism"
            )
        if spec is not None and spec.method != "ngram" and self.liquid_gpu_range is not None:
            raise ValueError(
                f"speculative_config method {spec.method!r} does not run with liquid scaling "
                f"(liquid_gpu_range={self.liquid_gpu_range}); 'ngram' does"
            )
        return spec

    def lora_config(self) -> LoRAConfig | None:
        """The LoRA settings, or None when `enable_lora` is off; ValueError for a setup LoRA cannot run on."""
        if not self.enable_lora:
            return None
        if self.liquid_gpu_range is not None:
            raise ValueError(
                f"enable_lora does not run with liquid scaling (liquid_gpu_range={self.liquid_gpu_range}): "
                "adapters are not moved between degrees; use a fixed tensor_parallel_size"
            )
        return LoRAConfig(
            max_loras=self.max_loras, max_lora_rank=self.max_lora_rank, max_cpu_loras=self.max_cpu_loras
        )

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
            lora=self.lora_config(),
            speculative=self.speculative(),
        )
