"""A step's inputs in one host-to-device copy.

Every array of a plan the forward reads (input_ids, positions, slot_mapping, query_start_loc, seq_lens,
the block-table rows or the dense block table, the block-table rows the plan rewrote, the logits indices)
is written into one pinned host staging buffer, copied with one `non_blocking` copy into a persistent
device buffer of the same size, and read through typed views of it. On a CPU the same code runs (the two
buffers are plain CPU tensors and the copy is a memcpy), so the CPU tests cover the packing.

Layout: segments one after another, each 16-byte aligned, sized for this step, so only the bytes the step
uses are copied. A decode step replayed by a CUDA graph uses the fixed layout of `graph_rows` rows
instead (`StepBuffers.graph_inputs()`: the graphs' static inputs are views of that layout), padded up to
the graph's batch size: padding rows read token 0 at position 0, write no cache slot (-1), attend to
nothing (seq_len 0) and take row 0 of the block table.

INVARIANT: the host buffer is rewritten only after the device has finished reading it for the previous
step (an event recorded after each copy is waited on before the next packing). On the driver the sampled
tokens' device-to-host copy already orders this; tensor-parallel workers, which never wait for the
device, rely on the event.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

if TYPE_CHECKING:
    from pagedrs._core import StepPlan

__all__ = ["GraphInputs", "PackedBuffer", "StepBuffers", "StepInputs", "aligned"]

_ALIGN = 16


def aligned(n: int) -> int:
    """n rounded up to the segment alignment (16 bytes)."""
    return (n + _ALIGN - 1) & ~(_ALIGN - 1)


_NP_ITEM: dict[type[np.generic], int] = {np.int64: 8, np.int32: 4, np.float32: 4}
_TORCH_OF: dict[type[np.generic], torch.dtype] = {
    np.int64: torch.int64,
    np.int32: torch.int32,
    np.float32: torch.float32,
}


class PackedBuffer:
    """A host staging buffer (pinned on CUDA) and a device buffer of `capacity` bytes each, read and
    written through typed views made once (a step only slices them)."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        capacity = aligned(max(capacity, _ALIGN))
        self.capacity = capacity
        self.device = device
        pin = device.type == "cuda"
        self.host = torch.empty(capacity, dtype=torch.uint8, pin_memory=pin)
        self.dev = torch.empty(capacity, dtype=torch.uint8, device=device)
        host_np = self.host.numpy()
        self._host = {t: host_np.view(t) for t in _NP_ITEM}
        self._dev = {t: self.dev.view(_TORCH_OF[t]) for t in _NP_ITEM}
        self._event = torch.cuda.Event() if device.type == "cuda" else None
        self._pending = False

    def begin(self) -> None:
        """Wait until the previous copy has read the host buffer (see the module's invariant)."""
        if self._pending:
            assert self._event is not None
            self._event.synchronize()
            self._pending = False

    def write(
        self, offset: int, arr: np.ndarray, dtype: type[np.generic], count: int | None = None
    ) -> np.ndarray:
        """Write the elements of `arr` (cast to `dtype`) at byte `offset` of the host buffer; returns the
        1-d typed host view of `count` elements (default: all of arr's), so that the caller may pad it."""
        flat = arr.reshape(-1)
        n = flat.size if count is None else count
        start = offset // _NP_ITEM[dtype]
        view = self._host[dtype][start : start + n]
        view[: flat.size] = flat
        return view

    def host_view(self, offset: int, dtype: type[np.generic], n: int) -> np.ndarray:
        start = offset // _NP_ITEM[dtype]
        return self._host[dtype][start : start + n]

    def copy(self, nbytes: int) -> None:
        """The step's one host-to-device copy."""
        if nbytes == 0:
            return
        self.dev[:nbytes].copy_(self.host[:nbytes], non_blocking=True)
        if self._event is not None:
            self._event.record(torch.cuda.current_stream(self.device))
            self._pending = True

    def view(self, offset: int, dtype: type[np.generic], rows: int, cols: int | None = None) -> Tensor:
        """The device view of `rows` elements (or a [rows, cols] matrix) of numpy type `dtype` at `offset`."""
        start = offset // _NP_ITEM[dtype]
        if cols is None:
            return self._dev[dtype][start : start + rows]
        return self._dev[dtype][start : start + rows * cols].view(rows, cols)


@dataclass
class GraphInputs:
    """The static inputs CUDA graphs read: views of the fixed graph layout, `rows` long (qsl rows + 1)."""

    input_ids: Tensor  # int64
    positions: Tensor  # int64
    slot_mapping: Tensor  # int64
    seq_lens: Tensor  # int32
    query_start_loc: Tensor  # int32
    block_table_rows: Tensor  # int64: the rows of the block-table mirror each graph row reads


@dataclass
class StepInputs:
    """One step's inputs on the device (views of the device buffer, valid until the next packing)."""

    input_ids: Tensor
    positions: Tensor
    slot_mapping: Tensor
    query_start_loc: Tensor
    seq_lens: Tensor
    block_table_rows: Tensor | None  # int64 [B]: rows of the mirror (mirror mode)
    changed_rows: Tensor | None  # int64 [k]: mirror rows this plan rewrote (mirror mode)
    changed_row_data: Tensor | None  # int32 [k, W]: their new contents
    block_tables: Tensor | None  # int32 [B, M]: the dense table (no mirror)
    logits_indices: Tensor | None  # int64 [L]: hidden rows whose logits are wanted (None: none)
    logits_are_all_rows: bool  # logits_indices == arange(num_tokens): no gather needed
    graph_size: int | None  # the padded batch size of a graph step, None for an eager step


# (name, dtype, rows: "T" tokens or "B" requests, extra elements)
_HEAD = (
    ("input_ids", np.int64, "T", 0),
    ("positions", np.int64, "T", 0),
    ("slot_mapping", np.int64, "T", 0),
    ("seq_lens", np.int32, "B", 0),
    ("query_start_loc", np.int32, "B", 1),
    ("block_table_rows", np.int64, "B", 0),
)


def _head_offsets(num_tokens: int, num_reqs: int) -> tuple[dict[str, int], int]:
    offsets: dict[str, int] = {}
    end = 0
    for name, dtype, rows, extra in _HEAD:
        offsets[name] = end
        n = (num_tokens if rows == "T" else num_reqs) + extra
        end += aligned(n * _NP_ITEM[dtype])
    return offsets, end


@dataclass(frozen=True, slots=True)
class _Layout:
    """One step's places in the packed buffer: head-array offsets, the tail arrays' offsets, the total size
    and the counts they were sized for (`rows`/`toks`: padded to the graph size in a graph step)."""

    offsets: dict[str, int]
    logits_off: int
    changed_off: int
    table_off: int
    end: int
    num_tokens: int
    num_reqs: int
    num_logits: int
    num_changed: int
    width: int
    rows: int
    toks: int
    graph_size: int | None


class StepBuffers:
    """Packs a plan into the staging buffer, copies it once, and hands out device views."""

    def __init__(
        self,
        *,
        max_num_tokens: int,
        max_num_reqs: int,
        table_width: int,
        graph_rows: int,
        device: torch.device,
    ) -> None:
        self.device = device
        self.graph_rows = graph_rows
        _, head = _head_offsets(max(max_num_tokens, graph_rows), max(max_num_reqs, graph_rows))
        tail = (
            aligned(8 * (max_num_tokens + max_num_reqs))  # logits indices, then prompt-logprob rows
            + aligned(8 * max_num_reqs)  # changed rows
            + aligned(4 * max_num_reqs * table_width)  # their contents, or the dense table
        )
        self.main = PackedBuffer(head + tail, device)
        self._overflow: PackedBuffer | None = None  # a plan larger than the limits (never in practice)
        self._graph_offsets, self._graph_head = _head_offsets(graph_rows, graph_rows)
        self._arange = np.arange(max(max_num_tokens, graph_rows) + 1, dtype=np.int64)

    def graph_inputs(self) -> GraphInputs:
        """The fixed-address views CUDA graphs are captured against."""
        o, n, v = self._graph_offsets, self.graph_rows, self.main.view
        return GraphInputs(
            input_ids=v(o["input_ids"], np.int64, n),
            positions=v(o["positions"], np.int64, n),
            slot_mapping=v(o["slot_mapping"], np.int64, n),
            seq_lens=v(o["seq_lens"], np.int32, n),
            query_start_loc=v(o["query_start_loc"], np.int32, n + 1),
            block_table_rows=v(o["block_table_rows"], np.int64, n),
        )

    def pack(
        self,
        plan: StepPlan,
        *,
        extra_logits_indices: np.ndarray | None = None,
        mirror_rows: np.ndarray | None = None,
        graph_size: int | None = None,
    ) -> StepInputs:
        """Pack `plan` into one host buffer and copy it to the device in one transfer. `mirror_rows`: the
        scheduler's block-table view when the device keeps a mirror of it (then the plan's changed rows
        travel, and the batch's row indices); None: the plan's dense block table travels. `graph_size`:
        pack in the graph layout, padded to that size."""
        extra = extra_logits_indices if extra_logits_indices is not None else plan.logits_indices[:0]
        lay = self._layout(plan, extra, mirror_rows, graph_size)
        buf = self.main
        if lay.end > buf.capacity:
            if graph_size is not None:
                raise ValueError(f"a graph step needs {lay.end} bytes, the step buffer holds {buf.capacity}")
            if self._overflow is None or self._overflow.capacity < lay.end:
                self._overflow = PackedBuffer(2 * lay.end, self.device)
            buf = self._overflow
        buf.begin()
        self._write(buf, plan, lay, extra, mirror_rows)
        buf.copy(lay.end)
        return self._inputs(buf, plan, lay, extra, mirror_rows is not None)

    def _layout(
        self, p: StepPlan, extra: np.ndarray, mirror_rows: np.ndarray | None, graph_size: int | None
    ) -> _Layout:
        """Where each array of this step goes in the buffer (the head arrays, then logits indices, changed
        row ids and block-table rows, each 16-byte aligned)."""
        num_tokens, num_reqs = len(p.input_ids), len(p.seq_lens)
        num_logits = len(p.logits_indices) + len(extra)
        if mirror_rows is not None:
            num_changed, width, table_rows = len(p.changed_rows), mirror_rows.shape[1], len(p.changed_rows)
        else:
            num_changed, width, table_rows = 0, p.block_tables.shape[1], num_reqs
        if graph_size is not None:
            if num_tokens != num_reqs or graph_size < num_reqs or graph_size > self.graph_rows:
                raise ValueError(
                    f"a graph step takes one token per request and at most {self.graph_rows} rows, "
                    f"got {num_tokens} tokens, {num_reqs} requests, graph size {graph_size}"
                )
            offsets, end = self._graph_offsets, self._graph_head
        else:
            offsets, end = _head_offsets(num_tokens, num_reqs)
        logits_off = end
        end += aligned(8 * num_logits)
        changed_off = end
        end += aligned(8 * num_changed)
        table_off = end
        end += aligned(4 * table_rows * width)
        return _Layout(
            offsets=offsets,
            logits_off=logits_off,
            changed_off=changed_off,
            table_off=table_off,
            end=end,
            num_tokens=num_tokens,
            num_reqs=num_reqs,
            num_logits=num_logits,
            num_changed=num_changed,
            width=width,
            rows=graph_size if graph_size is not None else num_reqs,
            toks=graph_size if graph_size is not None else num_tokens,
            graph_size=graph_size,
        )

    def _write(
        self, buf: PackedBuffer, p: StepPlan, lay: _Layout, extra: np.ndarray, mirror_rows: np.ndarray | None
    ) -> None:
        """Writes the plan's arrays into the host side of `buf` (a graph step padded with inert rows)."""
        w, o, rows, toks = buf.write, lay.offsets, lay.rows, lay.toks
        v_ids = w(o["input_ids"], p.input_ids, np.int64, toks)
        v_pos = w(o["positions"], p.positions, np.int64, toks)
        v_slot = w(o["slot_mapping"], p.slot_mapping, np.int64, toks)
        v_len = w(o["seq_lens"], p.seq_lens, np.int32, rows)
        v_qsl = w(o["query_start_loc"], p.query_start_loc, np.int32, rows + 1)
        v_rows = None
        if mirror_rows is not None:
            v_rows = w(o["block_table_rows"], p.block_table_rows, np.int64, rows)
            if lay.num_changed:
                n, width = lay.num_changed, lay.width
                w(lay.changed_off, p.changed_rows, np.int64)
                host = buf.host_view(lay.table_off, np.int32, n * width)
                np.take(mirror_rows, p.changed_rows, axis=0, out=host.reshape(n, width))
        elif lay.num_reqs and lay.width:
            w(lay.table_off, p.block_tables, np.int32)
        if lay.graph_size is not None and lay.graph_size > lay.num_reqs:
            n = lay.num_reqs
            v_ids[n:] = 0
            v_pos[n:] = 0
            v_slot[n:] = -1
            v_len[n:] = 0
            v_qsl[n + 1 :] = self._arange[n + 1 : lay.graph_size + 1]
            if v_rows is not None:
                v_rows[n:] = 0
        if lay.num_logits:
            logits = p.logits_indices
            w(lay.logits_off, logits, np.int64)
            if len(extra):
                w(lay.logits_off + 8 * len(logits), extra, np.int64)

    def _inputs(
        self, buf: PackedBuffer, p: StepPlan, lay: _Layout, extra: np.ndarray, mirrored: bool
    ) -> StepInputs:
        """The device-side views of what `_write` packed."""
        v, o, t, rows, n_chg = buf.view, lay.offsets, lay.toks, lay.rows, lay.num_changed
        logits = p.logits_indices
        all_rows = (
            lay.num_logits == lay.num_tokens
            and lay.num_tokens > 0
            and not len(extra)
            and bool(np.array_equal(logits, self._arange[: lay.num_tokens]))
        )
        return StepInputs(
            input_ids=v(o["input_ids"], np.int64, t),
            positions=v(o["positions"], np.int64, t),
            slot_mapping=v(o["slot_mapping"], np.int64, t),
            query_start_loc=v(o["query_start_loc"], np.int32, rows + 1),
            seq_lens=v(o["seq_lens"], np.int32, rows),
            block_table_rows=v(o["block_table_rows"], np.int64, rows) if mirrored else None,
            changed_rows=v(lay.changed_off, np.int64, n_chg) if n_chg else None,
            changed_row_data=v(lay.table_off, np.int32, n_chg, lay.width) if n_chg else None,
            block_tables=None if mirrored else v(lay.table_off, np.int32, lay.num_reqs, lay.width),
            logits_indices=v(lay.logits_off, np.int64, lay.num_logits) if lay.num_logits else None,
            logits_are_all_rows=all_rows,
            graph_size=lay.graph_size,
        )
