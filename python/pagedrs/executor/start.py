"""Starting a tensor-parallel group from EngineArgs: checks first (head counts, devices, Ray), then the
ranks, then rank 0 joins the group."""

from __future__ import annotations

import logging
from typing import Any

import msgspec
import torch

from pagedrs.executor.rank_processes import MpRanks, RayRanks, rank_devices

__all__ = ["STARTUP_TIMEOUT_S", "start_ranks", "stop_ranks"]

logger = logging.getLogger("pagedrs.executor")

STARTUP_TIMEOUT_S = 180.0  # every worker must have started its interpreter and joined by then


def start_ranks(args: Any, device: torch.device) -> MpRanks | RayRanks:
    """Ranks 1..N-1 started and joined: `.tp` is rank 0's TPGroup. ValueError for a model whose heads
    do not split over N ranks, too few devices or an unreachable Ray cluster, before any process starts."""
    from pagedrs.loader import load_hf_config
    from pagedrs.models.utils import check_tensor_parallel

    parallel = args.parallel_config()
    liquid = parallel.liquid_gpu_range is not None
    devices = None
    if liquid:
        from pagedrs.executor.liquid import check_liquid

        size = len(parallel.liquid_gpu_range)
        check_liquid(load_hf_config(args.model, args.load_options()), parallel.liquid_total_num_shards, size)
        if device.type == "cuda":
            devices = [torch.device("cuda", int(i)) for i in parallel.liquid_gpu_range]
            have = torch.cuda.device_count()
            if max(parallel.liquid_gpu_range) >= have:
                raise ValueError(
                    f"liquid_gpu_range {parallel.liquid_gpu_range} names GPUs beyond the {have} visible"
                )
            device = devices[0]
    else:
        size = parallel.tensor_parallel_size
        check_tensor_parallel(load_hf_config(args.model, args.load_options()), size)
        rank_devices(device, size)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    args_json = msgspec.json.encode(args).decode()
    ranks: MpRanks | RayRanks
    if parallel.backend == "ray":
        if liquid:
            raise ValueError(
                "liquid scaling runs on the 'mp' executor; drop distributed_executor_backend='ray'"
            )
        ranks = RayRanks(args_json, size, device)
    else:
        level = logging.getLevelName(logging.getLogger("pagedrs").getEffectiveLevel()).lower()
        ranks = MpRanks(args_json, size, device, log_level=level, devices=devices)
    try:
        ranks.connect(STARTUP_TIMEOUT_S, liquid=liquid)
    except BaseException:
        stop_ranks(ranks)
        raise
    logger.info("tensor-parallel group of %d ranks joined (%s backend)", size, parallel.backend)
    return ranks


def stop_ranks(ranks: MpRanks | RayRanks) -> None:
    """Kill the ranks and tear rank 0's group down (startup failed)."""
    ranks.stop(0.0)
    ranks.abort_groups()
