"""The lines vLLM prints while an engine starts, with the values pagedrs resolved: the dtype cast, the
config line (vLLM 0.4's), chunked prefill, and the KV cache's size in tokens and in requests (vLLM's
later versions). Users grep for these; the text is vLLM's."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from pagedrs import __version__
from pagedrs.config import EngineConfig
from pagedrs.runner.kv_groups import WindowGroup, max_live_blocks, step_tokens

if TYPE_CHECKING:
    from pagedrs.launch_config import LaunchConfig

__all__ = [
    "config_line",
    "loaded_format",
    "loaded_quantization",
    "log_dtype_cast",
    "log_kv_cache_size",
    "log_startup",
    "pool_concurrency",
]

logger = logging.getLogger("pagedrs.engine")

_DTYPE_NAMES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def checkpoint_dtype(hf_config: Any) -> torch.dtype | None:
    """The element type the checkpoint's config declares (None when it declares none)."""
    d = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(d, str):
        return _DTYPE_NAMES.get(d)
    return d if isinstance(d, torch.dtype) else None


def log_dtype_cast(config_dtype: torch.dtype | None, dtype: torch.dtype) -> None:
    """vLLM's message when the weights run in another type than the checkpoint's: up- and downcasts to
    or from float32 are INFO, a float16 <-> bfloat16 cast (a range or precision change) a WARNING."""
    if config_dtype is None or config_dtype == dtype:
        return
    if dtype == torch.float32:
        logger.info("Upcasting %s to %s.", config_dtype, dtype)
    elif config_dtype == torch.float32:
        logger.info("Downcasting %s to %s.", config_dtype, dtype)
    else:
        logger.warning("Casting %s to %s.", config_dtype, dtype)


def loaded_format(load_format: str, model_path: str) -> str:
    """What `load_format="auto"` loaded from `model_path`: gguf, safetensors or pt."""
    from pagedrs.loader import gguf_file
    from pagedrs.loader.safetensors import safetensors_files

    if load_format != "auto":
        return load_format
    if gguf_file(model_path) is not None:
        return "gguf"
    return "safetensors" if safetensors_files(model_path) else "pt"


def loaded_quantization(forced: str | None, model_path: str, hf_config: Any) -> str | None:
    """The quantization the weights were loaded from: gguf, the checkpoint's quant_method, or None."""
    from pagedrs.loader import gguf_file
    from pagedrs.quantization.config import detect_quantization

    if gguf_file(model_path) is not None:
        return "gguf"
    if hf_config is None:
        return forced
    quant = detect_quantization(hf_config, model_path, forced)
    return quant.name if quant is not None else None


def config_line(
    launch: LaunchConfig, config: EngineConfig, model_path: str, dtype: torch.dtype, hf_config: Any = None
) -> str:
    """vLLM 0.4's config line with resolved values: the model as given (the default model's file when
    none was), `dtype=torch.float16`, `max_seq_len` the context length in force, `device_config=cuda`,
    `load_format` and `quantization` what was loaded (`hf_config` declares the quantization); then
    pagedrs' scheduler settings."""
    load = launch.load
    model = launch.model.model if launch.model.model is not None else model_path
    values: dict[str, object] = {
        "model": repr(model),
        "tokenizer": repr(launch.model.tokenizer if launch.model.tokenizer is not None else model),
        "skip_tokenizer_init": not launch.with_tokenizer,
        "tokenizer_mode": load.tokenizer_mode,
        "revision": load.revision,
        "rope_scaling": launch.rope_scaling,
        "rope_theta": launch.rope_theta,
        "tokenizer_revision": load.tokenizer_revision,
        "trust_remote_code": load.trust_remote_code,
        "dtype": dtype,
        "max_seq_len": config.scheduler.max_model_len,
        "download_dir": load.download_dir,
        "load_format": loaded_format(load.load_format, model_path),
        "tensor_parallel_size": config.parallel.tensor_parallel_size,
        "pipeline_parallel_size": launch.pipeline_parallel_size,
        "disable_custom_all_reduce": launch.disable_custom_all_reduce,
        "quantization": loaded_quantization(load.quantization, model_path, hf_config),
        "enforce_eager": launch.enforce_eager,
        "kv_cache_dtype": config.cache.cache_dtype,
        "device_config": config.device.device.type,
        "seed": load.seed,
        "served_model_name": config.model.served_model_name or model,
        "enable_prefix_caching": config.cache.enable_prefix_caching,
        "enable_chunked_prefill": config.scheduler.enable_chunked_prefill,
        "disable_sliding_window": bool(load.overrides.get("disable_sliding_window")),
        "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
        "max_num_seqs": config.scheduler.max_num_seqs,
        "block_size": config.cache.block_size,
        "swap_space": config.cache.swap_space,
    }
    return ", ".join(f"{k}={v}" for k, v in values.items())


def log_startup(
    launch: LaunchConfig, config: EngineConfig, model_path: str, hf_config: Any, dtype: torch.dtype
) -> None:
    """The lines vLLM prints before the weights are reported: the cast, the config line, chunked prefill."""
    log_dtype_cast(checkpoint_dtype(hf_config), dtype)
    logger.info(
        "Initializing an LLM engine (pagedrs v%s) with config: %s",
        __version__,
        config_line(launch, config, model_path, dtype, hf_config),
    )
    if config.scheduler.enable_chunked_prefill:
        logger.info(
            "Chunked prefill is enabled with max_num_batched_tokens=%d.",
            config.scheduler.max_num_batched_tokens,
        )


def pool_concurrency(
    num_blocks: int,
    groups: Sequence[WindowGroup],
    num_layers: int,
    block_size: int,
    max_model_len: int,
    step: int,
    recurrent_slots: int = 0,
) -> list[tuple[str, int, float]]:
    """Per KV pool that stores some layer's KV: (label, blocks, requests of the full context length it holds
    at once). The full-attention pool (label `full`, absent when every layer is windowed: it is bookkeeping)
    holds a request's every block, a window group's pool (`window:W`) only its live window blocks at the
    largest step, as vLLM's `SlidingWindowSpec.max_memory_usage_bytes`, and the recurrent group's
    `recurrent_slots` state slots (`recurrent`) one slot per request, however long."""
    per_request = math.ceil(max_model_len / block_size)
    out = []
    if num_layers > sum(len(g.layers) for g in groups):
        out.append(("full", num_blocks, num_blocks / per_request))
    for g in groups:
        need = min(per_request, max_live_blocks(g.window, block_size, step))
        out.append((f"window:{g.window}", g.num_blocks, g.num_blocks / need))
    if recurrent_slots:
        out.append(("recurrent", recurrent_slots, float(recurrent_slots)))
    return out


def log_kv_cache_size(
    num_blocks: int,
    block_size: int,
    max_model_len: int,
    groups: Sequence[WindowGroup] = (),
    num_layers: int = 0,
    step: int = 0,
    recurrent_slots: int = 0,
) -> None:
    """vLLM's KV cache lines: the pool's size in tokens and how many requests of the full context length
    it holds at once (labelled "GPU" on every device, as vLLM prints it). With KV-cache groups
    (`groups` of a model of `num_layers` layers, `step` tokens at the largest step) the concurrency is the
    tightest pool's, and the size the full-attention pool's tokens (with every layer windowed, the
    smallest window pool's); `recurrent_slots`: the recurrent group's state slots, one per request."""
    # Without groups every layer is in the full-attention pool, however many layers there are.
    layers = num_layers if groups else max(num_layers, 1)
    pools = pool_concurrency(num_blocks, groups, layers, block_size, max_model_len, step, recurrent_slots)
    tokens = (pools[0][1] if pools[0][0] == "full" else min(n for _, n, _ in pools)) * block_size
    logger.info("GPU KV cache size: %s tokens", f"{tokens:,}")
    logger.info(
        "Maximum concurrency for %s tokens per request: %.2fx",
        f"{max_model_len:,}",
        min(fits for _, _, fits in pools),
    )


def kv_pools_line(
    num_blocks: int,
    groups: Sequence[WindowGroup],
    num_layers: int,
    block_size: int,
    max_model_len: int,
    step: int,
    recurrent: tuple[int, int] = (0, 0),
) -> str:
    """One line naming each KV pool's size (the full-attention pool, every window group's and the recurrent
    group's `recurrent` = (state slots, linear-attention layers)) and the requests of the full context length
    they hold at once: the least over the pools, a window group's request holding only its live window
    blocks, a recurrent one one state slot (a pool of no layer is bookkeeping and holds nothing)."""
    slots, recurrent_layers = recurrent
    pools = pool_concurrency(num_blocks, groups, num_layers, block_size, max_model_len, step, slots)
    full_layers = num_layers - sum(len(g.layers) for g in groups)
    parts = []
    if full_layers:
        parts.append(f"full attention {num_blocks:,} blocks ({full_layers} layers)")
    else:
        parts.append("full attention: no layer (its pool is bookkeeping only)")
    parts += [f"window {g.window} {g.num_blocks:,} blocks ({len(g.layers)} layers)" for g in groups]
    if slots:
        parts.append(f"recurrent state {slots:,} slots ({recurrent_layers} layers)")
    return (
        f"KV cache pools: {'; '.join(parts)}; maximum concurrency for {max_model_len:,} tokens per request "
        f"over every pool: {min(fits for _, _, fits in pools):.2f}x"
    )


def log_engine_ready(core: Any, kv: Any) -> None:
    """The engine core's start lines (`EngineCore`, with its KV spec `kv`), on the engine's logger."""
    log = logging.getLogger("pagedrs.engine")
    num_blocks, num_swap = kv.num_blocks, kv.num_swap_blocks
    if core.device.type == "cuda":
        log.info("# GPU blocks: %d, # CPU blocks: %d", num_blocks, num_swap)
    else:
        log.info("# CPU blocks: %d (device pool), # swap blocks: %d", num_blocks, num_swap)
    block_size = core.config.cache.block_size
    log_kv_cache_size(
        num_blocks,
        block_size,
        core.max_model_len,
        kv.groups,
        kv.num_layers,
        step_tokens(core.config),
        kv.recurrent_slots,
    )
    log.info(
        "engine ready: model=%s device=%s tp=%d dtype=%s max_model_len=%d kv blocks=%d x %d tokens "
        "(%.2f GiB per rank), swap blocks=%d",
        core.model_name,
        core.device,
        core.executor.tensor_parallel_size,
        kv.dtype,
        core.max_model_len,
        num_blocks,
        block_size,
        num_blocks * kv.bytes_per_block / (1 << 30),
        num_swap,
    )
