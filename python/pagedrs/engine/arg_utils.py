"""EngineArgs: every engine setting as one flat dataclass (the keyword arguments of `LLM`), turned into
the validated, frozen configs of `pagedrs.config`."""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

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
    resolve_device,
)
from pagedrs.config.checks import json_object
from pagedrs.engine.arg_checks import LOAD_FORMATS, check_compat
from pagedrs.engine.arg_fields import add_field_flags, config_default, flag_field
from pagedrs.engine.kv_transfer import offloading_from_transfer_config

if TYPE_CHECKING:
    from pagedrs.launch_config import LaunchConfig

__all__ = ["LOAD_FORMATS", "EngineArgs", "default_swap_space"]


_SPEC_HELP = (
    'speculative decoding as JSON: {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4} '
    'or {"method": "self_draft", "num_speculative_tokens": 3, "draft_layers": 8} '
    'or {"model": "path/to/small-draft", "num_speculative_tokens": 4}'
)


@dataclass
class EngineArgs:
    """Everything the engine can be configured with (the keyword arguments of `LLM`). A field with help
    is also a command-line flag (`add_cli_args`); a default that a config of `pagedrs.config` also has is
    taken from that config."""

    model: str | None = flag_field(
        config_default(ModelConfig, "model"),
        "model path or name (default: the embedded SmolLM2-135M-Instruct GGUF)",
    )
    tokenizer: str | None = flag_field(
        config_default(ModelConfig, "tokenizer"), "tokenizer path (default: the model's)"
    )
    dtype: str = flag_field(config_default(ModelConfig, "dtype"), "auto, float32, float16 or bfloat16")
    device: str = flag_field("auto", "auto, cpu, cuda or cuda:N")
    block_size: int = flag_field(config_default(CacheConfig, "block_size"), "KV-cache block size in tokens")
    num_kv_blocks: int | None = flag_field(
        config_default(CacheConfig, "num_kv_blocks"), "KV-cache blocks (overrides memory sizing)"
    )
    gpu_memory_utilization: float = flag_field(
        config_default(CacheConfig, "gpu_memory_utilization"), "fraction of GPU memory for weights + KV cache"
    )
    cpu_kv_cache_gb: float | None = flag_field(
        config_default(CacheConfig, "cpu_kv_cache_gb"), "KV-cache size on CPU in GiB"
    )
    swap_space: float | None = flag_field(  # GiB per rank; None: `default_swap_space(device)`
        None, "CPU swap space for preempted requests in GiB per rank (default: 4 on CUDA, 0 on CPU)"
    )
    kv_offloading_size: float | None = flag_field(
        None, "GiB of CPU memory for the host KV tier (blocks evicted from the KV cache), over all TP ranks"
    )
    kv_offloading_backend: str = flag_field(
        config_default(CacheConfig, "kv_offloading_backend"), "the KV offloading backend", choices=["native"]
    )
    kv_offloading_disk_path: str | None = flag_field(
        None, "folder of the disk KV tier behind the host tier (block files, kept over restarts)"
    )
    kv_offloading_disk_size: float | None = flag_field(None, "GiB the disk KV tier's folder may hold")
    kv_transfer_config: str | dict | None = flag_field(
        None,
        "vLLM's KV connector config, JSON: its OffloadingConnector maps onto the host KV tier",
        parse=json.loads,
    )
    max_model_len: int | None = flag_field(
        config_default(ModelConfig, "max_model_len"), "context length (default: the model's)"
    )
    max_num_seqs: int = flag_field(
        config_default(SchedulerConfig, "max_num_seqs"), "most requests in a batch"
    )
    max_num_batched_tokens: int | None = flag_field(None, "token budget of a step")
    max_num_encoder_input_tokens: int | None = flag_field(
        None, "image-encoder rows a step may reach (default: no limit); a larger image is refused"
    )
    enable_prefix_caching: bool = flag_field(
        config_default(CacheConfig, "enable_prefix_caching"),
        "reuse cached prefixes",
        negatable=True,
        negative_alias="--disable-prefix-caching",
    )
    enable_chunked_prefill: bool = flag_field(
        config_default(SchedulerConfig, "enable_chunked_prefill"), "split long prompts", negatable=True
    )
    enforce_eager: bool = flag_field(config_default(DeviceConfig, "enforce_eager"), "no CUDA graphs")
    attention_backend: str = flag_field(
        config_default(DeviceConfig, "attention_backend"), "auto, torch or cupy"
    )
    batch_invariant: bool = flag_field(
        config_default(DeviceConfig, "batch_invariant"),
        "CPU: each token's arithmetic independent of its step (greedy outputs the same whatever the "
        "batching, chunking, prefix hits or preemption)",
    )
    seed: int = flag_field(config_default(ModelConfig, "seed"), "random seed")
    num_threads: int | None = flag_field(config_default(DeviceConfig, "num_threads"))
    max_logprobs: int = flag_field(20)
    limit_mm_per_prompt: dict | str | None = flag_field(
        None,
        "JSON: the most images one prompt may carry, e.g. '{\"image\": 4}' (default 16)",
        parse=json.loads,
    )
    allowed_local_media_path: str | None = flag_field(
        None, "folder whose files chat image_url parts may name as file:// URLs (default: none)"
    )
    disable_log_stats: bool = flag_field(
        not config_default(ObservabilityConfig, "log_stats"), "no periodic stats line"
    )
    # serve: the server's --log-stats-interval (0: disable_log_stats)
    stats_log_interval: float = flag_field(config_default(ObservabilityConfig, "stats_log_interval"))
    enable_log_batch_visualization: bool = flag_field(
        config_default(ObservabilityConfig, "enable_log_batch_visualization"), "log a picture of every step"
    )
    batch_visualization_style: str = flag_field(
        config_default(ObservabilityConfig, "batch_visualization_style"),
        "boxes (token boxes, the default) or bar (a line a step)",
    )
    tensor_parallel_size: int = flag_field(
        config_default(ParallelConfig, "tensor_parallel_size"),
        "ranks (devices; worker processes on CPU) the model is split over",
        aliases=("-tp",),
    )
    distributed_executor_backend: str | None = flag_field(
        config_default(ParallelConfig, "distributed_executor_backend"),
        "who starts the tensor-parallel workers: mp (local processes, default) or ray",
        choices=("mp", "ray"),
    )
    data_parallel_size: int = flag_field(
        config_default(DataParallelConfig, "size"),
        "engine cores, each a whole replica of the model (each with --tensor-parallel-size ranks), "
        "behind one endpoint; the CPU threads are shared out among them",
        aliases=("-dp",),
    )
    data_parallel_backend: str = flag_field(
        config_default(DataParallelConfig, "backend"),
        "who starts the data-parallel replicas: mp (local processes, default) or ray (placed on the "
        "cluster in RAY_ADDRESS)",
        choices=("mp", "ray"),
    )
    dp_routing: str = flag_field(
        config_default(DataParallelConfig, "routing"),
        "which replica takes a request: cache (the one holding most of its prefix, load considered; "
        "default), least_loaded or round_robin",
        choices=("cache", "least_loaded", "round_robin"),
    )
    dp_session_affinity: bool = flag_field(
        config_default(DataParallelConfig, "session_affinity"),
        "send the requests of one session (the request's `user`, or its X-Session-Id header) to the "
        "same replica",
    )
    dp_router_config: str | dict | None = flag_field(
        None,
        "the data-parallel router's knobs over their defaults, JSON: "
        '{"load_penalty": 0.25, "request_tokens": 32, "balance_ratio": 1.5, "balance_abs_tokens": 1024, '
        '"optimistic": true, "max_sticky_keys": 65536}',
        parse=json.loads,
    )
    # vLLM's names, accepted so that programs written for it run (each either works or is refused at
    # start with what to use instead; see `check_compat`).
    skip_tokenizer_init: bool = flag_field(False, "no tokenizer: prompts are token ids, outputs have no text")
    tokenizer_mode: str = flag_field("auto", "auto (fast tokenizer) or slow")
    revision: str | None = flag_field(None, "Hub revision of the model: branch, tag or commit")
    tokenizer_revision: str | None = flag_field(None, "Hub revision of the tokenizer")
    trust_remote_code: bool = flag_field(
        False, "passed to transformers (pagedrs runs only its own model code)"
    )
    max_seq_len: int | None = flag_field(None)
    download_dir: str | None = flag_field(None, "HF cache folder to download Hub models into")
    load_format: str = flag_field("auto", "auto, safetensors, pt, gguf or dummy (random weights)")
    gguf_file: str | None = flag_field(  # which .gguf file of a Hub repo (or "org/name:Q4_K_M")
        None, "the .gguf file of a Hub GGUF repo (or name it org/name:QUANT)"
    )
    hf_token: str | bool | None = flag_field(None, "Hub token (default: HF_TOKEN or the saved login)")
    pipeline_parallel_size: int = flag_field(1, "only 1 (use -tp)")
    disable_custom_all_reduce: bool = flag_field(False, "accepted (all-reduces are torch.distributed)")
    quantization: str | None = flag_field(
        None,
        "the checkpoint's format (gptq, awq, fp8, compressed-tensors, gguf; default: what config.json says), "
        "or q8_0: a 16/32-bit checkpoint quantized at load to Q8_0 for the CPU kernels",
    )
    kv_cache_dtype: str = flag_field(
        config_default(CacheConfig, "cache_dtype"), "auto (the model's dtype), fp8 (= fp8_e4m3) or fp8_e5m2"
    )
    rope_scaling: dict | None = flag_field(
        None, "JSON dict overriding the config's rope scaling", parse=json.loads
    )
    rope_theta: float | None = flag_field(None, "override the config's rope theta")
    served_model_name: str | list[str] | None = flag_field(None)  # serve: the server's --served-model-name
    disable_sliding_window: bool = flag_field(False, "no sliding window: the context is capped at it")
    # Embeddings: which requests the engine takes, and how embedding requests pool by default.
    task: str = flag_field(
        config_default(ModelConfig, "task"), "auto (generation and embeddings), generate or embed"
    )
    pooling_type: str | None = flag_field(  # None -> ModelConfig's "last" (causal LMs)
        None, "default embedding pooling: last, mean, cls or first"
    )
    normalize: bool = flag_field(
        config_default(ModelConfig, "normalize"),
        "L2-normalize embeddings by default (--no-normalize: raw pooled states)",
        negatable=True,
    )
    liquid_gpu_range: list[int] | None = flag_field(
        None, "liquid scaling: the devices (worker ranks on CPU) the model may spread over, e.g. 0 1 2 3"
    )
    liquid_total_num_shards: int | None = flag_field(
        config_default(ParallelConfig, "liquid_total_num_shards"),
        "liquid scaling: shards the model is cut into (default: the range's length)",
    )
    liquid_auto: bool = flag_field(
        config_default(ParallelConfig, "liquid_auto"),
        "liquid scaling by the concurrent cache usage (out above 0.9, in under 0.7, over 16 samples)",
    )
    liquid_auto_window: int = flag_field(config_default(ParallelConfig, "liquid_auto_window"))
    liquid_scale_out_threshold: float = flag_field(
        config_default(ParallelConfig, "liquid_scale_out_threshold")
    )
    liquid_scale_in_threshold: float = flag_field(config_default(ParallelConfig, "liquid_scale_in_threshold"))
    # LoRA adapters per request (vLLM's names); LoRA steps run eagerly (no CUDA graphs).
    enable_lora: bool = flag_field(False, "serve LoRA adapters (--lora-modules; the adapter name as `model`)")
    max_loras: int = flag_field(
        config_default(LoRAConfig, "max_loras"),
        "LoRA adapters resident at once, mixed in a batch (default 1)",
    )
    max_lora_rank: int = flag_field(
        config_default(LoRAConfig, "max_lora_rank"), "largest LoRA rank an adapter may have (default 16)"
    )
    max_cpu_loras: int | None = flag_field(
        config_default(LoRAConfig, "max_cpu_loras"), "LoRA adapters kept on the host (default: --max-loras)"
    )
    # Speculative decoding: {"method": "ngram" | "self_draft" | "draft_model", "num_speculative_tokens": k, ...}
    # (a dict or its JSON; `SpeculativeConfig`).
    speculative_config: dict | str | None = flag_field(None, _SPEC_HELP, parse=json.loads)
    # Prefix-cache events: vLLM's --kv-events-config (JSON, `KVEventsConfig`); `kv_cache_events` also puts
    # each step's net change on the step message (the data-parallel router sets it, and the core's rank).
    kv_events_config: str | dict | None = flag_field(
        None,
        'publish prefix-cache events as vLLM does, JSON: {"enable_kv_cache_events": true, "publisher": "zmq", '
        '"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "kv"}',
    )
    kv_cache_events: bool = False
    data_parallel_rank: int = 0

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def cli_field_names(cls) -> list[str]:
        """The fields that are command-line flags (those with help)."""
        return [f.name for f in fields(cls) if f.metadata.get("help") is not None]

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """The engine flags (as vLLM's `EngineArgs.add_cli_args`): one per field with help, dashed."""
        add_field_flags(parser.add_argument_group("engine"), cls)

    def check_compat(self) -> None:
        """The vLLM arguments pagedrs does not implement fail here, saying what to use instead."""
        check_compat(self)

    def _served_name(self) -> str | None:
        n = self.served_model_name
        return (str(n[0]) if n else None) if isinstance(n, (list, tuple)) else n

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
        the served model name. The arguments are checked first: bad ones fail before anything is fetched."""
        from pagedrs.loader import resolve_paths

        self.early_configs()
        model, tokenizer = resolve_paths(self.model, self.tokenizer, self.load_options())
        return dataclasses.replace(
            self,
            model=self.model if self.model is None else model,  # None: the default model, named by its file
            tokenizer=tokenizer,
            revision=None,
            tokenizer_revision=None,
            gguf_file=None,
            hf_token=None,  # the config made from these travels to other processes on their command line
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

    def data_parallel_config(self) -> DataParallelConfig:
        return DataParallelConfig(
            size=self.data_parallel_size,
            backend=self.data_parallel_backend,
            routing=self.dp_routing,
            session_affinity=self.dp_session_affinity,
            router_tuning=json_object(self.dp_router_config, "dp_router_config"),
            rank=self.data_parallel_rank,
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
            limit_mm_per_prompt=json_object(self.limit_mm_per_prompt, "limit_mm_per_prompt"),
            allowed_local_media_path=self.allowed_local_media_path,
        )
        device_type = resolve_device(self.device).type
        offload_size, offload_blocks = self.kv_offloading_size or 0.0, None
        if self.kv_transfer_config is not None:
            if self.kv_offloading_size:
                raise ValueError("give kv_offloading_size or kv_transfer_config, not both")
            offload_size, offload_blocks = offloading_from_transfer_config(
                self.kv_transfer_config, self.block_size
            )
        cache = CacheConfig(
            block_size=self.block_size,
            num_kv_blocks=self.num_kv_blocks,
            gpu_memory_utilization=self.gpu_memory_utilization,
            cpu_kv_cache_gb=self.cpu_kv_cache_gb,
            swap_space=default_swap_space(device_type) if self.swap_space is None else self.swap_space,
            swap_space_is_default=self.swap_space is None,
            enable_prefix_caching=self.enable_prefix_caching,
            cache_dtype=self.kv_cache_dtype,
            kv_offloading_size=offload_size,
            kv_offloading_blocks=offload_blocks,
            kv_offloading_backend=self.kv_offloading_backend,
            kv_offloading_disk_path=self.kv_offloading_disk_path,
            kv_offloading_disk_size=self.kv_offloading_disk_size or 0.0,
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
        budget = self.max_num_batched_tokens
        SchedulerConfig(
            max_model_len=model.max_model_len or 2048,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=2048 if budget is None else budget,
            enable_chunked_prefill=True,
            max_num_encoder_input_tokens=self.max_num_encoder_input_tokens,
        )
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be an int >= 0, got {self.max_logprobs!r}")
        self.parallel_config()
        self.data_parallel_config()
        self.lora_config()
        self.speculative()
        self.kv_events()
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

    def kv_events(self) -> KVEventsConfig:
        return KVEventsConfig.from_spec(
            self.kv_events_config,
            step_events=self.kv_cache_events,
            data_parallel_rank=self.data_parallel_rank,
        )

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

    def launch_config(self) -> LaunchConfig:
        """What an engine core is built from, and what crosses to its process: these arguments checked and
        resolved into the configs (a Hub name stays a name: `with_local_model` first fetches it)."""
        from pagedrs.launch_config import LaunchConfig

        model, cache, device, obs = self.early_configs()
        return LaunchConfig(
            model=model,
            cache=cache,
            device=device,
            observability=obs,
            parallel=self.parallel_config(),
            lora=self.lora_config(),
            speculative=self.speculative(),
            kv_events=self.kv_events(),
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            enable_chunked_prefill=self.enable_chunked_prefill,
            max_num_encoder_input_tokens=self.max_num_encoder_input_tokens,
            load=self.load_options(),
            with_tokenizer=not self.skip_tokenizer_init,
            enforce_eager=self.enforce_eager,
            rope_scaling=self.rope_scaling,
            rope_theta=self.rope_theta,
            disable_custom_all_reduce=self.disable_custom_all_reduce,
            pipeline_parallel_size=self.pipeline_parallel_size,
            data_parallel=self.data_parallel_config(),
            max_logprobs=self.max_logprobs,
            device_name=str(self.device),
        )

    def create_engine_config(self, model_max_len: int) -> EngineConfig:
        """The engine's config for a model that takes `model_max_len` tokens."""
        return self.launch_config().resolve(model_max_len)
