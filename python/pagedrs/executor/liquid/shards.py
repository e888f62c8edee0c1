"""Liquid: the model cut into `liquid_total_num_shards` shards moves between ranks while it serves.

Shards are contiguous slices of every split tensor (attention heads, KV heads, MLP columns, vocabulary
rows), so a rank that holds shards [a, b) of S is a tensor-parallel rank of degree S / (b - a) at
position a / (b - a). The active degree d is a power of two; ranks 0..d-1 are active.

- Scale out d -> 2d: active rank r keeps the first half of its shards and sends the second half (weights
  and the KV heads of every block) to rank r + d, which builds the same model at the new degree from
  them (plus a copy of the replicated tensors: norms, row-parallel biases). Positions: rank r at
  position p goes to 2p, its partner to 2p + 1, so `position(r, d)` is r's bit reversal in log2(d) bits.
- Scale in 2d -> d: rank r + d sends its halves back to rank r, which concatenates them, and goes idle.

Only what changes owner moves (`send`/`recv` over the world group, gloo on CPU, NCCL on GPUs); each
rank then rebinds: a fresh model object at its new (position, degree) over the moved tensors, and the
all-reduce group of the new active set (one pre-built group per degree).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
from torch import Tensor
from torch import distributed as dist

from pagedrs.config import as_bytes
from pagedrs.distributed.group import TPGroup
from pagedrs.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from pagedrs.models.interface import CausalLM
from pagedrs.runner.kv_cache import KVCachePool

__all__ = [
    "LiquidRequest",
    "LiquidStats",
    "LiquidType",
    "check_liquid",
    "liquid_position",
    "receive_shards",
    "send_shards",
]

logger = logging.getLogger("pagedrs.liquid")


class LiquidType(Enum):
    """The liquid fork's four moves (from degree, to degree)."""

    LIQUID_1_2 = (1, 2)
    LIQUID_2_4 = (2, 4)
    LIQUID_4_2 = (4, 2)
    LIQUID_2_1 = (2, 1)


@dataclass(frozen=True)
class LiquidRequest:
    """Scale to `target` active ranks (a power of two within the range), or one of the liquid fork's moves."""

    liquid_type: LiquidType | None = None
    target: int | None = None

    def resolve(self, current: int) -> int:
        if (self.liquid_type is None) == (self.target is None):
            raise ValueError("LiquidRequest needs exactly one of liquid_type or target")
        if self.liquid_type is not None:
            src, dst = self.liquid_type.value
            if src != current:
                raise ValueError(
                    f"{self.liquid_type.name} moves from {src} active ranks, but {current} are active"
                )
            return dst
        if self.target is None:
            raise ValueError("LiquidRequest needs a liquid_type or a target")
        return int(self.target)


@dataclass
class LiquidStats:
    """One scale event, as the log line reports it."""

    src_degree: int
    dst_degree: int
    num_blocks_before: int
    num_blocks_after: int
    weight_bytes: int = 0
    kv_bytes: int = 0
    weight_seconds: float = 0.0
    kv_seconds: float = 0.0
    total_seconds: float = 0.0


def liquid_position(rank: int, degree: int) -> int:
    """The shard position of `rank` when `degree` ranks are active (bit reversal in log2(degree) bits)."""
    bits = int(math.log2(degree))
    return int(format(rank, f"0{bits}b")[::-1], 2) if bits else 0


def degree_positions(degree: int) -> list[int]:
    return [liquid_position(r, degree) for r in range(degree)]


def check_liquid(config: Any, num_shards: int, world: int) -> None:
    """Can this model be cut into `num_shards` shards over `world` ranks? ValueError with the numbers."""
    if num_shards < 1 or num_shards & (num_shards - 1):
        raise ValueError(f"liquid_total_num_shards must be a power of two, got {num_shards}")
    if world < 1 or world & (world - 1) or world > num_shards:
        raise ValueError(
            f"liquid_gpu_range must name a power of two ranks, at most liquid_total_num_shards ({num_shards}); "
            f"got {world}"
        )
    heads = int(config.num_attention_heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    sizes = {
        "attention heads": heads,
        "KV heads": kv,
        "vocabulary size": int(config.vocab_size),
    }
    inter = getattr(config, "intermediate_size", None) or getattr(config, "ffn_dim", None)
    if inter:
        sizes["intermediate size"] = int(inter)
    for what, n in sizes.items():
        if n % num_shards:
            raise ValueError(
                f"liquid_total_num_shards={num_shards} does not divide the model's {n} {what}; "
                f"use a number of shards that divides it"
            )


def _split_spec(module: torch.nn.Module, leaf: str) -> tuple[int, list[int]] | None:
    """(dim, local piece sizes) of a split parameter at the module's current degree; None if replicated."""
    if isinstance(module, QKVParallelLinear):
        return 0, [module.q_size, module.kv_size, module.kv_size]
    if isinstance(module, MergedColumnParallelLinear):
        return 0, [s // module.tp_size for s in module.output_sizes]
    if isinstance(module, ColumnParallelLinear):
        return 0, [module.output_size_per_partition]
    if isinstance(module, RowParallelLinear):
        return (1, [module.input_size_per_partition]) if leaf == "weight" else None
    if isinstance(module, ReplicatedEmbedding):
        return None
    if isinstance(module, VocabParallelEmbedding):
        return 0, [module.num_embeddings_per_partition]
    return None


def _params(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module, str, Tensor]]:
    """(name, owning module, leaf name, tensor) of every distinct parameter, in a fixed order."""
    modules = dict(model.named_modules())
    for name, p in model.named_parameters():  # tied parameters once
        mod_name, _, leaf = name.rpartition(".")
        yield name, modules[mod_name], leaf, p.data


def weight_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(all parameter bytes, replicated parameter bytes) of `model`: at degree d a rank holds the
    replicated bytes plus 1/d of the split ones."""
    total = replicated = 0
    for _, module, leaf, t in _params(model):
        n = t.numel() * t.element_size()
        total += n
        if _split_spec(module, leaf) is None:
            replicated += n
    return total, replicated


def _halves(t: Tensor, dim: int, pieces: list[int]) -> tuple[Tensor, Tensor]:
    """Each piece cut in two along `dim`: (first halves, second halves), each concatenated."""
    first, second, off = [], [], 0
    for n in pieces:
        piece = t.narrow(dim, off, n)
        first.append(piece.narrow(dim, 0, n // 2))
        second.append(piece.narrow(dim, n // 2, n // 2))
        off += n
    return torch.cat(first, dim).contiguous(), torch.cat(second, dim).contiguous()


def _join(mine: Tensor, theirs: Tensor, dim: int, pieces: list[int]) -> Tensor:
    """Inverse of `_halves`: piece j = mine_j then theirs_j (`pieces` are the joined sizes)."""
    out, off = [], 0
    for n in pieces:
        out.append(mine.narrow(dim, off, n // 2))
        out.append(theirs.narrow(dim, off, n // 2))
        off += n // 2
    return torch.cat(out, dim).contiguous()


def _assign(model: torch.nn.Module, tensors: dict[str, Tensor]) -> None:
    """Rebind `model`'s parameters to `tensors` (by name; tied names share one Parameter)."""
    shared: dict[int, torch.nn.Parameter] = {}
    modules = dict(model.named_modules())
    for name, p in list(model.named_parameters(remove_duplicate=False)):
        key = id(p)
        if key not in shared:
            src = tensors.get(name)
            if src is None:
                raise RuntimeError(f"liquid: no tensor for parameter {name}")
            if tuple(src.shape) != tuple(p.shape):
                raise RuntimeError(f"liquid: {name} has shape {tuple(src.shape)}, expected {tuple(p.shape)}")
            new = torch.nn.Parameter(src, requires_grad=False)
            new.weight_loader = getattr(p, "weight_loader", None)  # type: ignore[attr-defined]  # our attribute on a torch Parameter
            shared[key] = new
        mod_name, _, leaf = name.rpartition(".")
        setattr(modules[mod_name], leaf, shared[key])


class _Transfer:
    """Point-to-point moves with a byte and time count. Device tensors go over `device_pg`, host
    tensors (the swap pool) over `cpu_pg`."""

    def __init__(self, world: TPGroup) -> None:
        self.world = world
        self.bytes = 0

    def _pg(self, t: Tensor) -> Any:  # a torch ProcessGroup (gloo or NCCL)
        return self.world.cpu_pg if t.device.type == "cpu" else self.world.device_pg

    def send(self, t: Tensor, dst: int) -> None:
        self._pg(t).send([as_bytes(t.contiguous())], dst, 0).wait()
        self.bytes += t.numel() * t.element_size()

    def recv(self, t: Tensor, src: int) -> Tensor:
        self._pg(t).recv([as_bytes(t)], src, 0).wait()
        self.bytes += t.numel() * t.element_size()
        return t


def _device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def rebuild_model(
    model_cls: type[CausalLM], config: object, dtype: torch.dtype, device: torch.device, tp: TPGroup
) -> CausalLM:
    """An empty model of `model_cls` at (tp.position, tp.size); its tensors are replaced by `_assign`."""
    with torch.device(device):
        return model_cls(config, dtype=dtype, device=device, tp=tp).eval()


@dataclass(frozen=True)
class PoolSpec:
    """The pool a rank that was idle builds on a scale-out, as rank 0's: the full-attention pool's blocks, the
    swap blocks, block size and KV element type, and the layers and blocks of each KV-cache group's own pool
    (`runner.kv_groups`, the sliding-window layers)."""

    num_blocks: int
    num_swap_blocks: int
    block_size: int
    dtype: torch.dtype
    groups: tuple[tuple[int, ...], ...] = ()
    group_blocks: tuple[int, ...] = ()


def _rebind_pool(pool: KVCachePool, kv: list[Tensor], swap: list[Tensor]) -> KVCachePool:
    pool.kv_caches = kv
    pool.swap_caches = swap
    pool.num_kv_heads = int(kv[0].shape[3])
    pool.bytes_per_block = pool.bytes_per_block_for(pool.num_kv_heads)
    return pool


def _move_kv(pool: KVCachePool, xfer: _Transfer, partner: int, scale_out: bool, sending: bool) -> KVCachePool:
    """Move the KV heads that change owner, for every block of the device pool and the swap pool."""
    kv: list[Tensor] = []
    swap: list[Tensor] = []
    for src, dst in ((pool.kv_caches, kv), (pool.swap_caches, swap)):
        for t in src:
            h = t.shape[3]
            if scale_out and sending:
                xfer.send(t.narrow(3, h // 2, h // 2), partner)
                dst.append(t.narrow(3, 0, h // 2).contiguous())
            elif scale_out:  # a fresh pool of the right shape
                dst.append(xfer.recv(t, partner))
            elif sending:
                xfer.send(t, partner)
            else:
                theirs = xfer.recv(torch.empty_like(t), partner)
                dst.append(torch.cat([t, theirs], dim=3).contiguous())
    return _rebind_pool(pool, kv, swap) if kv else pool


def send_shards(
    model: CausalLM,
    pool: KVCachePool,
    *,
    world: TPGroup,
    partner: int,
    scale_out: bool,
    new_tp: TPGroup | None,
    stats: LiquidStats,
) -> tuple[CausalLM | None, KVCachePool | None]:
    """This rank's side of a move with `partner`.

    Scale out: keep the first half of every split tensor, send the second half and every replicated
    tensor; return the model rebuilt at `new_tp` and the pool with half the KV heads.
    Scale in: send the halves this rank holds (it keeps nothing): returns (None, None)."""
    xfer = _Transfer(world)
    t0 = time.perf_counter()
    kept: dict[str, Tensor] = {}
    for name, module, leaf, t in _params(model):
        spec = _split_spec(module, leaf)
        if spec is None:
            if scale_out:
                xfer.send(t, partner)
                kept[name] = t
            continue
        dim, pieces = spec
        if scale_out:
            first, second = _halves(t, dim, pieces)
            xfer.send(second, partner)
            kept[name] = first
        else:
            xfer.send(t, partner)
    weight_bytes = xfer.bytes
    t1 = time.perf_counter()
    new_pool = _move_kv(pool, xfer, partner, scale_out, sending=True)
    _account(stats, weight_bytes, xfer.bytes - weight_bytes, t1 - t0, time.perf_counter() - t1)
    if not scale_out:
        return None, None
    assert new_tp is not None
    new = rebuild_model(type(model), model.config, model.dtype, _device_of(model), new_tp)
    _assign(new, kept)
    return new, new_pool


def receive_shards(
    model: CausalLM | None,
    pool: KVCachePool | None,
    *,
    world: TPGroup,
    partner: int,
    scale_out: bool,
    new_model: CausalLM,
    pool_spec: PoolSpec,
    stats: LiquidStats,
) -> tuple[CausalLM, KVCachePool]:
    """The other side. `new_model`: an empty model at the new degree (`rebuild_model`).

    Scale out (this rank was idle): receive every tensor, and the KV heads into a new pool of `pool_spec`
    (each group's layers with their own pool's blocks). Scale in: receive the partner's halves and join
    them onto this rank's own."""
    xfer = _Transfer(world)
    t0 = time.perf_counter()
    tensors: dict[str, Tensor] = {}
    if scale_out:
        for name, _, _, t in _params(new_model):
            tensors[name] = xfer.recv(torch.empty_like(t), partner)
    else:
        assert model is not None and pool is not None
        new_modules = dict(new_model.named_modules())
        for name, module, leaf, t in _params(model):
            spec = _split_spec(module, leaf)
            if spec is None:
                tensors[name] = t
                continue
            theirs = xfer.recv(torch.empty_like(t), partner)
            joined = _split_spec(new_modules[name.rpartition(".")[0]], leaf)
            assert joined is not None
            tensors[name] = _join(t, theirs, spec[0], joined[1])
    weight_bytes = xfer.bytes
    t1 = time.perf_counter()
    if scale_out:
        layer_blocks = {
            i: n for g, n in zip(pool_spec.groups, pool_spec.group_blocks, strict=True) for i in g
        }
        pool = KVCachePool(
            num_layers=int(new_model.num_layers),
            num_kv_heads=int(new_model.num_kv_heads),
            head_size=int(new_model.head_size),
            block_size=pool_spec.block_size,
            num_blocks=pool_spec.num_blocks,
            dtype=pool_spec.dtype,  # the model's dtype, or fp8 (kv_cache_dtype)
            device=_device_of(new_model),
            num_swap_blocks=pool_spec.num_swap_blocks,
            layer_blocks=layer_blocks,
            groups=pool_spec.groups,
        )
    assert pool is not None
    new_pool = _move_kv(pool, xfer, partner, scale_out, sending=False)
    _account(stats, weight_bytes, xfer.bytes - weight_bytes, t1 - t0, time.perf_counter() - t1)
    _assign(new_model, tensors)
    return new_model, new_pool


def _account(stats: LiquidStats, wb: int, kb: int, ws: float, ks: float) -> None:
    stats.weight_bytes += wb
    stats.kv_bytes += kb
    stats.weight_seconds += ws
    stats.kv_seconds += ks


def connect_liquid_groups(
    store: dist.Store, rank: int, world_size: int, device: torch.device, *, host: str, timeout_s: float
) -> tuple[TPGroup, dict[int, TPGroup]]:
    """The world group (step broadcasts, shard moves) and one tensor-parallel group per active degree
    this rank can be part of (every power of two d with rank < d), each with its shard positions.
    Every rank builds them in the same order (increasing d), so no rendezvous waits on another."""
    from pagedrs.distributed.group import _gloo_group, _nccl_group, connect_tp_group

    world = connect_tp_group(store, rank, world_size, device, host=host, timeout_s=timeout_s)
    groups: dict[int, TPGroup] = {}
    d = 1
    while d <= world_size:
        if rank < d:
            if d == 1:
                groups[d] = TPGroup(0, 1)
            elif d == world_size:
                groups[d] = TPGroup(
                    rank, d, device_pg=world.device_pg, cpu_pg=world.cpu_pg, positions=degree_positions(d)
                )
            else:
                prefix = dist.PrefixStore(f"degree{d}", store)
                cpu = _gloo_group(dist.PrefixStore("cpu", prefix), rank, d, host, timeout_s)
                dev = (
                    _nccl_group(dist.PrefixStore("nccl", prefix), rank, d, timeout_s)
                    if device.type == "cuda"
                    else cpu
                )
                groups[d] = TPGroup(rank, d, device_pg=dev, cpu_pg=cpu, positions=degree_positions(d))
        d *= 2
    return world, groups


def abort_groups(world: TPGroup, groups: dict[int, TPGroup]) -> None:
    for g in groups.values():
        if g.device_pg is not world.device_pg:
            g.abort()
    world.abort()
