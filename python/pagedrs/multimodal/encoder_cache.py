"""The runner's image side (vLLM's encoder cache and `_execute_mm_encoder` / `_gather_mm_embeddings`): the
items of the requests it runs, the encoder outputs by image hash, and per step the rows of the flattened
batch that take encoder rows.

A step runs the encoder only for items whose placeholder rows are scheduled in it and whose output is not
cached; the outputs are kept by hash in an LRU bounded by `cache_tokens` encoder rows (an output in use by
the step is never evicted before it is read), so a repeated image, in another request or a later turn,
costs no encoder run (`hits` / `runs` count). A chunk that splits an item takes the item's rows it covers.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from pagedrs.multimodal import MultiModalBatch, MultiModalItem, item_tensors
from pagedrs.multimodal.mrope import MRopeTable

__all__ = ["EncoderCache", "MultiModalStep", "StepSlice"]


@dataclass
class StepSlice:
    """Rows [start, end) of `item`'s encoder output go to flattened batch rows row.. of this step."""

    item: MultiModalItem
    start: int
    end: int
    row: int


@dataclass
class MultiModalStep:
    batch: MultiModalBatch
    # [T] exclusive key-position limits (bidirectional items) and the batch rows they change; or None
    key_limits: Tensor | None
    key_limit_reqs: list[int]


class EncoderCache:
    """Encoder outputs by image hash (LRU, `cache_tokens` rows) and the items of each running sequence."""

    def __init__(self, cache_tokens: int = 8192) -> None:
        self.cache_tokens = cache_tokens
        self.outputs: OrderedDict[str, Tensor] = OrderedDict()
        self.num_rows = 0
        self.requests: dict[int, list[MultiModalItem]] = {}
        self.mrope: dict[int, MRopeTable] = {}  # M-RoPE models: each sequence's prompt position table
        self.hits = 0  # items a step needed whose output was cached
        self.runs = 0  # items the encoder ran for
        self.split_slices = 0  # slices of an item that a prefill chunk boundary cut (part of the item)
        self._changed: set[str] = set()  # hashes stored or evicted since `take_changes`

    def add(
        self, seq_ids: Sequence[int], items: list[MultiModalItem], mrope: MRopeTable | None = None
    ) -> None:
        for sid in seq_ids:
            if items:
                self.requests[int(sid)] = items
            if mrope is not None:
                self.mrope[int(sid)] = mrope

    def drop(self, seq_ids: Sequence[int]) -> None:
        for sid in seq_ids:
            self.requests.pop(int(sid), None)
            self.mrope.pop(int(sid), None)

    def slices(
        self, req_ids: np.ndarray, computed: np.ndarray, scheduled: np.ndarray, qsl: np.ndarray
    ) -> list[StepSlice]:
        """The item rows this step's scheduled tokens cover, in batch order."""
        out: list[StepSlice] = []
        for b, sid in enumerate(req_ids.tolist()):
            items = self.requests.get(sid)
            if not items:
                continue
            start = int(computed[b])
            end = start + int(scheduled[b])
            for it in items:
                lo, hi = max(start, it.offset), min(end, it.offset + it.length)
                if lo < hi:
                    out.append(StepSlice(it, lo - it.offset, hi - it.offset, int(qsl[b]) + lo - start))
        return out

    def encode(
        self,
        items: list[MultiModalItem],
        embed: Callable[[list[dict[str, Tensor]]], list[Tensor]],
        device: torch.device,
    ) -> dict[str, Tensor]:
        """The encoder output of each item (by hash): cached ones as they are, the others in one encoder call."""
        need: dict[str, MultiModalItem] = {}
        got: dict[str, Tensor] = {}
        for it in items:
            if it.hash in got or it.hash in need:
                continue
            cached = self.outputs.get(it.hash)
            if cached is not None:
                self.outputs.move_to_end(it.hash)
                self.hits += 1
                got[it.hash] = cached
            else:
                need[it.hash] = it
        if need:
            todo = list(need.values())
            outs = embed([item_tensors(it, device) for it in todo])
            for it, o in zip(todo, outs, strict=True):
                if o.shape[0] != it.length:
                    raise ValueError(
                        f"image {it.hash[:12]}: the encoder gave {o.shape[0]} rows for {it.length} placeholder tokens"
                    )
                got[it.hash] = o
                self.runs += 1
                self._store(it.hash, o)
        return got

    def _store(self, key: str, out: Tensor) -> None:
        self.outputs[key] = out
        self.num_rows += out.shape[0]
        self._changed.add(key)
        while self.num_rows > self.cache_tokens and len(self.outputs) > 1:
            old_key, old = self.outputs.popitem(last=False)
            self.num_rows -= old.shape[0]
            self._changed.add(old_key)

    def take_changes(self) -> tuple[list[str], list[str]]:
        """The hashes stored and those evicted since the last call (for the scheduler's encoder budget,
        which charges nothing for a cached output)."""
        changed, self._changed = self._changed, set()
        held = [k for k in changed if k in self.outputs]
        return held, [k for k in changed if k not in self.outputs]

    def step(
        self,
        req_ids: np.ndarray,
        computed: np.ndarray,
        scheduled: np.ndarray,
        qsl: np.ndarray,
        positions: np.ndarray,
        embed: Callable[[list[dict[str, Tensor]]], list[Tensor]],
        device: torch.device,
        *,
        bidirectional: bool,
    ) -> MultiModalStep | None:
        """This step's encoder rows and mask (and key limits for a bidirectional model); None when no
        scheduled token is an image's."""
        if not self.requests:
            return None
        slices = self.slices(req_ids, computed, scheduled, qsl)
        if not slices:
            return None
        self.split_slices += sum(1 for s in slices if s.end - s.start < s.item.length)
        outs = self.encode([s.item for s in slices], embed, device)
        num_tokens = int(qsl[-1])
        mask = torch.zeros(num_tokens, dtype=torch.bool)
        for s in slices:
            mask[s.row : s.row + s.end - s.start] = True
        embeds = torch.cat([outs[s.item.hash][s.start : s.end] for s in slices])
        key_limits, reqs = None, []
        if bidirectional:
            limits = torch.from_numpy(np.asarray(positions[:num_tokens], dtype=np.int64) + 1)
            for s in slices:
                limits[s.row : s.row + s.end - s.start] = s.item.offset + s.item.length
            key_limits = limits.to(device)
            rows = np.searchsorted(qsl, [s.row for s in slices], side="right") - 1
            reqs = sorted(set(rows.tolist()))
        return MultiModalStep(MultiModalBatch(embeds, mask.to(device)), key_limits, reqs)
