"""The engine's adapters: loaded on the host (up to `max_cpu_loras`, least recently used dropped first),
resident in one of `max_loras` slots on the device while requests use them, and the per-step mapping of
token rows to slots that the LoRA layers read.

INVARIANT: an adapter with a live request keeps its slot; only an adapter no live request uses is evicted
(least recently used first). A request whose adapter finds no free slot waits (`try_activate` is False)
until one is released.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import numpy as np
import torch

from pagedrs._core import StepPlan
from pagedrs.config import LoRAConfig
from pagedrs.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from pagedrs.lora.adapter import LoRAAdapter, LoRAWeights, load_peft_adapter
from pagedrs.lora.layers import LoRABatch, LoRALinear, LoRASlice
from pagedrs.lora.request import LoRARequest

__all__ = ["LoRAManager"]

_Linear = ColumnParallelLinear | RowParallelLinear | ReplicatedLinear

logger = logging.getLogger("pagedrs.lora")


def _target(model: torch.nn.Module, hf_module: str) -> tuple[str, _Linear, LoRASlice]:
    """(our module name, the module, its output slice) for an HF module name; the fused layers (q|k|v,
    gate|up) are found through the model's `stacked_params`."""
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
    if isinstance(module, QKVParallelLinear) and shard is not None:
        q, kv = module.q_size, module.kv_size
        offset, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[str(shard)]
    elif isinstance(module, MergedColumnParallelLinear) and isinstance(shard, int):
        sizes = [s // module.tp_size for s in module.output_sizes]
        offset, size = sum(sizes[:shard]), sizes[shard]
    else:
        size = (
            module.output_size_per_partition
            if isinstance(module, ColumnParallelLinear)
            else module.output_size
        )
        offset = 0
    return name, module, LoRASlice(offset, size)


def _input_size(module: _Linear) -> int:
    if isinstance(module, RowParallelLinear):
        return module.input_size_per_partition
    return module.input_size


class LoRAManager:
    """Adapters for one model (one device, no tensor parallelism)."""

    def __init__(self, model: torch.nn.Module, config: LoRAConfig, device: torch.device) -> None:
        self.model = model
        self.config = config
        self.device = device
        self.dtype = next(model.parameters()).dtype
        self.batch = LoRABatch(num_slots=config.max_loras, device=device)
        self.layers: dict[str, LoRALinear] = {}  # our module name -> its LoRA hook (made on first use)
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
        adapter = load_peft_adapter(lora.lora_path, max_lora_rank=self.config.max_lora_rank, dtype=self.dtype)
        for hf_module, w in adapter.modules.items():
            _, module, sl = _target(self.model, hf_module)
            want = (sl.size, _input_size(module))
            if (w.lora_b.shape[0], w.lora_a.shape[1]) != want:
                raise ValueError(
                    f"LoRA adapter {lora.lora_path!r}: module {hf_module!r} maps {w.lora_a.shape[1]} -> "
                    f"{w.lora_b.shape[0]} features, the model's layer {want[1]} -> {want[0]}"
                )
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
    def _evict(self, lora_int_id: int) -> None:
        slot = self._slots.pop(lora_int_id, None)
        if slot is None:
            return
        for layer in self.layers.values():
            layer.clear_slot(slot)
        self._free_slots.append(slot)

    def _load_slot(self, lora_int_id: int, slot: int) -> None:
        _, adapter = self._host[lora_int_id]
        pieces: dict[str, list[tuple[LoRASlice, torch.Tensor, torch.Tensor, float]]] = {}
        for hf_module, w in adapter.modules.items():
            name, module, sl = _target(self.model, hf_module)
            if name not in self.layers:
                self.layers[name] = LoRALinear(module, self.batch)
            pieces.setdefault(name, []).append(self._on_device(sl, w))
        for name, layer_pieces in pieces.items():
            self.layers[name].set_slot(slot, layer_pieces)
        self._slots[lora_int_id] = slot

    def _on_device(
        self, sl: LoRASlice, w: LoRAWeights
    ) -> tuple[LoRASlice, torch.Tensor, torch.Tensor, float]:
        return sl, w.lora_a.to(self.device), w.lora_b.to(self.device), w.scaling

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
        rows = None
        if self._seq_slot and int(plan.num_tokens):
            slots = np.array([self._seq_slot.get(s, -1) for s in plan.req_ids.tolist()], dtype=np.int64)
            if (slots >= 0).any():
                rows = np.repeat(slots, plan.num_scheduled_tokens)
        self.batch.set_rows(rows)
