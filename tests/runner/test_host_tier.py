"""The host KV tier's stores run on a worker thread, off the step: a step goes on while they copy, a block a
store still reads is not written until the store is done (a block overwritten right after its eviction still
restores its old contents), and a load of a slot whose store is in flight waits for it."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pagedrs.runner.kv_cache import KVCachePool, written_blocks

BS = 4
HOLD = 0.3  # seconds the worker is held busy


def pairs(*p: tuple[int, int]) -> np.ndarray:
    return np.array(p, dtype=np.int64).reshape(-1, 2)


def plan(*, store=(), load=(), moves=(), copies=(), write_block: int | None = None) -> SimpleNamespace:
    """A plan with these tier pairs whose forward writes one token into `write_block`."""
    slots = [write_block * BS + 1] if write_block is not None else []
    return SimpleNamespace(
        num_blocks=8,
        tier_store=pairs(*store),
        tier_load=pairs(*load),
        block_moves=pairs(*moves),
        swap_out=pairs(),
        swap_in=pairs(),
        copies=pairs(*copies),
        slot_mapping=np.array(slots + [-1], dtype=np.int64),
    )


def values(pool: KVCachePool, block: int) -> list[float]:
    return [float(kv[0, block, 0, 0, 0]) for kv in pool.kv_caches]


def hold_worker(pool: KVCachePool) -> threading.Event:
    """Queue a job that keeps the tier's worker busy until HOLD seconds from now."""
    assert pool.tier is not None
    gate = threading.Event()
    pool.tier.after(gate.wait)
    threading.Timer(HOLD, gate.set).start()
    return gate


def test_stores_run_off_the_step_and_never_race_a_write() -> None:
    pool = KVCachePool(
        num_layers=2, num_kv_heads=1, head_size=2, block_size=BS, num_blocks=8,
        dtype=torch.float32, device=torch.device("cpu"), num_tier_blocks=3,
    )  # fmt: skip
    tier = pool.tier
    assert tier is not None and tier.background
    for layer, kv in enumerate(pool.kv_caches):
        for b in range(8):
            kv[:, b] = 100 * layer + b
    assert written_blocks(plan(moves=[(1, 2)], copies=[(3, 4)], write_block=6), BS).tolist() == [6, 2, 4]

    # The step goes on while the store is held: it writes no block the store reads.
    gate = hold_worker(pool)
    pool.apply_plan_ops(plan(store=[(0, 1)], write_block=3))
    assert not gate.is_set() and tier.in_flight == 2
    assert float(tier.caches[0][0, 1, 0, 0, 0]) == 0.0  # not copied yet
    # The next step writes block 0 (evicted, reused for new KV): it waits for the store first.
    start = time.perf_counter()
    pool.apply_plan_ops(plan(write_block=0))
    assert time.perf_counter() - start >= HOLD * 0.8 and tier.in_flight == 0
    for kv in pool.kv_caches:
        kv[:, 0] = -1.0  # the forward's new KV
    pool.apply_plan_ops(plan(load=[(1, 5)]))
    assert values(pool, 5) == [0.0, 100.0]  # block 0's old contents, not -1

    # A load of a slot whose store is still in flight waits for it, and moves wait for their destination.
    hold_worker(pool)
    start = time.perf_counter()
    pool.apply_plan_ops(plan(store=[(2, 0)], load=[(0, 6)]))
    assert time.perf_counter() - start >= HOLD * 0.8
    assert values(pool, 6) == [2.0, 102.0]
    hold_worker(pool)
    start = time.perf_counter()
    pool.apply_plan_ops(plan(store=[(3, 2)], moves=[(7, 3)]))
    assert time.perf_counter() - start >= HOLD * 0.8
    pool.apply_plan_ops(plan(load=[(2, 4)]))
    assert values(pool, 4) == [3.0, 103.0] and values(pool, 3) == [7.0, 107.0]
    assert tier.blocks_stored == 3 and tier.blocks_loaded == 3

    # A failure on the worker is raised by the step that comes next; close() stops the worker.
    tier.after(lambda: 1 / 0)  # type: ignore[func-returns-value]
    with pytest.raises(RuntimeError, match="store worker failed"):
        tier.flush()
    tier.close()
    assert tier.in_flight == 0
