"""Starting a tensor-parallel group from the launch config: checks first (head counts, devices, Ray), then the
ranks, then rank 0 joins the group."""

from __future__ import annotations

import logging

import torch

from pagedrs.executor.rank_processes import MpRanks, RayRanks, rank_devices
from pagedrs.launch_config import LaunchConfig

__all__ = ["STARTUP_TIMEOUT_S", "start_ranks", "stop_ranks"]

logger = logging.getLogger("pagedrs.executor")

STARTUP_TIMEOUT_S = 180.0  # every worker must have started its interpreter and joined by then


def start_ranks(launch: LaunchConfig) -> MpRanks | RayRanks:
    """Ranks 1..N-1 started and joined: `.tp` is rank 0's TPGroup. ValueError for a model whose heads
    do not split over N ranks, too few devices or an unreachable Ray cluster, before any process starts."""
    from pagedrs.loader import load_hf_config
    from pagedrs.models.utils import check_tensor_parallel

    parallel, device = launch.parallel, launch.device.device
    gpu_range = parallel.liquid_gpu_range
    liquid = gpu_range is not None
    devices = None
    if gpu_range is not None:
        from pagedrs.executor.liquid.shards import check_liquid

        size = len(gpu_range)
        shards = parallel.liquid_total_num_shards
        assert shards is not None  # INVARIANT: ParallelConfig sets it with a range
        check_liquid(load_hf_config(launch.model.model, launch.load), shards, size)
        if device.type == "cuda":
            devices = [torch.device("cuda", int(i)) for i in gpu_range]
            have = torch.cuda.device_count()
            if max(gpu_range) >= have:
                raise ValueError(f"liquid_gpu_range {gpu_range} names GPUs beyond the {have} visible")
            device = devices[0]
    else:
        size = parallel.tensor_parallel_size
        check_tensor_parallel(load_hf_config(launch.model.model, launch.load), size)
        rank_devices(device, size)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    args_json = launch.to_json()
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
