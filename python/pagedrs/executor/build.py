"""From the launch config to a running executor: threads, the tensor-parallel ranks, the model (rank 0's
shard), the model runner, and the executor that owns it. The engine core gets the executor and the loaded
model's description, never the runner."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from pagedrs._gomp import gomp_spin_note
from pagedrs.config import EngineConfig
from pagedrs.executor.executor import TPExecutor, UniProcExecutor
from pagedrs.executor.rank import cpu_threads_per_rank
from pagedrs.executor.rank_processes import RankProcesses
from pagedrs.executor.start import start_ranks, stop_ranks
from pagedrs.executor.startup_log import log_startup
from pagedrs.loader import LoadedModel, load_model
from pagedrs.runner.model_runner import ModelRunner

if TYPE_CHECKING:
    from pagedrs.launch_config import LaunchConfig
    from pagedrs.models.interface import CausalLM

__all__ = ["build_executor", "load_draft_model", "load_engine"]

logger = logging.getLogger("pagedrs.engine")


def build_executor(
    config: EngineConfig, loaded: LoadedModel, ranks: RankProcesses | None = None
) -> UniProcExecutor:
    """The runner over `loaded` (rank 0's shard when `ranks` are the other ranks' processes) and its executor:
    one device, tensor-parallel, or liquid (a world group)."""
    eos = loaded.eos_token_ids
    if ranks is None:
        draft = load_draft_model(config)
        return UniProcExecutor(ModelRunner(config, loaded.model, eos_token_ids=eos, draft_model=draft))
    # a draft model runs whole on rank 0 (vLLM's draft_tensor_parallel_size=1); its drafts reach the other
    # ranks by broadcast each step
    draft = load_draft_model(config) if ranks.world is None else None
    runner = ModelRunner(config, loaded.model, eos_token_ids=eos, tp=ranks.tp, draft_model=draft)
    if ranks.world is not None:
        from pagedrs.executor.liquid.executor import LiquidExecutor

        return LiquidExecutor(runner, ranks)
    return TPExecutor(runner, ranks)


def load_draft_model(config: EngineConfig) -> CausalLM | None:
    """The draft model of speculative decoding's "draft_model" method (on the target's device, in the
    engine's dtype), else None."""
    spec = config.speculative
    if spec is None or spec.method != "draft_model":
        return None
    assert spec.model is not None  # SpeculativeConfig checks it
    draft = load_model(
        spec.model, dtype=config.model.dtype, device=config.device.device, with_tokenizer=False
    )
    logger.info(
        "speculative decoding: draft model %s (%d layers), %d drafts a step",
        spec.model,
        draft.model.num_layers,
        spec.num_speculative_tokens,
    )
    return draft.model


def load_engine(launch: LaunchConfig) -> tuple[EngineConfig, LoadedModel, UniProcExecutor]:
    """Start the other tensor-parallel ranks, load rank 0's model, resolve the engine's config for it and
    build its executor; the ranks are stopped again if anything fails."""
    device_cfg, parallel = launch.device, launch.parallel
    size = len(parallel.liquid_gpu_range or ()) or parallel.tensor_parallel_size
    if device_cfg.device.type == "cpu" and (device_cfg.num_threads is not None or size > 1):
        torch.set_num_threads(cpu_threads_per_rank(device_cfg.num_threads, size))
    if device_cfg.device.type == "cpu" and (note := gomp_spin_note()) is not None:
        logger.warning(note)
    ranks = start_ranks(launch) if size > 1 else None
    try:
        loaded = load_model(
            launch.model.model,
            dtype=launch.model.dtype,
            device=device_cfg.device,
            tokenizer=launch.model.tokenizer,
            tp=ranks.tp if ranks is not None else None,
            with_tokenizer=launch.with_tokenizer,
            opts=launch.load,
        )
        config = launch.resolve(loaded.max_len)
        log_startup(launch, config, loaded.model_path, loaded.hf_config, loaded.model.dtype)
        weights = loaded.weight_nbytes  # packed weights at their packed size
        logger.info("Loading model weights took %.4f GB", weights / (1 << 30))
        return config, loaded, build_executor(config, loaded, ranks)
    except BaseException:
        if ranks is not None:
            stop_ranks(ranks)
        raise
