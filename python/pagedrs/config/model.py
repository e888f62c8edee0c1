"""The model, the KV cache, the scheduler's limits, the device and the observability configs, and the KV
element types (fp8 included) the cache may store."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedrs.config.checks import _is_int, _is_number, _require

_DTYPES = ("auto", "float32", "float16", "bfloat16", "float", "half")


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
    # Images: the most of each modality one prompt may carry ({"image": 16} unless given), and the folder
    # whose files chat `image_url` parts may name (None: no local files).
    limit_mm_per_prompt: dict[str, int] | None = None
    allowed_local_media_path: str | None = None

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
        limits = self.limit_mm_per_prompt
        _require(
            limits is None
            or (isinstance(limits, dict) and all(_is_int(v) and v >= 0 for v in limits.values())),
            "limit_mm_per_prompt",
            limits,
            'must be a dict such as {"image": 4}',
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
    # swap_space is the device's default, not given: a core on another device takes that device's default
    swap_space_is_default: bool = False
    enable_prefix_caching: bool = True
    cache_dtype: str = "auto"  # auto (the model's dtype) | fp8 = fp8_e4m3 | fp8_e5m2
    # The host KV tier (vLLM's KV offloading): GiB of CPU memory over all tensor-parallel ranks; 0: none.
    kv_offloading_size: float = 0.0
    kv_offloading_backend: str = "native"
    # The disk tier behind it: a folder of block files (one per block hash and model) and its bound in GiB.
    kv_offloading_blocks: int | None = None  # the host tier in blocks instead (vLLM's num_cpu_blocks)
    kv_offloading_disk_path: str | None = None
    kv_offloading_disk_size: float = 0.0

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
        o = self.kv_offloading_size
        _require(_is_number(o) and o >= 0, "kv_offloading_size", o, "must be >= 0 (GiB)")
        b = self.kv_offloading_backend
        _require(b == "native", "kv_offloading_backend", b, "must be 'native' (the host KV tier)")
        n = self.kv_offloading_blocks
        _require(n is None or (_is_int(n) and n > 0), "kv_offloading_blocks", n, "must be an int > 0")
        d = self.kv_offloading_disk_size
        _require(_is_number(d) and d >= 0, "kv_offloading_disk_size", d, "must be >= 0 (GiB)")
        if self.kv_offloading_disk_path is not None:
            _require(
                d > 0 and (o > 0 or n is not None),
                "kv_offloading_disk_path",
                self.kv_offloading_disk_path,
                "needs kv_offloading_disk_size > 0 and kv_offloading_size > 0 (disk blocks are read "
                "into the host tier)",
            )
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
    # Image-encoder rows a step may reach (vLLM's SchedulerConfig.max_num_encoder_input_tokens); None: no
    # budget beyond the images the step's token budget reaches.
    max_num_encoder_input_tokens: int | None = None

    def __post_init__(self) -> None:
        _require(
            self.max_num_encoder_input_tokens is None
            or (_is_int(self.max_num_encoder_input_tokens) and self.max_num_encoder_input_tokens >= 1),
            "max_num_encoder_input_tokens",
            self.max_num_encoder_input_tokens,
            "must be None or an int >= 1",
        )
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
