"""KV pool block operations: copies, moves, swap out/in round trip, grow and shrink, sizing."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pagedrs.runner.kv_cache import KVCachePool, block_bytes, cpu_zeros


def make_pool(num_blocks: int = 8, num_swap_blocks: int = 4) -> KVCachePool:
    pool = KVCachePool(
        num_layers=2,
        num_kv_heads=2,
        head_size=4,
        block_size=4,
        num_blocks=num_blocks,
        dtype=torch.float32,
        device=torch.device("cpu"),
        num_swap_blocks=num_swap_blocks,
    )
    for layer, kv in enumerate(pool.kv_caches):
        for b in range(num_blocks):
            kv[:, b] = 100 * layer + b
    return pool


def block_values(pool: KVCachePool, layer: int = 0) -> list[float]:
    return pool.kv_caches[layer][0, :, 0, 0, 0].tolist()


def pairs(*p: tuple[int, int]) -> np.ndarray:
    return np.array(p, dtype=np.int64).reshape(-1, 2)


def test_layout_and_zero_init() -> None:
    pool = KVCachePool(
        num_layers=3,
        num_kv_heads=2,
        head_size=8,
        block_size=16,
        num_blocks=5,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    assert len(pool.kv_caches) == 3
    assert pool.kv_caches[0].shape == (2, 5, 16, 2, 8)
    assert not pool.kv_caches[0].any()
    assert pool.swap_caches == [] and pool.num_blocks == 5
    assert pool.bytes_per_block == block_bytes(3, 16, 2, 8, torch.float32) == 2 * 3 * 16 * 2 * 8 * 4


def test_copy_blocks_every_layer() -> None:
    pool = make_pool()
    pool.copy_blocks(pairs((1, 5), (2, 6)))
    assert block_values(pool, 0) == [0, 1, 2, 3, 4, 1, 2, 7]
    assert block_values(pool, 1) == [100, 101, 102, 103, 104, 101, 102, 107]


def test_moves_read_all_sources_first() -> None:
    pool = make_pool()
    pool.move_blocks(pairs((7, 1), (1, 2)))  # chain: block 2 must get the old block 1
    assert block_values(pool)[:3] == [0, 7, 1]


def test_swap_round_trip() -> None:
    pool = make_pool()
    pool.swap_out(pairs((3, 0), (5, 2)))
    assert pool.swap_caches[1][0, [0, 2], 0, 0, 0].tolist() == [103, 105]
    pool.kv_caches[0][:, 3] = -1
    pool.swap_in(pairs((2, 3), (0, 6)))
    assert block_values(pool)[3] == 5 and block_values(pool)[6] == 3


def test_swap_without_pool_is_an_error() -> None:
    pool = make_pool(num_swap_blocks=0)
    with pytest.raises(RuntimeError, match="swap_space"):
        pool.swap_out(pairs((0, 0)))


def test_grow_and_shrink_keep_contents() -> None:
    pool = make_pool()
    pool.resize(12)
    assert (
        pool.num_blocks == 12
        and block_values(pool)[:8] == list(range(8))
        and block_values(pool)[8:] == [0] * 4
    )
    pool.resize(3)
    assert pool.num_blocks == 3 and block_values(pool) == [0, 1, 2]


def test_plan_ops_order() -> None:
    pool = make_pool()
    empty = np.zeros((0, 2), dtype=np.int64)
    plan = SimpleNamespace(
        num_blocks=10,
        block_moves=pairs((7, 0)),
        swap_out=pairs((0, 1)),
        swap_in=empty,
        copies=pairs((0, 9)),
        tier_store=empty,
        tier_load=empty,
    )
    pool.apply_plan_ops(plan)  # grow, then move 7->0, then swap out 0 (now 7), then copy 0->9
    assert pool.num_blocks == 10
    assert block_values(pool)[0] == 7 and block_values(pool)[9] == 7
    assert pool.swap_caches[0][0, 1, 0, 0, 0].item() == 7
    plan.num_blocks = 4
    pool.apply_plan_shrink(plan)
    assert pool.num_blocks == 4


def test_group_swap_ops_move_only_their_own_layers() -> None:
    """Layers 1 and 2 in two KV-cache groups of their own (6 and 5 blocks): the full-attention pool's swap
    pairs move layer 0 only, each group's (group, block, block) triples its own layer, through its own host
    blocks, and back into other device blocks."""
    pool = KVCachePool(
        num_layers=3,
        num_kv_heads=1,
        head_size=2,
        block_size=2,
        num_blocks=8,
        dtype=torch.float32,
        device=torch.device("cpu"),
        num_swap_blocks=4,
        layer_blocks={1: 6, 2: 5},
        groups=[(1,), (2,)],
    )
    for layer, kv in enumerate(pool.kv_caches):
        for b in range(kv.shape[1]):
            kv[:, b] = 100 * layer + b
    triples = lambda *t: np.array(t, dtype=np.int64).reshape(-1, 3)  # noqa: E731
    plan = SimpleNamespace(
        num_blocks=8,
        block_moves=pairs(),
        swap_out=pairs((7, 0)),
        swap_in=pairs(),
        copies=pairs(),
        group_swap_out=triples((0, 5, 1), (1, 4, 1), (1, 3, 2)),
        group_swap_in=triples(),
        group_block_moves=triples(),
        group_num_blocks=np.array([6, 5]),
        tier_store=pairs(),
        tier_load=pairs(),
    )
    pool.apply_plan_ops(plan)  # type: ignore[arg-type]
    host = [pool.swap_caches[i][0, :, 0, 0, 0].tolist() for i in range(3)]
    assert host == [[7, 0, 0, 0], [0, 105, 0, 0], [0, 204, 203, 0]]
    back = SimpleNamespace(**vars(plan))
    back.swap_out, back.group_swap_out, back.swap_in = pairs(), triples(), pairs((0, 2))
    back.group_swap_in = triples((0, 1, 0), (1, 1, 0), (1, 2, 1))
    pool.apply_plan_ops(back)  # type: ignore[arg-type]
    assert block_values(pool, 0) == [0, 1, 7, 3, 4, 5, 6, 7]
    assert block_values(pool, 1) == [105, 101, 102, 103, 104, 105]
    assert block_values(pool, 2) == [204, 203, 202, 203, 204]


def test_group_pools_resize_and_move_on_their_own_layers() -> None:
    """A plan's group sizes grow each group's layers before the block ops and shrink them after the forward;
    its (group, src, dst) moves copy on that group's layers only, the primary pool's moves on the others."""
    pool = KVCachePool(
        num_layers=3,
        num_kv_heads=1,
        head_size=2,
        block_size=2,
        num_blocks=8,
        dtype=torch.float32,
        device=torch.device("cpu"),
        layer_blocks={1: 6, 2: 5},
        groups=[(1,), (2,)],
    )
    for layer, kv in enumerate(pool.kv_caches):
        for b in range(kv.shape[1]):
            kv[:, b] = 100 * layer + b
    triples = lambda *t: np.array(t, dtype=np.int64).reshape(-1, 3)  # noqa: E731
    plan = SimpleNamespace(
        num_blocks=4,
        block_moves=pairs((6, 1)),
        swap_out=pairs(),
        swap_in=pairs(),
        copies=pairs(),
        group_swap_out=triples(),
        group_swap_in=triples(),
        group_block_moves=triples((0, 5, 0), (1, 4, 2), (1, 2, 1)),
        group_num_blocks=np.array([3, 7]),
        tier_store=pairs(),
        tier_load=pairs(),
    )
    pool.apply_plan_ops(plan)  # type: ignore[arg-type]
    assert [pool.group_num_blocks(0), pool.group_num_blocks(1)] == [6, 7]  # grown before, shrunk after
    assert block_values(pool, 0) == [0, 6, 2, 3, 4, 5, 6, 7]
    assert block_values(pool, 1) == [105, 101, 102, 103, 104, 105]
    assert block_values(pool, 2) == [200, 202, 204, 203, 204, 0, 0]  # sources read before any write
    pool.apply_plan_shrink(plan)  # type: ignore[arg-type]
    assert (pool.num_blocks, pool.group_num_blocks(0), pool.group_num_blocks(1)) == (4, 3, 7)
    assert block_values(pool, 0) == [0, 6, 2, 3] and block_values(pool, 1) == [105, 101, 102]


def test_host_tier_stores_before_moves_and_loads_after_swap_in() -> None:
    pool = make_pool()
    pool.tier = None
    with_tier = KVCachePool(
        num_layers=2,
        num_kv_heads=2,
        head_size=4,
        block_size=4,
        num_blocks=8,
        dtype=torch.float32,
        device=torch.device("cpu"),
        num_tier_blocks=3,
    )
    assert with_tier.num_tier_blocks == 3 and pool.num_tier_blocks == 0
    for layer, kv in enumerate(with_tier.kv_caches):
        for b in range(8):
            kv[:, b] = 100 * layer + b
    empty = np.zeros((0, 2), dtype=np.int64)
    plan = SimpleNamespace(
        num_blocks=8,
        tier_store=pairs((0, 2), (5, 1)),  # read before the move writes block 0
        block_moves=pairs((7, 0)),
        swap_out=empty,
        swap_in=empty,
        tier_load=pairs((2, 3), (1, 4)),  # block 0's old bytes into 3, block 5's into 4
        slot_mapping=np.zeros(0, dtype=np.int64),
        copies=empty,
    )
    with_tier.apply_plan_ops(plan)
    assert block_values(with_tier) == [7, 1, 2, 0, 5, 5, 6, 7]
    assert block_values(with_tier, 1)[3:5] == [100, 105]
    assert with_tier.tier is not None
    assert with_tier.tier.blocks_stored == 2 and with_tier.tier.blocks_loaded == 2
    with pytest.raises(RuntimeError, match="host KV tier"):
        pool.apply_plan_ops(plan)


def _rss_bytes() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * 4096


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads the resident size from /proc")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_pool_pages_are_mapped_at_first_touch(dtype: torch.dtype) -> None:
    """A CPU KV pool's memory is zeros that cost nothing until written: 768 MiB allocated leaves the resident
    size nearly unchanged, reads as zeros, and a written block holds what was written."""
    before = _rss_bytes()
    pool = cpu_zeros((2, 6144, 16, 4, 1024 // torch.empty((), dtype=dtype).element_size()), dtype)
    assert pool.numel() * pool.element_size() == 768 << 20 and pool.dtype == dtype
    assert _rss_bytes() - before < 64 << 20
    assert not pool[:, ::97].any()
    pool[1, 5] = 1.5
    assert (
        float(pool[1, 5].sum()) == 1.5 * pool[1, 5].numel() and not pool[1, 6].any() and not pool[0, 5].any()
    )
    assert _rss_bytes() - before < 128 << 20
