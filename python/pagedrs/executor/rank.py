"""A tensor-parallel rank >= 1: its shard of the model and of the KV cache, and a loop that runs
every step rank 0 broadcasts. Started as `python -m pagedrs.executor.rank_main` by the `mp` executor, or
inside a Ray actor by the `ray` executor; both call `run_rank`.

A rank that fails writes its error into the group's store (`worker_error/<rank>`) for rank 0 to
report, then exits: its peers' collectives fail at once (the connection closes), so nobody hangs.
"""

from __future__ import annotations

import logging
import os

import torch

from pagedrs.distributed.group import TPGroup, connect_tp_group, create_store
from pagedrs.executor.step_packet import HEADER_LEN, Op, unpack_step
from pagedrs.launch_config import LaunchConfig
from pagedrs.lora.manager import LoRASlots
from pagedrs.runner.model_runner import ModelRunner

__all__ = ["agree_kv_blocks", "cpu_threads_per_rank", "error_key", "run_rank"]

logger = logging.getLogger("pagedrs.worker")


def error_key(rank: int) -> str:
    return f"worker_error/{rank}"


def agree_kv_blocks(runner: ModelRunner, tp: TPGroup) -> tuple[int, int]:
    """Each rank sizes its pool from its own memory; every rank then takes the minimum, so the block
    tables the scheduler writes are valid everywhere."""
    local = [runner.determine_num_blocks(), runner.determine_num_swap_blocks()]
    num_blocks, num_swap = tp.min_cpu(local)
    return num_blocks, num_swap


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask (taskset, a container's cpuset), not the machine's count."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # no affinity API (macOS)
        return os.cpu_count() or 1


def cpu_threads_per_rank(num_threads: int | None, size: int) -> int:
    """Torch intra-op threads for one of `size` CPU ranks, in the order a user sets them: `--num-threads`
    (per rank), then `OMP_NUM_THREADS` (the process's budget, as torch honours it), then the usable CPUs;
    a budget is shared out between the ranks."""
    if num_threads:
        return num_threads
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    budget = int(omp) if omp.isdigit() and int(omp) >= 1 else usable_cpus()
    return max(1, budget // size)


def run_rank(
    rank: int, size: int, host: str, port: int, launch_json: str, device: str, timeout_s: float
) -> None:
    """Join the group, load this rank's shard, agree on the pool, then execute steps until SHUTDOWN."""
    from pagedrs.loader import load_model

    store = create_store(host, port, rank, size, timeout_s)
    tp: TPGroup | None = None
    try:
        launch = LaunchConfig.from_json(launch_json)
        dev = torch.device(device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        else:
            torch.set_num_threads(cpu_threads_per_rank(launch.device.num_threads, size))
        if launch.parallel.liquid_gpu_range is not None:
            from pagedrs.executor.liquid.rank import LiquidRank

            liquid = LiquidRank(store, rank, size, dev, host=host, timeout_s=timeout_s, launch=launch)
            tp = liquid.world
            liquid.loop()
            liquid.close()
            return
        tp = connect_tp_group(store, rank, size, dev, host=host, timeout_s=timeout_s)
        model = launch.model
        loaded = load_model(
            model.model, dtype=model.dtype, device=dev, tp=tp, with_tokenizer=False, opts=launch.load
        )
        config = launch.resolve(loaded.max_len)
        runner = ModelRunner(config, loaded.model, tp=tp)
        num_blocks, num_swap = agree_kv_blocks(runner, tp)
        runner.init_kv_cache(num_blocks, num_swap)
        lora = LoRASlots(loaded.model, config.lora, dev) if config.lora is not None else None
        if lora is not None:  # as rank 0's (UniProcExecutor.attach_lora)
            lora.batch.use_kernels = runner.layer_kernels
        logger.info("rank %d ready: %d KV blocks on %s", rank, num_blocks, dev)
        _step_loop(runner, tp, lora)
    except BaseException as exc:
        logger.exception("tensor-parallel rank %d failed", rank)
        try:
            store.set(error_key(rank), f"{type(exc).__name__}: {exc}")
        finally:
            if tp is not None:
                tp.abort()
        raise
    if tp is not None:
        tp.abort()


def _step_loop(runner: ModelRunner, tp: TPGroup, lora: LoRASlots | None = None) -> None:
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    while True:
        tp.broadcast_cpu(header)
        h = header.numpy().copy()
        if h[0] == Op.SHUTDOWN:
            return
        if h[0] == Op.LORA:
            if lora is None:
                raise RuntimeError("a LoRA message reached a rank started without enable_lora")
            message = torch.empty(int(h[1]), dtype=torch.uint8)
            tp.broadcast_cpu(message)
            lora.apply(message.numpy().tobytes())
            continue
        if h[0] != Op.EXECUTE:
            raise RuntimeError(f"unknown step opcode {int(h[0])}")
        payload = torch.empty(int(h[1]), dtype=torch.int64)
        if payload.numel():
            tp.broadcast_cpu(payload)
        plan, extra = unpack_step(h, payload.numpy())
        if lora is not None:
            lora.prepare(plan)
        runner.execute_model(plan, extra)
