"""A liquid rank (rank >= 1 of `liquid_gpu_range`): idle until a scale-out hands it shards, then a
tensor-parallel rank like any other, until a scale-in takes them back. Every step header reaches every
rank (the world group); idle ranks drop the plan."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from pagedrs.distributed.group import TPGroup
from pagedrs.executor.liquid.log import log_sends, memory_info, shard_moves
from pagedrs.executor.liquid.shards import (
    LiquidStats,
    PoolSpec,
    abort_groups,
    connect_liquid_groups,
    rebuild_model,
    receive_shards,
    send_shards,
)
from pagedrs.executor.step_packet import HEADER_LEN, Op, liquid_group_blocks, unpack_step
from pagedrs.launch_config import LaunchConfig
from pagedrs.models.interface import CausalLM
from pagedrs.runner.kv_groups import WindowGroup, layer_windows, window_groups_for

__all__ = ["LiquidRank"]

logger = logging.getLogger("pagedrs.worker")


class LiquidRank:
    def __init__(
        self,
        store: torch.distributed.Store,
        rank: int,
        world_size: int,
        device: torch.device,
        *,
        host: str,
        timeout_s: float,
        launch: LaunchConfig,
    ) -> None:
        from pagedrs.config import kv_cache_torch_dtype
        from pagedrs.loader import load_hf_config, resolve_dtype
        from pagedrs.loader.options import apply_overrides
        from pagedrs.models.registry import get_model_class

        self.rank = rank
        self.device = device
        self.world, self.groups = connect_liquid_groups(
            store, rank, world_size, device, host=host, timeout_s=timeout_s
        )
        opts = launch.load
        self.hf_config = load_hf_config(launch.model.model, dataclasses.replace(opts, overrides={}))
        cap = apply_overrides(self.hf_config, opts.overrides)
        self.model_cls = get_model_class(self.hf_config)
        self.dtype = resolve_dtype(launch.model.dtype, self.hf_config, device)
        max_len = int(getattr(self.hf_config, "max_position_embeddings", 0) or 2048)
        if cap:
            max_len = min(max_len, cap)
        self.config = launch.resolve(max_len)
        self.kv_dtype = kv_cache_torch_dtype(self.config.cache.cache_dtype, self.dtype)
        self.runner: Any = None  # a ModelRunner while this rank holds shards

    def _build(self, tp: TPGroup) -> CausalLM:
        return rebuild_model(self.model_cls, self.hf_config, self.dtype, self.device, tp)

    def loop(self) -> None:
        header = torch.zeros(HEADER_LEN, dtype=torch.int64)
        while True:
            self.world.broadcast_cpu(header)
            h = header.numpy().copy()
            op = int(h[0])
            if op == Op.SHUTDOWN:
                return
            if op == Op.EXECUTE:
                payload = torch.empty(int(h[1]), dtype=torch.int64)
                if payload.numel():
                    self.world.broadcast_cpu(payload)
                if self.runner is not None:
                    plan, extra = unpack_step(h, payload.numpy())
                    self.runner.execute_model(plan, extra)
            elif op == Op.LIQUID:
                self.scale(int(h[2]), int(h[3]), int(h[4]), int(h[5]), liquid_group_blocks(h))
            else:
                raise RuntimeError(f"unknown step opcode {op}")

    def scale(
        self, src: int, dst: int, num_blocks: int, num_swap: int, group_blocks: tuple[int, ...] = ()
    ) -> None:
        """This rank's part of one liquid event (send or receive shards, resize its pool, log); `group_blocks`:
        the blocks of each KV-cache group's own pool. Long because scale-out and scale-in are mirror images
        kept side by side."""
        from pagedrs.runner.model_runner import ModelRunner

        stats = LiquidStats(src, dst, num_blocks, num_blocks)
        r = self.rank
        if dst == 2 * src:  # scale out
            if r < src:
                model, pool = send_shards(
                    self.runner.model,
                    self.runner.kv_pool,
                    world=self.world,
                    partner=r + src,
                    scale_out=True,
                    new_tp=self.groups[dst],
                    stats=stats,
                )
                self._rebind(model, pool, self.groups[dst])
            elif r < dst:
                tp = self.groups[dst]
                new_model = self._build(tp)
                kv_groups = self._kv_groups(new_model, group_blocks)
                spec = PoolSpec(
                    num_blocks,
                    num_swap,
                    self.config.cache.block_size,
                    self.kv_dtype,
                    tuple(g.layers for g in kv_groups),
                    group_blocks,
                )
                model, pool = receive_shards(
                    None,
                    None,
                    world=self.world,
                    partner=r - src,
                    scale_out=True,
                    new_model=new_model,
                    pool_spec=spec,
                    stats=stats,
                )
                self.runner = ModelRunner(self.config, model, tp=tp)
                self.runner.kv_pool = pool
                self.runner.kv_groups = kv_groups
        elif src == 2 * dst:  # scale in
            if r < dst:
                tp = self.groups[dst]
                model, pool = receive_shards(
                    self.runner.model,
                    self.runner.kv_pool,
                    world=self.world,
                    partner=r + dst,
                    scale_out=False,
                    new_model=self._build(tp),
                    pool_spec=PoolSpec(num_blocks, num_swap, self.config.cache.block_size, self.kv_dtype),
                    stats=stats,
                )
                self._rebind(model, pool, tp)
            elif r < src:
                send_shards(
                    self.runner.model,
                    self.runner.kv_pool,
                    world=self.world,
                    partner=r - dst,
                    scale_out=False,
                    new_tp=None,
                    stats=stats,
                )
                self.runner = None  # idle: weights and KV cache freed
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
        else:
            raise RuntimeError(f"liquid: a move from {src} to {dst} ranks is not one doubling or halving")
        num_shards = int(self.config.parallel.liquid_total_num_shards or self.world.size)
        mine = [m for m in shard_moves(src, dst, num_shards) if m.src == r]
        if mine:  # this rank sent shards: the liquid fork's sender lines
            log_sends(stats, mine[0])
        logger.info("rank %d: liquid %d -> %d done (%s)", r, src, dst, "active" if self.runner else "idle")
        if self.runner is not None:
            held = sum(p.numel() * p.element_size() for p in self.runner.model.parameters())
            held += sum(t.numel() * t.element_size() for t in self.runner.kv_pool.kv_caches)
            devices = list(self.config.parallel.liquid_gpu_range or range(self.world.size))
            logger.info("After liquid kvc, %s", memory_info(self.device, devices[r], held))

    def _kv_groups(self, model: CausalLM, group_blocks: tuple[int, ...]) -> tuple[WindowGroup, ...]:
        """The sliding-window groups rank 0's runner keeps in pools of their own (`runner.kv_groups`), with
        `group_blocks` blocks each: none when it keeps none."""
        if not group_blocks:
            return ()
        groups = window_groups_for(layer_windows(model), self.config.scheduler.max_model_len)
        if len(groups) != len(group_blocks):
            raise RuntimeError(
                f"liquid: {len(group_blocks)} KV-cache group pools for {len(groups)} window groups"
            )
        return tuple(dataclasses.replace(g, num_blocks=n) for g, n in zip(groups, group_blocks, strict=True))

    def _rebind(self, model: torch.nn.Module | None, pool: Any, tp: TPGroup) -> None:
        self.runner.model = model
        self.runner.kv_pool = pool
        self.runner.tp = tp
        self.runner.cuda_graphs = None

    def close(self) -> None:
        abort_groups(self.world, self.groups)
