"""Sampling parameters kept per sequence across steps (the sampling half of vLLM V1's InputBatch).

A sequence's parameters are read from its `SamplingRow` once, when it is first sampled, into flat per-slot
numpy columns; a step then gathers its rows' columns with numpy (no Python loop over the batch) and sends
what the sampler needs in one host-to-device copy. An all-greedy batch without logit processors builds
nothing at all. Only the rows that need their token history (penalties, min_tokens not reached yet) are
read from their Python objects again, each step.

Slots are keyed by seq id (never reused by the engine). `remove` frees the slots of finished sequences;
a sequence that is never removed (the engine need not say) is dropped when the table is full and it is
not in the step being sampled, and read again from its row if it ever comes back (a preempted one): the
columns are a function of the row's immutable parameters, so dropping is always safe.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from pagedrs.layers.sampler import GREEDY_EPS, SamplingMetadata, SamplingRow, padded_token_ids
from pagedrs.runner.step_buffers import PackedBuffer, aligned

__all__ = ["SamplingState"]

_MIN_CAPACITY = 16
_F32, _I64, _I32 = np.float32, np.int64, np.int32


class SamplingState:
    """Per-slot sampling columns for the sequences being sampled; `metadata` builds a step's
    `SamplingMetadata` equal to a from-scratch rebuild over the same rows (the tests' oracle)."""

    # One column per parameter, `capacity` long (allocated and grown by `_grow`).
    seq_ids: np.ndarray
    temperature: np.ndarray
    top_k: np.ndarray  # vocab size when off
    has_top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    presence: np.ndarray
    frequency: np.ndarray
    repetition: np.ndarray
    needs_penalties: np.ndarray
    min_tokens: np.ndarray
    has_bias: np.ndarray
    num_logprobs: np.ndarray  # -1: no logprobs
    simple_greedy: np.ndarray
    seeded: np.ndarray
    generators: list[torch.Generator | None]
    stop_ids: list[np.ndarray | None]
    bias: list[tuple[np.ndarray, np.ndarray] | None]

    def __init__(
        self,
        *,
        vocab_size: int,
        device: torch.device,
        eos_token_ids: Sequence[int] = (),
        capacity: int = 256,
    ) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.eos_token_ids = tuple(eos_token_ids)
        self.capacity = 0
        self._grow(max(capacity, _MIN_CAPACITY))
        self._free: list[int] = list(range(self.capacity - 1, -1, -1))
        self._index_dirty = True
        # The last step's ids and slots: a decode batch is usually the same as the step before.
        self._last: tuple[np.ndarray, np.ndarray] | None = None
        self._keys = np.zeros(0, dtype=_I64)  # live seq ids, sorted
        self._key_slots = np.zeros(0, dtype=_I64)
        self._upload: PackedBuffer | None = None

    # ---- slots ----------------------------------------------------------------------------------------
    def _grow(self, capacity: int) -> None:
        old = self.capacity

        def col(name: str, dtype: type[np.generic], fill: float | bool) -> None:
            new = np.full(capacity, fill, dtype=dtype)
            if old:
                new[:old] = getattr(self, name)
            setattr(self, name, new)

        col("seq_ids", _I64, -1)
        col("temperature", _F32, 0.0)
        col("top_k", _I64, 0)
        col("has_top_k", np.bool_, False)
        col("top_p", _F32, 1.0)
        col("min_p", _F32, 0.0)
        col("presence", _F32, 0.0)
        col("frequency", _F32, 0.0)
        col("repetition", _F32, 1.0)
        col("needs_penalties", np.bool_, False)
        col("min_tokens", _I32, 0)
        col("has_bias", np.bool_, False)
        col("num_logprobs", _I32, -1)
        col("simple_greedy", np.bool_, False)
        col("seeded", np.bool_, False)
        n = capacity - old
        if old:
            self.generators += [None] * n
            self.stop_ids += [None] * n
            self.bias += [None] * n
            self._free = list(range(capacity - 1, old - 1, -1)) + self._free
        else:
            self.generators = [None] * n
            self.stop_ids = [None] * n
            self.bias = [None] * n
        self.capacity = capacity

    @property
    def num_seqs(self) -> int:
        return self.capacity - len(self._free)

    def add(self, seq_id: int, row: SamplingRow) -> int:
        """Read a sequence's parameters into a free slot (growing the table if none is free)."""
        if not self._free:
            self._grow(2 * self.capacity)
        slot = self._free.pop()
        p = row.params
        v = self.vocab_size
        self.seq_ids[slot] = seq_id
        self.temperature[slot] = p.temperature
        self.has_top_k[slot] = p.top_k > 0
        self.top_k[slot] = p.top_k if p.top_k > 0 else v
        self.top_p[slot] = p.top_p
        self.min_p[slot] = p.min_p
        self.presence[slot] = p.presence_penalty
        self.frequency[slot] = p.frequency_penalty
        self.repetition[slot] = p.repetition_penalty
        self.needs_penalties[slot] = p.needs_penalties
        self.min_tokens[slot] = p.min_tokens or 0
        self.num_logprobs[slot] = -1 if p.logprobs is None else p.logprobs
        self.simple_greedy[slot] = row.is_simple_greedy
        self.generators[slot] = row.generator
        self.seeded[slot] = row.generator is not None
        stops = set(p.stop_token_ids or ())
        if not p.ignore_eos:
            stops.update(self.eos_token_ids)
        self.stop_ids[slot] = np.array(sorted(t for t in stops if 0 <= t < v), dtype=_I64)
        items = [(t, b) for t, b in (p.logit_bias or {}).items() if 0 <= t < v]
        self.has_bias[slot] = bool(items)
        self.bias[slot] = (
            (np.array([t for t, _ in items], dtype=_I64), np.array([b for _, b in items], dtype=_F32))
            if items
            else None
        )
        self._index_dirty = True
        self._last = None
        return slot

    def remove(self, seq_ids: Iterable[int]) -> None:
        """Free the slots of these sequences (finished or aborted); unknown ids are ignored."""
        ids = np.fromiter(seq_ids, dtype=_I64)
        if not len(ids):
            return
        for slot in np.nonzero(np.isin(self.seq_ids, ids))[0].tolist():
            self._release(slot)

    def _release(self, slot: int) -> None:
        self.seq_ids[slot] = -1
        self.generators[slot] = None
        self.stop_ids[slot] = None
        self.bias[slot] = None
        self._free.append(slot)
        self._index_dirty = True
        self._last = None

    def _evict_absent(self, keep: np.ndarray) -> None:
        """Free every slot whose sequence is not in `keep` (the step being sampled)."""
        live = self.seq_ids >= 0
        for slot in np.nonzero(live & ~np.isin(self.seq_ids, keep))[0].tolist():
            self._release(slot)

    def _lookup(self, seq_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(slot per id, found mask)."""
        if self._index_dirty:
            live = np.nonzero(self.seq_ids >= 0)[0]
            order = np.argsort(self.seq_ids[live], kind="stable")
            self._key_slots = live[order]
            self._keys = self.seq_ids[self._key_slots]
            self._index_dirty = False
        if not len(self._keys):
            return np.zeros(len(seq_ids), dtype=_I64), np.zeros(len(seq_ids), dtype=np.bool_)
        pos = np.minimum(np.searchsorted(self._keys, seq_ids), len(self._keys) - 1)
        return self._key_slots[pos], self._keys[pos] == seq_ids

    def slots(self, seq_ids: np.ndarray, rows: Sequence[SamplingRow]) -> np.ndarray:
        """The slot of each sequence, adding the ones not seen yet (`rows[i]` is sequence `seq_ids[i]`)."""
        seq_ids = np.asarray(seq_ids, dtype=_I64)
        last = self._last
        if last is not None and np.array_equal(last[0], seq_ids):
            return last[1]
        slots, found = self._lookup(seq_ids)
        if found.all():
            self._last = (seq_ids.copy(), slots)
            return slots
        missing = np.nonzero(~found)[0]
        if len(missing) > len(self._free):
            self._evict_absent(seq_ids)
        added: dict[int, int] = {}
        for i in missing.tolist():
            sid = int(seq_ids[i])
            if sid not in added:
                added[sid] = self.add(sid, rows[i])
        slots, found = self._lookup(seq_ids)
        assert found.all()
        self._last = (seq_ids.copy(), slots)
        return slots

    # ---- one step -------------------------------------------------------------------------------------
    def metadata(
        self,
        seq_ids: np.ndarray,
        rows: Sequence[SamplingRow],
        *,
        default_generator: torch.Generator | None = None,
    ) -> SamplingMetadata:
        """This step's SamplingMetadata from the persistent slots. Long because it is one pass per sampling
        feature (temperature, top-k/p, min-p, penalties, bans, bias, logprobs), each gathered only when
        a row of the step uses it; split up, the per-step feature checks would run twice."""
        slots = self.slots(seq_ids, rows)
        n = len(slots)
        if self.simple_greedy[slots].all():
            return SamplingMetadata.greedy(n)
        v = self.vocab_size
        temperature = self.temperature[slots]
        greedy_rows = temperature < GREEDY_EPS
        meta = SamplingMetadata(num_rows=n, all_greedy=bool(greedy_rows.all()))
        meta.default_generator = default_generator
        host: list[tuple[str, np.ndarray, type]] = []
        if not meta.all_greedy:
            host.append(("temperature", temperature, _F32))
            if self.has_top_k[slots].any():
                top_k = self.top_k[slots]
                host.append(("top_k", top_k, _I64))
                on = top_k[top_k < v]
                meta.top_k_max = int(on.max()) if len(on) else 1
            top_p = self.top_p[slots]
            if (top_p < 1.0).any():
                host.append(("top_p", top_p, _F32))
            min_p = self.min_p[slots]
            if (min_p > 0.0).any():
                host.append(("min_p", min_p, _F32))
            meta.random_rows_cpu = np.nonzero(~greedy_rows)[0]
            host.append(("random_rows", meta.random_rows_cpu, _I64))
            seeded = np.nonzero(self.seeded[slots])[0]
            meta.generators = {i: self.generators[slots[i]] for i in seeded.tolist()}
        pen = self.needs_penalties[slots]
        if pen.any():
            host.append(("presence_penalties", self.presence[slots], _F32))
            host.append(("frequency_penalties", self.frequency[slots], _F32))
            host.append(("repetition_penalties", self.repetition[slots], _F32))
            pen_rows = np.nonzero(pen)[0].tolist()
            prompts = padded_token_ids(n, {i: rows[i].prompt_token_ids for i in pen_rows}, v)
            outputs = padded_token_ids(n, {i: rows[i].output_token_ids for i in pen_rows}, v)
            meta.prompt_token_ids = torch.from_numpy(prompts).to(self.device, non_blocking=True)
            meta.output_token_ids = torch.from_numpy(outputs).to(self.device, non_blocking=True)
        min_tokens = self.min_tokens[slots]
        ban_rows: list[np.ndarray] = []
        ban_ids: list[np.ndarray] = []
        for i in np.nonzero(min_tokens)[0].tolist():
            stops = self.stop_ids[slots[i]]
            if rows[i].num_output_tokens < min_tokens[i] and stops is not None and len(stops):
                ban_rows.append(np.full(len(stops), i, dtype=_I64))
                ban_ids.append(stops)
        if ban_rows:
            host.append(("ban_rows", np.concatenate(ban_rows), _I64))
            host.append(("ban_ids", np.concatenate(ban_ids), _I64))
        bias_rows: list[np.ndarray] = []
        bias_ids: list[np.ndarray] = []
        bias_vals: list[np.ndarray] = []
        for i in np.nonzero(self.has_bias[slots])[0].tolist():
            ids, vals = self.bias[slots[i]]
            bias_rows.append(np.full(len(ids), i, dtype=_I64))
            bias_ids.append(ids)
            bias_vals.append(vals)
        if bias_rows:
            host.append(("bias_rows", np.concatenate(bias_rows), _I64))
            host.append(("bias_ids", np.concatenate(bias_ids), _I64))
            host.append(("bias_vals", np.concatenate(bias_vals), _F32))
        nl = self.num_logprobs[slots]
        top = int(nl.max()) if n else -1
        meta.max_num_logprobs = None if top < 0 else min(top, v)
        dev = self._copy(host)
        for name in ("temperature", "top_k", "top_p", "min_p", "random_rows"):
            if name in dev:
                setattr(meta, name, dev[name])
        if "presence_penalties" in dev:
            meta.presence_penalties = dev["presence_penalties"]
            meta.frequency_penalties = dev["frequency_penalties"]
            meta.repetition_penalties = dev["repetition_penalties"]
        if "ban_rows" in dev:
            meta.banned = (dev["ban_rows"], dev["ban_ids"])
        if "bias_rows" in dev:
            meta.bias = (dev["bias_rows"], dev["bias_ids"], dev["bias_vals"])
        return meta

    def _copy(self, host: list[tuple[str, np.ndarray, type]]) -> dict[str, torch.Tensor]:
        """Every column in one host-to-device copy; device views by name."""
        if not host:
            return {}
        offsets = []
        end = 0
        for _, arr, dtype in host:
            offsets.append(end)
            end += aligned(arr.size * np.dtype(dtype).itemsize)
        buf = self._upload
        if buf is None or buf.capacity < end:
            buf = self._upload = PackedBuffer(max(2 * end, 4096), self.device)
        buf.begin()
        for off, (_, arr, dtype) in zip(offsets, host, strict=True):
            buf.write(off, arr, dtype)
        buf.copy(end)
        return {
            name: buf.view(off, dtype, arr.size)
            for off, (name, arr, dtype) in zip(offsets, host, strict=True)
        }
