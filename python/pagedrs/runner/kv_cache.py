"""The paged KV pool on the model's device, the swap pool and the host KV tier in CPU memory.

Per layer one tensor ``[2, num_blocks, block_size, num_kv_heads, head_size]`` (index 0 = K, 1 = V); the swap
pool and the host tier (``kv_offloading_size``) have the same shape with their own block counts (pinned on
CUDA). A model whose layers differ in KV heads or head size (`CausalLM.kv_cache_shapes`: Gemma 4's global
layers) gets each layer's own shape; a layer that reads another layer's KV (shared KV) has a tensor with no
KV head, which holds no byte. The scheduler owns which block is whose; this module only moves bytes as a
step plan asks: tier stores, block moves (pool compaction), swap out, swap in, tier loads, copy-on-write
copies, grow and shrink.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from pagedrs.config import as_bytes
from pagedrs.models.interface import CausalLM
from pagedrs.runner.host_tier import HostTierCaches

if TYPE_CHECKING:
    from pagedrs._core import StepPlan

__all__ = [
    "HostTierCaches",
    "KVCachePool",
    "block_bytes",
    "layer_block_bytes",
    "model_block_bytes",
    "kv_budget_bytes",
    "num_blocks_for_bytes",
    "profile_num_gpu_blocks",
]

logger = logging.getLogger(__name__)

_GiB = 1 << 30


def block_bytes(
    num_layers: int, block_size: int, num_kv_heads: int, head_size: int, dtype: torch.dtype
) -> int:
    """Bytes one block takes over all layers, K and V."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_size * elem


def model_block_bytes(model: Any, block_size: int, dtype: torch.dtype) -> int:
    """`block_bytes` of `model`'s layers on this rank."""
    return sum(layer_block_bytes(model, block_size, dtype))


def _layer_shapes(model: Any) -> list[tuple[int, int]]:
    """(KV heads, head size) of each of `model`'s layers on this rank: its `kv_cache_shapes` when the layers
    differ, else the same for every layer."""
    shapes = getattr(model, "kv_cache_shapes", None)
    if shapes is not None:
        return [(int(h), int(d)) for h, d in shapes]
    return [(int(model.num_kv_heads), int(model.head_size))] * int(model.num_layers)


def layer_block_bytes(model: Any, block_size: int, dtype: torch.dtype) -> list[int]:
    """Per layer of `model` (on this rank), the bytes one block takes, K and V (0: a layer owning no KV)."""
    return [block_bytes(1, block_size, h, d, dtype) for h, d in _layer_shapes(model)]


def num_blocks_for_bytes(num_bytes: float, per_block: int) -> int:
    return int(num_bytes // per_block)


def kv_budget_bytes(
    *, total: int, gpu_memory_utilization: float, peak: int, used_by_others: int, reserved: int = 0
) -> float:
    """Bytes the KV pool may take: the utilization's share of the device, less the profiled peak (weights
    and activations), memory held outside our allocator (the CUDA context, other processes), and what is
    reserved for later (the CUDA graphs' pool)."""
    return total * gpu_memory_utilization - peak - max(used_by_others, 0) - max(reserved, 0)


def profile_num_gpu_blocks(
    model: CausalLM,
    run_profile: Callable[[], object],
    *,
    device: torch.device,
    gpu_memory_utilization: float,
    per_block: int,
    reserved_bytes: int = 0,
) -> int:
    """Blocks that fit in `gpu_memory_utilization` of the device after a forward at the largest batch.

    `run_profile` is a callable that runs that forward (no KV cache); its peak activation memory plus the
    weights already resident is what the pool must leave free, and `reserved_bytes` more (the memory the
    CUDA graphs will take once captured)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    run_profile()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    free, total = torch.cuda.mem_get_info(device)
    # Memory other processes (and the CUDA context) hold is not ours to take.
    used_by_others = total - free - torch.cuda.memory_reserved(device)
    budget = kv_budget_bytes(
        total=total,
        gpu_memory_utilization=gpu_memory_utilization,
        peak=peak,
        used_by_others=used_by_others,
        reserved=reserved_bytes,
    )
    torch.cuda.empty_cache()
    num = num_blocks_for_bytes(budget, per_block)
    if num < 1:
        raise ValueError(
            f"gpu_memory_utilization={gpu_memory_utilization} leaves no room for the KV cache "
            f"(total {total / _GiB:.1f} GiB, peak {peak / _GiB:.1f} GiB, CUDA graphs "
            f"{reserved_bytes / _GiB:.2f} GiB); raise it, lower max_num_batched_tokens or set enforce_eager"
        )
    logger.info(
        "KV cache: %d blocks after profiling (peak %.2f GiB, CUDA graphs %.2f GiB, of %.2f GiB)",
        num,
        peak / _GiB,
        reserved_bytes / _GiB,
        total / _GiB,
    )
    return num


def _pairs(pairs: np.ndarray, device: torch.device) -> tuple[Tensor, Tensor]:
    t = torch.from_numpy(np.ascontiguousarray(pairs, dtype=np.int64))
    return t[:, 0].to(device), t[:, 1].to(device)


def cpu_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """A CPU tensor of zeros whose pages the OS maps at first touch (numpy allocates zeros with calloc,
    which takes fresh zero pages for a large block instead of writing them): a multi-GiB KV pool is ready
    at once and costs memory only for the blocks that get used, where `torch.zeros` writes every byte
    at start-up."""
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:  # a group that owns no blocks (layers that read another layer's KV)
        return torch.zeros(shape, dtype=dtype)
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


def written_blocks(plan: StepPlan, block_size: int) -> np.ndarray:
    """The full-attention pool's blocks a plan writes: its forward's slots, and the destinations of its block
    moves, swap-ins, tier loads and copy-on-write copies."""
    slots = np.asarray(plan.slot_mapping)
    parts = [slots[slots >= 0] // block_size]
    for pairs in (plan.block_moves, plan.swap_in, plan.tier_load, plan.copies):
        if len(pairs):
            parts.append(np.asarray(pairs)[:, 1])
    return np.concatenate(parts)


class KVCachePool:
    """Device KV blocks (one tensor per layer) and optional CPU swap blocks."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_size: int,
        block_size: int,
        num_blocks: int,
        dtype: torch.dtype,
        device: torch.device,
        num_swap_blocks: int = 0,
        layer_blocks: dict[int, int] | None = None,
        layer_shapes: list[tuple[int, int]] | None = None,
        groups: Sequence[Sequence[int]] = (),
        num_tier_blocks: int = 0,
    ) -> None:
        """`layer_blocks`: layers whose KV-cache group has a pool of its own (`kv_groups`), and its size;
        `groups`: the layers of each such group, in the plan's group order (their swap ops name the group).
        Every layer has `num_swap_blocks` host blocks: the full-attention pool's swap ids index those of its
        layers, each group's own swap ids those of the group's layers. `layer_shapes`: (KV heads, head
        size) per layer where the layers differ (else `num_kv_heads`, `head_size` for all).
        `num_tier_blocks`: the host KV tier's blocks per layer."""
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        if layer_shapes is not None and len(layer_shapes) != num_layers:
            raise ValueError(f"{len(layer_shapes)} layer shapes for {num_layers} layers")
        self._layer_shapes = layer_shapes
        self.bytes_per_block = sum(block_bytes(1, block_size, h, d, dtype) for h, d in self.layer_shapes)
        # The full-attention pool's size: with every layer in a group of its own, no tensor has it.
        self._num_blocks = num_blocks
        self.group_layers = frozenset(layer_blocks or {})
        self.groups = tuple(tuple(g) for g in groups)
        # Zero-filled: padded reads of a block table must never see NaN garbage (NaN * 0 is NaN).
        self.kv_caches: list[Tensor] = [
            self._alloc((layer_blocks or {}).get(i, num_blocks), device, i) for i in range(num_layers)
        ]
        pin = device.type == "cuda"
        self.swap_caches: list[Tensor] = (
            [self._alloc(num_swap_blocks, torch.device("cpu"), i, pin=pin) for i in range(num_layers)]
            if num_swap_blocks
            else []
        )
        self.num_swap_blocks = num_swap_blocks
        self.tier = (
            HostTierCaches(
                [self._alloc(num_tier_blocks, torch.device("cpu"), i, pin=pin) for i in range(num_layers)]
            )
            if num_tier_blocks
            else None
        )

    @classmethod
    def for_model(
        cls,
        model: Any,
        *,
        block_size: int,
        num_blocks: int,
        dtype: torch.dtype,
        device: torch.device,
        num_swap_blocks: int = 0,
        layer_blocks: dict[int, int] | None = None,
        groups: Sequence[Sequence[int]] = (),
        num_tier_blocks: int = 0,
    ) -> KVCachePool:
        """The pool of `model`'s layers (its `num_layers`, `num_kv_heads`, `head_size` on this rank)."""
        return cls(
            num_layers=model.num_layers,
            num_kv_heads=model.num_kv_heads,
            head_size=model.head_size,
            block_size=block_size,
            num_blocks=num_blocks,
            dtype=dtype,
            device=device,
            num_swap_blocks=num_swap_blocks,
            layer_blocks=layer_blocks,
            layer_shapes=_layer_shapes(model) if getattr(model, "kv_cache_shapes", None) else None,
            groups=groups,
            num_tier_blocks=num_tier_blocks,
        )

    @property
    def layer_shapes(self) -> list[tuple[int, int]]:
        """(KV heads, head size) per layer: the model's own, else `num_kv_heads` x `head_size` for every
        layer (liquid scaling changes `num_kv_heads` of a rebound pool)."""
        if self._layer_shapes is not None:
            return self._layer_shapes
        return [(self.num_kv_heads, self.head_size)] * self.num_layers

    def _alloc(self, n: int, device: torch.device, layer: int, pin: bool = False) -> Tensor:
        num_kv_heads, head_size = self.layer_shapes[layer]
        shape = (2, n, self.block_size, num_kv_heads, head_size)
        if device.type == "cpu" and not pin:
            return cpu_zeros(shape, self.dtype)
        t = torch.zeros(shape, dtype=self.dtype, device=device)
        return t.pin_memory() if pin else t

    def bytes_per_block_for(self, num_kv_heads: int) -> int:
        return block_bytes(self.num_layers, self.block_size, num_kv_heads, self.head_size, self.dtype)

    @property
    def num_tier_blocks(self) -> int:
        return self.tier.num_blocks if self.tier is not None else 0

    @property
    def num_blocks(self) -> int:
        """The full-attention pool's blocks (sliding-window layers may have pools of their own)."""
        return self._num_blocks

    # Block ops, in the runner's order: grow, tier stores, moves, swap out, swap in, tier loads, copies,
    # (forward), shrink.
    def resize(self, num_blocks: int) -> None:
        """Grow (new blocks zeroed) or shrink (blocks past num_blocks dropped; the plan moved any in use) the
        full-attention pool's layers."""
        if num_blocks == self.num_blocks:
            return
        self._resize_layers([i for i in range(self.num_layers) if i not in self.group_layers], num_blocks)
        self._num_blocks = num_blocks

    def group_num_blocks(self, group: int) -> int:
        """The blocks of group `group`'s own pool."""
        return int(self.kv_caches[self.groups[group][0]].shape[1])

    def resize_groups(self, sizes: np.ndarray, *, grow: bool) -> None:
        """Each group's pool to `sizes[group]` blocks (the plan's `group_num_blocks`), only where that grows
        it (`grow`) or only where it shrinks it."""
        for g, layers in enumerate(self.groups):
            n, cur = int(sizes[g]), self.group_num_blocks(g)
            if (n > cur) if grow else (n < cur):
                self._resize_layers(layers, n)

    def _resize_layers(self, layers: Iterable[int], num_blocks: int) -> None:
        for i in layers:
            kv = self.kv_caches[i]
            cur = int(kv.shape[1])
            if num_blocks > cur:
                t = self._alloc(num_blocks, self.device, i)
                t[:, :cur].copy_(kv)
            else:
                t = kv[:, :num_blocks].clone()
            self.kv_caches[i] = t

    def move_group_blocks(self, triples: np.ndarray) -> None:
        """(group, src, dst) moves of the groups' blocks by a resize, each group's on its own layers."""
        for layers, pairs in self._per_group(triples):
            self.copy_blocks(pairs, layers)

    def _per_group(self, triples: np.ndarray) -> Iterator[tuple[tuple[int, ...], np.ndarray]]:
        """Each group's layers and its (a, b) pairs of the plan's (group, a, b) triples."""
        for g, layers in enumerate(self.groups):
            yield layers, (triples[triples[:, 0] == g, 1:] if len(triples) else triples)

    def move_blocks(self, pairs: np.ndarray) -> None:
        """(src, dst) device blocks; all sources are read before any destination is written."""
        self.copy_blocks(pairs)

    def copy_blocks(self, pairs: np.ndarray, layers: Iterable[int] | None = None) -> None:
        """(src, dst) device blocks of `layers` (default: the full-attention pool's; a group's pool of its own
        numbers its blocks apart)."""
        if len(pairs) == 0:
            return
        src, dst = _pairs(pairs, self.device)
        for i in self._swap_layers(layers):
            kv = as_bytes(self.kv_caches[i])
            kv[:, dst] = kv[:, src]

    def swap_out(self, pairs: np.ndarray, layers: Iterable[int] | None = None) -> None:
        """(device_block, swap_block) pairs: device -> CPU swap pool, of `layers` (default: the full-attention
        pool's)."""
        if len(pairs) == 0:
            return
        self._check_swap(len(pairs))
        src, dst = _pairs(pairs, self.device)
        dst_cpu = dst.cpu()
        for i in self._swap_layers(layers):
            swap, kv = as_bytes(self.swap_caches[i]), as_bytes(self.kv_caches[i])
            swap[:, dst_cpu] = kv[:, src].to("cpu")

    def swap_in(self, pairs: np.ndarray, layers: Iterable[int] | None = None) -> None:
        """(swap_block, device_block) pairs: CPU swap pool -> device, of `layers` (default: the full-attention
        pool's)."""
        if len(pairs) == 0:
            return
        self._check_swap(len(pairs))
        src, dst = _pairs(pairs, torch.device("cpu"))
        dst_dev = dst.to(self.device)
        for i in self._swap_layers(layers):
            kv, swap = as_bytes(self.kv_caches[i]), as_bytes(self.swap_caches[i])
            kv[:, dst_dev] = swap[:, src].to(self.device, non_blocking=True)

    def _swap_layers(self, layers: Iterable[int] | None) -> Iterable[int]:
        if layers is not None:
            return layers
        return (i for i in range(self.num_layers) if i not in self.group_layers)

    def swap_groups(self, triples: np.ndarray, *, out: bool) -> None:
        """(group, block, block) triples of the KV-cache groups' swap ops: device -> host (`out`) or back,
        each group's pairs on its own layers."""
        for layers, pairs in self._per_group(triples):
            (self.swap_out if out else self.swap_in)(pairs, layers)

    def _check_swap(self, n: int) -> None:
        if not self.swap_caches:
            raise RuntimeError(f"the plan swaps {n} blocks but there is no swap pool (swap_space=0)")

    def apply_plan_ops(self, plan: StepPlan) -> None:
        """Everything a step plan asks before its forward."""
        num_blocks = int(plan.num_blocks)
        if num_blocks > self.num_blocks:
            self.resize(num_blocks)
        if self.groups:
            self.resize_groups(plan.group_num_blocks, grow=True)
        # Stores read blocks as the last step left them; they run off the step, and nothing in this plan
        # writes a block one of them still reads.
        if self.tier is not None:
            self.tier.store(self.kv_caches, plan.tier_store, self.device)
            self.tier.wait_blocks(written_blocks(plan, self.block_size))
        self.move_blocks(plan.block_moves)
        if self.groups and len(plan.group_block_moves):
            self.move_group_blocks(plan.group_block_moves)
        self.swap_out(plan.swap_out)
        if self.groups:
            self.swap_groups(plan.group_swap_out, out=True)
        self.swap_in(plan.swap_in)
        if self.groups:
            self.swap_groups(plan.group_swap_in, out=False)
        if self.tier is not None:
            self.tier.load(self.kv_caches, plan.tier_load, self.device)
        elif len(plan.tier_load):
            raise RuntimeError("the plan loads blocks from a host KV tier this pool does not have")
        self.copy_blocks(plan.copies)

    def apply_plan_shrink(self, plan: StepPlan) -> None:
        num_blocks = int(plan.num_blocks)
        if num_blocks < self.num_blocks:
            self.resize(num_blocks)
        if self.groups:
            self.resize_groups(plan.group_num_blocks, grow=False)
