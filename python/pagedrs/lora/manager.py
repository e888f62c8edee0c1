"""The engine's adapters: loaded on the host (up to `max_cpu_loras`, least recently used dropped first),
resident in one of `max_loras` slots on the device while requests use them, and the per-step mapping of
token rows to slots that the LoRA layers read.

Under tensor parallelism every rank holds its part of each resident adapter, cut like the base layer it
belongs to (vLLM's column/row-parallel LoRA layers): for a column-parallel layer (q|k|v, gate|up) A whole
and the rank's rows of B; for a row-parallel one (o, down) the rank's columns of A and B whole, its delta
added to the rank's partial sum before the all-reduce, which then sums the deltas too. The driver's
`LoRAManager` decides the slots; the other ranks' `LoRASlots` follow its `LoRAWire` messages on the step
channel: slot loads (the adapter folder's path, read again on each rank) and clears, and each step's
adapter slot per request.

INVARIANT: an adapter with a live request keeps its slot; only an adapter no live request uses is evicted
(least recently used first). A request whose adapter finds no free slot waits (`try_activate` is False)
until one is released.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import msgspec
import numpy as np
import torch

from pagedrs._core import StepPlan
from pagedrs.config import LoRAConfig
from pagedrs.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from pagedrs.lora.adapter import LoRAAdapter, LoRAWeights, load_peft_adapter
from pagedrs.lora.layers import LoRABatch, LoRALinear, LoRASlice
from pagedrs.lora_request import LoRARequest

__all__ = ["LoRAManager", "LoRASlots", "LoRAWire"]

_Linear = ColumnParallelLinear | RowParallelLinear | ReplicatedLinear

logger = logging.getLogger("pagedrs.lora")


def _target(model: torch.nn.Module, hf_module: str) -> tuple[str, _Linear, LoRASlice, object]:
    """(our module name, the module, its output slice on this rank, the piece's shard id: "q"/"k"/"v", an
    index of gate|up, or None for a whole layer) for an HF module name; the fused layers (q|k|v, gate|up)
    are found through the model's `stacked_params`."""
    name: str = hf_module
    shard: object = None
    dotted = hf_module + "."
    for sp in getattr(model, "stacked_params", ()):
        if sp.hf_piece in dotted:
            name, shard = dotted.replace(sp.hf_piece, sp.param_piece).rstrip("."), sp.shard_id
            break
    try:
        module = model.get_submodule(name)
    except AttributeError:
        module = None
    if not isinstance(module, (ColumnParallelLinear, RowParallelLinear, ReplicatedLinear)):
        raise ValueError(
            f"LoRA target module {hf_module!r} is not a linear layer of {type(model).__name__} "
            "(supported: the attention and MLP projections)"
        )
    if isinstance(module, MergedColumnParallelLinear) and shard is not None:  # gate|up and q|k|v
        offset, size, _, _ = module.piece(shard)
    else:
        shard = None
        size = (
            module.output_size_per_partition
            if isinstance(module, ColumnParallelLinear)
            else module.output_size
        )
        offset = 0
    return name, module, LoRASlice(offset, size), shard


def _full_shape(module: _Linear, shard: object) -> tuple[int, int]:
    """(output features, input features) of the HF module behind a target, over all ranks."""
    if isinstance(module, MergedColumnParallelLinear):
        out = module.piece(shard)[2] if shard is not None else sum(module._full_sizes())
        return out, module.input_size
    if isinstance(module, ColumnParallelLinear):
        return module.output_size_per_partition * module.tp_size, module.input_size
    return module.output_size, module.input_size


def _rows_of_rank(module: ColumnParallelLinear, shard: object, b: torch.Tensor) -> torch.Tensor:
    """The rows of B ([full out, r]) that this rank's part of a column-parallel layer outputs, cut as its
    weight loader cuts the weight's rows (`piece`)."""
    if isinstance(module, MergedColumnParallelLinear):
        if shard is None:  # one adapter module over a whole fused layer (Phi-3's qkv_proj, gate_up_proj)
            parts = b.split(module._full_sizes())
            return torch.cat(
                [_rows_of_rank(module, sid, p) for sid, p in zip(module.shard_ids, parts, strict=True)]
            )
        _, n, _, start = module.piece(shard)
        return b.narrow(0, start, n)
    n = module.output_size_per_partition
    return b.narrow(0, module.tp_rank * n, n)


def _rank_part(module: _Linear, shard: object, w: LoRAWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B) of this rank: the whole pair on one rank or for a replicated layer; for a column-parallel
    layer A whole and B's rows of the rank's outputs; for a row-parallel one A's columns of the rank's
    inputs and B whole."""
    a, b = w.lora_a, w.lora_b
    if module.tp_size == 1 or isinstance(module, ReplicatedLinear):
        return a, b
    if isinstance(module, RowParallelLinear):
        n = module.input_size_per_partition
        return a.narrow(1, module.tp_rank * n, n).contiguous(), b
    assert isinstance(module, ColumnParallelLinear)
    return a, _rows_of_rank(module, shard, b).contiguous()


def check_adapter(model: torch.nn.Module, adapter: LoRAAdapter) -> None:
    """ValueError unless every module of the adapter is a linear layer of `model` of its shape."""
    for hf_module, w in adapter.modules.items():
        _, module, _, shard = _target(model, hf_module)
        out_f, in_f = _full_shape(module, shard)
        if (w.lora_b.shape[0], w.lora_a.shape[1]) != (out_f, in_f):
            raise ValueError(
                f"LoRA adapter {adapter.path!r}: module {hf_module!r} maps {w.lora_a.shape[1]} -> "
                f"{w.lora_b.shape[0]} features, the model's layer {in_f} -> {out_f}"
            )


class LoRAWire(msgspec.Struct, array_like=True):
    """The driver's LoRA message to the other ranks before a step: slot changes in order (slot, adapter
    folder; an empty path clears the slot), then the step's adapter slot per request (`plan.req_ids`
    order; None: no request of the step has an adapter)."""

    changes: list[tuple[int, str]]
    request_slots: list[int] | None


def rows_of(plan: StepPlan, request_slots: np.ndarray) -> np.ndarray | None:
    """Each token row's slot from each request's (None when no row has an adapter)."""
    if not (request_slots >= 0).any():
        return None
    return np.repeat(request_slots, plan.num_scheduled_tokens)


class LoRASlots:
    """The device side of the adapters: each slot's weights on this rank's layers (cut to the rank's part
    of each layer), and the step's row -> slot mapping (`batch`) the layers read."""

    def __init__(self, model: torch.nn.Module, config: LoRAConfig, device: torch.device) -> None:
        self.model = model
        self.config = config
        self.device = device
        self.dtype = next(model.parameters()).dtype
        self.batch = LoRABatch(num_slots=config.max_loras, device=device)
        self.layers: dict[str, LoRALinear] = {}  # our module name -> its LoRA hook (made on first use)
        self._pending: np.ndarray | None = None  # request slots of the next step (from the driver)

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        pieces: dict[str, list[tuple[LoRASlice, torch.Tensor, torch.Tensor, float]]] = {}
        for hf_module, w in adapter.modules.items():
            name, module, sl, shard = _target(self.model, hf_module)
            if name not in self.layers:
                self.layers[name] = LoRALinear(module, self.batch)
            a, b = _rank_part(module, shard, w)
            pieces.setdefault(name, []).append((sl, a.to(self.device), b.to(self.device), w.scaling))
        for name, layer_pieces in pieces.items():  # a slot is cleared before it is loaded again
            self.layers[name].set_slot(slot, layer_pieces)

    def clear(self, slot: int) -> None:
        for layer in self.layers.values():
            layer.clear_slot(slot)

    # ---- a non-driver rank -------------------------------------------------------------------------
    def apply(self, message: bytes) -> None:
        """The driver's `LoRAWire`: slot changes now, request slots for the next `prepare`."""
        wire = msgspec.msgpack.decode(message, type=LoRAWire)
        for slot, path in wire.changes:
            if path:
                self.load(
                    slot, load_peft_adapter(path, max_lora_rank=self.config.max_lora_rank, dtype=self.dtype)
                )
            else:
                self.clear(slot)
        self._pending = None if wire.request_slots is None else np.asarray(wire.request_slots, dtype=np.int64)

    def prepare(self, plan: StepPlan) -> None:
        """This step's rows from the request slots the driver sent before it (none: the base model)."""
        pending, self._pending = self._pending, None
        self.batch.set_rows(None if pending is None else rows_of(plan, pending))


class LoRAManager:
    """Adapters for one model: the driver's (rank 0's) bookkeeping. With `broadcast` (tensor parallelism)
    it keeps the slot changes and request slots for the other ranks (`wire_message`)."""

    def __init__(
        self, model: torch.nn.Module, config: LoRAConfig, device: torch.device, *, broadcast: bool = False
    ) -> None:
        self.model = model
        self.config = config
        self.slots = LoRASlots(model, config, device)
        self.broadcast = broadcast
        self._changes: list[tuple[int, str]] = []  # slot changes not yet sent to the other ranks
        self._request_slots: np.ndarray | None = None  # this step's, for the other ranks
        self._host: OrderedDict[int, tuple[LoRARequest, LoRAAdapter]] = OrderedDict()  # LRU order
        self._slots: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, LRU order
        self._free_slots = list(range(config.max_loras - 1, -1, -1))
        self._users: dict[int, set[str]] = {}  # adapter id -> request ids using it
        self._seq_slot: dict[int, int] = {}  # seq id -> slot
        self._request_seqs: dict[str, tuple[int, list[int]]] = {}  # request id -> (adapter id, seq ids)

    # ---- adapters ----------------------------------------------------------------------------------
    def add_adapter(self, lora: LoRARequest) -> None:
        """Load `lora` onto the host (a no-op if its id is loaded with the same name and path); ValueError
        for a bad folder, a rank above max_lora_rank, a module the model lacks, or an id in use by
        another adapter."""
        known = self._host.get(lora.lora_int_id)
        if known is not None:
            if (known[0].lora_name, known[0].lora_path) != (lora.lora_name, lora.lora_path):
                raise ValueError(
                    f"lora_int_id {lora.lora_int_id} is already loaded as adapter {known[0].lora_name!r} "
                    f"({known[0].lora_path!r})"
                )
            self._host.move_to_end(lora.lora_int_id)
            return
        adapter = load_peft_adapter(
            lora.lora_path, max_lora_rank=self.config.max_lora_rank, dtype=self.slots.dtype
        )
        check_adapter(self.model, adapter)
        self._host[lora.lora_int_id] = (lora, adapter)
        self._trim_host(keep=lora.lora_int_id)
        logger.info("LoRA adapter %s (id %d, rank %d) loaded", lora.lora_name, lora.lora_int_id, adapter.rank)

    def remove_adapter(self, lora_int_id: int) -> bool:
        """Drop an adapter from the host and its slot; False if unknown; ValueError while requests use it."""
        if self._users.get(lora_int_id):
            raise ValueError(
                f"LoRA adapter {lora_int_id} is in use by {len(self._users[lora_int_id])} request(s)"
            )
        if lora_int_id not in self._host:
            return False
        del self._host[lora_int_id]
        self._evict(lora_int_id)
        return True

    def list_adapters(self) -> list[LoRARequest]:
        return [req for req, _ in self._host.values()]

    def _trim_host(self, keep: int | None = None) -> None:
        """Drop least recently used host adapters beyond max_cpu_loras (never one in a slot, or `keep`)."""
        limit = self.config.max_cpu_loras or self.config.max_loras
        for aid in list(self._host):
            if len(self._host) <= limit:
                break
            if aid != keep and not self._users.get(aid) and aid not in self._slots:
                del self._host[aid]

    # ---- slots ---------------------------------------------------------------------------------------
    @property
    def batch(self) -> LoRABatch:
        return self.slots.batch

    @property
    def layers(self) -> dict[str, LoRALinear]:
        return self.slots.layers

    def _evict(self, lora_int_id: int) -> None:
        slot = self._slots.pop(lora_int_id, None)
        if slot is None:
            return
        self.slots.clear(slot)
        if self.broadcast:
            self._changes.append((slot, ""))
        self._free_slots.append(slot)

    def _load_slot(self, lora_int_id: int, slot: int) -> None:
        request, adapter = self._host[lora_int_id]
        self.slots.load(slot, adapter)
        if self.broadcast:
            self._changes.append((slot, request.lora_path))
        self._slots[lora_int_id] = slot

    def try_activate(self, request_id: str, lora: LoRARequest, seq_ids: list[int]) -> bool:
        """Give the request's sequences its adapter's slot (loading the adapter if needed); False when
        every slot holds an adapter that live requests use (the request must wait)."""
        self.add_adapter(lora)
        aid = lora.lora_int_id
        if aid not in self._slots:
            if not self._free_slots:
                idle = next((a for a in self._slots if not self._users.get(a)), None)
                if idle is None:
                    return False
                self._evict(idle)
            self._load_slot(aid, self._free_slots.pop())
        self._slots.move_to_end(aid)
        self._host.move_to_end(aid)
        self._users.setdefault(aid, set()).add(request_id)
        slot = self._slots[aid]
        for sid in seq_ids:
            self._seq_slot[sid] = slot
        self._request_seqs[request_id] = (aid, list(seq_ids))
        return True

    def release(self, request_id: str) -> None:
        """The request is done: its sequences leave the mapping; its adapter may be evicted from now on."""
        entry = self._request_seqs.pop(request_id, None)
        if entry is None:
            return
        aid, seq_ids = entry
        for sid in seq_ids:
            self._seq_slot.pop(sid, None)
        users = self._users.get(aid)
        if users is not None:
            users.discard(request_id)
            if not users:
                del self._users[aid]
        self._trim_host()

    # ---- the step ----------------------------------------------------------------------------------
    def prepare(self, plan: StepPlan) -> None:
        """Each of this step's token rows' adapter slot (-1: the base model, no delta)."""
        rows = slots = None
        if self._seq_slot and int(plan.num_tokens):
            slots = np.array([self._seq_slot.get(s, -1) for s in plan.req_ids.tolist()], dtype=np.int64)
            rows = rows_of(plan, slots)
        self._request_slots = slots if rows is not None else None
        self.batch.set_rows(rows)

    def wire_message(self) -> bytes | None:
        """The other ranks' `LoRAWire` for the step `prepare` saw (None when there is nothing to send:
        no slot change and no row with an adapter); the slot changes are sent once."""
        if not self._changes and self._request_slots is None:
            return None
        slots = None if self._request_slots is None else self._request_slots.tolist()
        message = msgspec.msgpack.encode(LoRAWire(self._changes, slots))
        self._changes = []
        return message
