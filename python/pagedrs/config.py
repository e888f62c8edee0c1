"""Engine configuration: frozen, validated once at the edge, then passed down through constructors.

Every check raises a `ValueError` that names the field and the offending value.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

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
    "as_bytes",
    "default_swap_space",
    "kv_cache_torch_dtype",
    "resolve_device",
]

_DTYPES = ("auto", "float32", "float16", "bfloat16", "float", "half")


def _require(cond: bool, field: str, value: object, why: str) -> None:
    if not cond:
        raise ValueError(f"{field} {why}, got {value!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def default_swap_space(device_type: str) -> float:
    """GiB of CPU swap per rank when `swap_space` is not given: vLLM 0.4's 4 GiB per GPU on CUDA, so that
    preemption swaps rather than recomputes. No swap on a CPU device (vLLM's CPU backend has no swap): there the
    device pool is already host memory, and a swap pool beside it would only copy blocks within the same
    memory that could have been device blocks, so preempted requests recompute."""
    return 4.0 if device_type == "cuda" else 0.0


def resolve_device(device: str | torch.device) -> torch.device:
    """ "auto" -> cuda when available, else cpu. ValueError for an unknown name or an absent CUDA."""
    if isinstance(device, torch.device):
        dev = device
    else:
        _require(isinstance(device, str), "device", device, "must be a string")
        if device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            dev = torch.device(device)
        except RuntimeError as e:
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}") from e
    _require(dev.type in ("cpu", "cuda"), "device", str(device), "must be 'auto', 'cpu' or 'cuda[:N]'")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r} was asked for but CUDA is not available")
    return dev


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Which model, in which dtype, and how long a sequence (prompt + output) may be."""

    model: str | None = None  # None -> the embedded default model
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None  # None -> the model's own limit
    seed: int = 0
    served_model_name: str | None = None  # the name outputs and logs use (default: the model path)
    task: str = "auto"  # generate | embed | auto (both)
    pooling_type: str = "last"  # the default pooling of embedding requests
    normalize: bool = True  # L2-normalize embeddings by default

    def __post_init__(self) -> None:
        _require(
            self.model is None or isinstance(self.model, str), "model", self.model, "must be a str or None"
        )
        _require(
            self.tokenizer is None or isinstance(self.tokenizer, str),
            "tokenizer",
            self.tokenizer,
            "must be a str or None",
        )
        if not isinstance(self.dtype, torch.dtype):
            _require(self.dtype in _DTYPES, "dtype", self.dtype, f"must be one of {', '.join(_DTYPES)}")
        if self.max_model_len is not None:
            _require(
                _is_int(self.max_model_len) and self.max_model_len >= 2,
                "max_model_len",
                self.max_model_len,
                "must be an int >= 2",
            )
        _require(_is_int(self.seed), "seed", self.seed, "must be an int")
        _require(
            self.task in ("auto", "generate", "embed"), "task", self.task, "must be auto, generate or embed"
        )
        _require(
            self.pooling_type in ("last", "mean", "cls", "first"),
            "pooling_type",
            self.pooling_type,
            "must be last, mean, cls or first",
        )
        _require(isinstance(self.normalize, bool), "normalize", self.normalize, "must be a bool")


# kv_cache_dtype values (vLLM's names): the cache stores K/V in that format, written with a per-tensor scale
# of 1.0 (vLLM's default when a checkpoint carries none) and read back into the model's dtype.
_FP8_BY_NAME = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
KV_CACHE_DTYPES = ("auto", *_FP8_BY_NAME)
# The fp8 KV element types and the largest finite value of each (writes saturate there).
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def kv_cache_torch_dtype(cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The element type of the KV pool for a kv_cache_dtype."""
    if cache_dtype == "auto":
        return model_dtype
    if cache_dtype in _FP8_BY_NAME:
        return _FP8_BY_NAME[cache_dtype]
    raise ValueError(f"kv_cache_dtype={cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}")


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor as its uint8 bytes (indexing kernels and gloo have no fp8 type); others unchanged."""
    return t.view(torch.uint8) if t.dtype in FP8_MAX else t


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """The paged KV pool: block size, how many blocks (or how much memory), and the CPU swap pool."""

    block_size: int = 16
    num_kv_blocks: int | None = None  # overrides both memory-based sizings
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gb: float | None = None  # None -> up to 4 GiB, no more than max_num_seqs full sequences
    swap_space: float = 0.0  # GiB of CPU memory for preemption by swap
    # swap_space is the device's default, not given: a sliding-window KV pool takes precedence over it
    swap_space_is_default: bool = False
    enable_prefix_caching: bool = True
    cache_dtype: str = "auto"  # auto (the model's dtype) | fp8 = fp8_e4m3 | fp8_e5m2

    def __post_init__(self) -> None:
        bs = self.block_size
        _require(_is_int(bs) and bs > 0 and not bs & (bs - 1), "block_size", bs, "must be a power of two")
        if self.num_kv_blocks is not None:
            _require(
                _is_int(self.num_kv_blocks) and self.num_kv_blocks >= 1,
                "num_kv_blocks",
                self.num_kv_blocks,
                "must be an int >= 1",
            )
        u = self.gpu_memory_utilization
        _require(_is_number(u) and 0 < u <= 1, "gpu_memory_utilization", u, "must be in (0, 1]")
        _require(
            self.cache_dtype in KV_CACHE_DTYPES,
            "kv_cache_dtype",
            self.cache_dtype,
            f"must be one of {', '.join(KV_CACHE_DTYPES)}",
        )
        if self.cpu_kv_cache_gb is not None:
            g = self.cpu_kv_cache_gb
            _require(_is_number(g) and g > 0, "cpu_kv_cache_gb", g, "must be > 0")
        s = self.swap_space
        _require(_is_number(s) and s >= 0, "swap_space", s, "must be >= 0 (GiB)")
        _require(
            isinstance(self.enable_prefix_caching, bool),
            "enable_prefix_caching",
            self.enable_prefix_caching,
            "must be a bool",
        )


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Continuous batching limits. `max_model_len` here is the resolved one (model limit applied)."""

    max_model_len: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        _require(
            _is_int(self.max_model_len) and self.max_model_len >= 2,
            "max_model_len",
            self.max_model_len,
            "must be an int >= 2",
        )
        _require(
            _is_int(self.max_num_seqs) and self.max_num_seqs >= 1,
            "max_num_seqs",
            self.max_num_seqs,
            "must be an int >= 1",
        )
        _require(
            _is_int(self.max_num_batched_tokens) and self.max_num_batched_tokens >= 1,
            "max_num_batched_tokens",
            self.max_num_batched_tokens,
            "must be an int >= 1",
        )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens must be >= max_model_len ({self.max_model_len}) when chunked "
                f"prefill is disabled, got {self.max_num_batched_tokens}"
            )

    @staticmethod
    def default_max_num_batched_tokens(max_model_len: int, enable_chunked_prefill: bool) -> int:
        return 2048 if enable_chunked_prefill else max(2048, max_model_len)


@dataclass(frozen=True, slots=True)
class DeviceConfig:
    """Where the model and its KV pool live, the attention backend and the CPU thread count.

    `batch_invariant` (CPU only; vLLM's VLLM_BATCH_INVARIANT): every token gets the same arithmetic
    whatever else its step holds, so greedy outputs do not depend on batching, chunked prefill, prefix
    hits, preemption or speculation. Every attention query runs through the per-token CPU kernel (also
    whole prompts, which otherwise go through torch's SDPA) and quantized weights always through the
    integer kernels (no switch to a float GEMM over long prefill chunks)."""

    device: torch.device
    attention_backend: str = "auto"
    enforce_eager: bool = False
    num_threads: int | None = None  # torch intra-op threads on CPU; None leaves torch's default
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        _require(isinstance(self.device, torch.device), "device", self.device, "must be a torch.device")
        _require(
            self.attention_backend in ("auto", "torch", "cupy"),
            "attention_backend",
            self.attention_backend,
            "must be one of auto, torch, cupy",
        )
        if self.num_threads is not None:
            _require(
                _is_int(self.num_threads) and self.num_threads >= 1,
                "num_threads",
                self.num_threads,
                "must be an int >= 1",
            )
        _require(
            isinstance(self.batch_invariant, bool), "batch_invariant", self.batch_invariant, "must be a bool"
        )
        _require(
            not self.batch_invariant or self.device.type == "cpu",
            "batch_invariant",
            self.batch_invariant,
            f"is implemented for the CPU path, not device {self.device}",
        )


@dataclass(frozen=True, slots=True)
class ObservabilityConfig:
    """The periodic stats line and the per-step batch picture."""

    log_stats: bool = True
    stats_log_interval: float = 5.0  # seconds between two stats lines
    enable_log_batch_visualization: bool = False
    # boxes (vLLM's `enable_log_batch_visualization`): "Batch 1".."Batch N" columns of token boxes, the
    # picture the continuous-batching notebook's log parser reads; bar: one line per step
    batch_visualization_style: str = "boxes"

    def __post_init__(self) -> None:
        i = self.stats_log_interval
        _require(_is_number(i) and i > 0, "stats_log_interval", i, "must be > 0 (seconds)")
        _require(
            self.batch_visualization_style in ("bar", "boxes"),
            "batch_visualization_style",
            self.batch_visualization_style,
            "must be bar or boxes",
        )


@dataclass(frozen=True, slots=True)
class DataParallelConfig:
    """Data parallelism: `size` engine cores (each a whole replica of the model, itself possibly a
    tensor-parallel group) behind one frontend, started by `backend` ("mp": local processes, "ray": Ray
    actors), each request sent to one of them by `routing` ("cache": where its prefix is cached, load
    considered; "least_loaded"; "round_robin"); `session_affinity`: requests of one session (the
    request's `user`, or its X-Session-Id header) go to the same replica; `router_tuning`: the router's
    knobs over their defaults (`pagedrs.engine.dp_router_tuning`)."""

    size: int = 1
    backend: str = "mp"
    routing: str = "cache"
    session_affinity: bool = False
    router_tuning: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        _require(
            _is_int(self.size) and self.size >= 1, "data_parallel_size", self.size, "must be an int >= 1"
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
            from pagedrs.engine.dp_router_tuning import check_tuning

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


SPEC_METHODS = ("ngram", "self_draft", "draft_model")
_DEFAULT_LOOKUP = (2, 4)  # prompt_lookup_min, prompt_lookup_max


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config` names where vLLM has them).

    `method`: "ngram" (prompt lookup over the request's own tokens, proposed by the Rust scheduler:
    the tokens that followed the latest earlier occurrence of the last n tokens, for the largest n in
    [`prompt_lookup_min`, `prompt_lookup_max`]) or "self_draft" (early exit: the target's first
    `draft_layers` layers, its final norm and its LM head propose, writing the KV of those layers in
    place; default a quarter of the layers) or "draft_model" (`model`: a smaller model folder, GGUF
    file or Hub name sharing the target's tokenizer, with its own KV pool over the target's block ids;
    vLLM infers this method from `model` alone). `num_speculative_tokens` drafts are verified per decoding
    sequence and step (at most: with `adaptive`, a sequence proposes one more draft than it had accepted
    last time, and after a proposal with none accepted it pauses 1, 2, 4, .. 32 decode steps; engine-wide,
    speculating steps measured slower per emitted token than steps without drafts at the same batch size
    pause all proposals for 64 steps, doubling up to 4096 while they keep losing). Speculation pauses for
    a step while more than `disable_by_batch_size` sequences run (None: the method's default).
    Requests whose sampling keeps per-token state the verifier does not model (penalties, logit_bias,
    min_tokens, LoRA adapters) decode without drafts; logprobs come from each token's verification row; a grammar
    (structured outputs) masks each verified row, so a draft it rejects is cut there.
    `draft_tensor_parallel_size` (vLLM's name): only 1, where a draft model runs (whole, on rank 0)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = _DEFAULT_LOOKUP[0]
    prompt_lookup_max: int = _DEFAULT_LOOKUP[1]
    draft_layers: int | None = None
    disable_by_batch_size: int | None = None
    adaptive: bool = True
    model: str | None = None
    draft_tensor_parallel_size: int | None = None

    def __post_init__(self) -> None:
        _require(
            self.method in SPEC_METHODS,
            "speculative_config method",
            self.method,
            f"must be one of {SPEC_METHODS}",
        )
        k = self.num_speculative_tokens
        _require(_is_int(k) and 1 <= k <= 32, "num_speculative_tokens", k, "must be an int in [1, 32]")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        _require(_is_int(hi) and hi >= 1, "prompt_lookup_max", hi, "must be an int >= 1")
        _require(
            _is_int(lo) and 1 <= lo <= hi,
            "prompt_lookup_min",
            lo,
            f"must be an int in [1, prompt_lookup_max={hi}]",
        )
        d = self.draft_layers
        _require(d is None or (_is_int(d) and d >= 1), "draft_layers", d, "must be an int >= 1")
        b = self.disable_by_batch_size
        _require(b is None or (_is_int(b) and b >= 1), "disable_by_batch_size", b, "must be an int >= 1")
        _require(isinstance(self.adaptive, bool), "adaptive", self.adaptive, "must be a bool")
        _require(
            self.draft_tensor_parallel_size in (None, 1),
            "draft_tensor_parallel_size",
            self.draft_tensor_parallel_size,
            "must be 1: a draft model runs whole on rank 0 and broadcasts its drafts",
        )
        if self.method == "draft_model":
            _require(
                isinstance(self.model, str) and bool(self.model),
                "speculative_config model",
                self.model,
                "must name the draft model (a folder, a .gguf file or a Hub name) for method 'draft_model'",
            )
        else:
            _require(
                self.model is None, "speculative_config model", self.model, "is only for method 'draft_model'"
            )

    @classmethod
    def from_dict(cls, spec: dict | str | None) -> SpeculativeConfig | None:
        """From `speculative_config` (a dict or its JSON text, as `--speculative-config` takes);
        ValueError naming an unknown key or a method pagedrs does not implement. vLLM's spellings are
        taken: a `model` alone is a draft model, `"[ngram]"` as the method or the model is n-gram, and
        where only one of `prompt_lookup_min` / `prompt_lookup_max` is given the other follows it where
        the default would leave an empty range (vLLM sets the missing one equal to the given one)."""
        if spec is None:
            return None
        if isinstance(spec, str):
            import json

            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
        _require(isinstance(spec, dict), "speculative_config", spec, "must be a dict (or its JSON)")
        assert isinstance(spec, dict)
        spec = dict(spec)
        if spec.get("method") in ("eagle", "eagle3", "medusa", "mtp"):
            raise ValueError(
                f"speculative_config {spec!r}: method {spec['method']!r} is not implemented; use 'ngram' "
                "(prompt lookup), 'self_draft' (the model's own first layers) or 'draft_model'"
            )
        if spec.get("model") == "[ngram]" and spec.get("method") in (None, "ngram", "[ngram]"):
            del spec["model"]  # vLLM 0.6's speculative_model="[ngram]"
            spec["method"] = "ngram"
        if "method" not in spec and spec.get("model") is not None:  # vLLM: a model alone is a draft model
            spec["method"] = "draft_model"
        if spec.get("method") == "[ngram]":
            spec["method"] = "ngram"
        lo, hi = spec.get("prompt_lookup_min"), spec.get("prompt_lookup_max")
        if isinstance(lo, int) and hi is None:
            spec["prompt_lookup_max"] = max(lo, _DEFAULT_LOOKUP[1])
        elif isinstance(hi, int) and lo is None:
            spec["prompt_lookup_min"] = min(hi, _DEFAULT_LOOKUP[0])
        names = set(cls.__dataclass_fields__)
        unknown = sorted(set(spec) - names)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown}; known: {sorted(names)}")
        if "method" not in spec or "num_speculative_tokens" not in spec:
            raise ValueError(f"speculative_config needs 'method' and 'num_speculative_tokens', got {spec!r}")
        return cls(**spec)


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """Prefix-cache (KV) events of one engine core. The first fields are vLLM's `KVEventsConfig`
    (`--kv-events-config`): with `enable_kv_cache_events` and the "zmq" publisher, each step's
    BlockStored / BlockRemoved / AllBlocksCleared events go out as vLLM's KVEventBatch on a ZeroMQ PUB
    socket at `endpoint` (its port offset by the data-parallel rank, as vLLM does), the last
    `buffer_steps` batches replayable from `replay_endpoint`. `step_events`: each step message carries
    the step's net change (`EngineCoreOutputs.kv_events`, for the data-parallel router);
    `data_parallel_rank`: this core's replica, stamped on every batch."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" or "null"; None: "zmq" when enabled, else "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    step_events: bool = False
    data_parallel_rank: int = 0

    def __post_init__(self) -> None:
        p = self.publisher
        _require(p in (None, "zmq", "null"), "kv_events_config.publisher", p, "must be 'zmq' or 'null'")
        for name in ("endpoint", "replay_endpoint"):
            e = getattr(self, name)
            ok = e is None and name == "replay_endpoint" or isinstance(e, str) and "://" in e
            _require(ok, f"kv_events_config.{name}", e, "must be a ZeroMQ address such as tcp://*:5557")
        for name, low in (("buffer_steps", 1), ("hwm", 0), ("max_queue_size", 1), ("data_parallel_rank", 0)):
            v = getattr(self, name)
            _require(_is_int(v) and v >= low, f"kv_events_config.{name}", v, f"must be an int >= {low}")
        _require(isinstance(self.topic, str), "kv_events_config.topic", self.topic, "must be a string")

    @property
    def publishes(self) -> bool:
        """Events go out on ZeroMQ (enabled, and the publisher is not "null")."""
        return self.enable_kv_cache_events and self.publisher in (None, "zmq")

    @property
    def records(self) -> bool:
        """The scheduler records its prefix-cache events (someone consumes them)."""
        return self.enable_kv_cache_events or self.step_events

    @classmethod
    def from_spec(
        cls,
        spec: KVEventsConfig | dict | str | None,
        *,
        step_events: bool = False,
        data_parallel_rank: int = 0,
    ) -> KVEventsConfig:
        """From vLLM's `--kv-events-config` JSON (or its dict); ValueError naming a bad value or key."""
        if isinstance(spec, cls):
            spec = {f: getattr(spec, f) for f in cls.__dataclass_fields__}
        elif isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as exc:
                raise ValueError(f"kv_events_config must be a JSON object, got {spec!r} ({exc})") from None
        if spec is None:
            spec = {}
        if not isinstance(spec, dict):
            raise ValueError(f"kv_events_config must be a JSON object, got {spec!r}")
        unknown = sorted(set(spec) - set(cls.__dataclass_fields__))
        if unknown:
            known = sorted(cls.__dataclass_fields__)
            raise ValueError(f"kv_events_config: unknown keys {unknown} in {spec!r}; known: {known}")
        kw = {"step_events": step_events, "data_parallel_rank": data_parallel_rank, **spec}
        kw["step_events"] = bool(kw["step_events"]) or step_events
        return cls(**kw)


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
