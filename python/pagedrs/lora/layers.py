"""LoRA deltas on the base model's linear layers, for a batch that mixes adapters.

A `LoRALinear` is attached to one linear module as a forward hook: the base layer runs unchanged, then
every row gets `(x A^T) B^T * scaling` of its own adapter added to its slice of the output (PEFT's order:
base result first, then the delta). A packed layer (q|k|v, gate|up) holds one slice per HF module, so an
adapter that targets only q_proj changes only the q columns.

The adapters of all slots are stacked, in the manner of punica's segmented kernels (SGMV): a step groups
its rows by adapter into a padded [adapters, rows, in] batch (the layout is built once per step and
shared by every layer); each module then takes one gather, two batched matmuls, `x A^T` ("shrink") and
`B^T` ("expand", the scaling folded into B), a mask that zeroes the padding rows, and one gather back to
the rows' order added to its output (a base-model row reads a padding row: zeros). A packed module's
slices share the pair: their A's are stacked along the rank and B is block-diagonal over them. A slice's
rank is the largest resident for it (smaller ones padded with zeros). So a layer costs the same few ops
however many adapters the step mixes, and no row pays for another adapter's rank.

On a CPU (float32) every step takes one Rust call per layer instead (`_core.cpu_lora_add`, punica's BGMV:
each row shrinks and expands with its own slot's pair, consecutive rows of one slot in tiles sharing the
adapter's loads as SGMV's grouping does), the same arithmetic without the torch ops' per-call cost, the
padding and the gathers.

With `LoRABatch.use_kernels` (the executors set it where the model runner switched the layer kernels on:
the "cupy" attention backend, on CUDA) every step takes the CUDA pair of the same BGMV instead
(pagedrs.kernels.lora_ops: a shrink and an expand launch per layer, no gather, mask or scatter); the
torch ops stay the CPU path and the oracle the kernels are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from pagedrs import _core
from pagedrs.layers.kernel_switch import KERNEL_DTYPES
from pagedrs.layers.linear import RowParallelLinear

__all__ = ["CPU_KERNEL_MAX_ROWS", "LoRABatch", "LoRALinear", "LoRASlice"]

# Rows up to which a CPU step's deltas take the Rust kernel rather than the batched matmuls: every step,
# since it groups the rows by slot and tiles them. Measured on the 2-core AVX2 CI machine, 8 slots of two
# rank-8 slices over a 576 -> 3072 layer, 2 threads, kernel vs batched matmuls: rows interleaved over the
# slots (decodes) 7 vs 36 us at 1 row, 75 vs 125 at 32, 177 vs 378 at 128, 485 vs 2478 at 256, 2351 vs
# 5704 at 1024; rows in runs of one slot (prefill chunks) 446 vs 450 at 128, 1020 vs 1696 at 512, 2562 vs
# 5653 at 1024. The batched form stays for other devices and dtypes, and as the oracle (bench/lora.py runs
# it with this set to 0).
CPU_KERNEL_MAX_ROWS = 1 << 30


@dataclass
class LoRABatch:
    """This step's adapter slot of each token row (-1: the base model), or None when no row has one;
    `num_slots` is the number of slots (`max_loras`). `layout()` groups the rows by slot."""

    num_slots: int = 1
    slot_of_row: np.ndarray | None = None  # int64 [rows], on the host
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    use_kernels: bool = False  # the CUDA kernels of pagedrs.kernels.lora_ops (see the module docs)
    _layout: tuple[tuple[int, ...], Tensor, Tensor, Tensor] | None = None
    _slots_on_device: Tensor | None = None

    def set_rows(self, slot_of_row: np.ndarray | None) -> None:
        self.slot_of_row = slot_of_row
        self._layout = self._slots_on_device = None

    def slots_on_device(self) -> Tensor:
        """slot_of_row as int32 on the device, as the kernels take it (copied once a step)."""
        if self._slots_on_device is None:
            assert self.slot_of_row is not None
            self._slots_on_device = torch.from_numpy(self.slot_of_row.astype(np.int32)).to(self.device)
        return self._slots_on_device

    def layout(self) -> tuple[tuple[int, ...], Tensor, Tensor, Tensor]:
        """(the slots present; the gather index [slots x M] of the rows grouped by slot, each group padded
        to M; the padding mask [slots, M, 1], 1 for a real row; the back index [rows]: where each row's
        result is in that layout, a padding position (all zeros) for a base-model row), on the device.
        M is one more than the largest group, so a padding position always exists. Built on the host
        once a step, then shared by every layer."""
        if self._layout is None:
            rows = self.slot_of_row
            assert rows is not None
            present = sorted(set(np.unique(rows).tolist()) - {-1})
            groups = [np.flatnonzero(rows == s) for s in present]
            m = max(len(g) for g in groups) + 1
            index = np.zeros((len(present), m), dtype=np.int64)
            mask = np.zeros((len(present), m, 1), dtype=np.float32)
            back = np.full(len(rows), m - 1, dtype=np.int64)  # slot 0's last row: padding
            for i, g in enumerate(groups):
                index[i, : len(g)] = g
                mask[i, : len(g)] = 1.0
                back[g] = i * m + np.arange(len(g))
            dev = self.device
            self._layout = (
                tuple(present),
                torch.from_numpy(index.reshape(-1)).to(dev),
                torch.from_numpy(mask).to(dev),
                torch.from_numpy(back).to(dev),
            )
        return self._layout


@dataclass(frozen=True)
class _Stacked:
    """Every slot's adapter over all of a module's slices, in one pair (see `LoRALinear._stack`)."""

    first: int  # first output column
    width: int
    a: Tensor  # [slots, sum R, in]
    b: Tensor  # B * scaling, [slots, width, sum R]
    cols: np.ndarray  # int64 [sum R, 2]: each rank row's output columns [start, end) within 0..width


@dataclass(frozen=True)
class LoRASlice:
    """Columns [offset, offset + size) of a layer's output that one HF module owns (the q columns of a
    fused qkv_proj; the whole output of an unfused layer)."""

    offset: int
    size: int


class LoRALinear:
    """The LoRA weights of the resident adapters for one linear module, and the hook that adds them."""

    def __init__(self, module: torch.nn.Module, batch: LoRABatch) -> None:
        self.batch = batch
        # slot -> [(slice, A [r, in], B [size, r], scaling)]
        self.weights: dict[int, list[tuple[LoRASlice, Tensor, Tensor, float]]] = {}
        # every slot's adapter over all slices (see _stack), and that cut to the slots of the last step's
        # layout (the next step usually has the same)
        self._stacked: _Stacked | None = None
        self._cut: tuple[tuple[int, ...], tuple[int, int, Tensor, Tensor]] | None = None
        self._kernel: tuple[int, np.ndarray, np.ndarray, np.ndarray] | None = None  # see _kernel_pair
        self._device_kernel: tuple[int, Tensor, Tensor, Tensor] | None = None  # see _device_pair
        # A row-parallel layer over several ranks adds its rank's partial delta before the all-reduce
        # (which sums the deltas with the products); any other layer adds the delta to its output.
        self._partial: RowParallelLinear | None = None
        self._handle: RemovableHandle | None = None
        if isinstance(module, RowParallelLinear) and module.tp_size > 1:
            self._partial = module
            module.partial_hooks.append(self._partial_hook)
        else:
            self._handle = module.register_forward_hook(self._hook)

    def set_slot(self, slot: int, pieces: list[tuple[LoRASlice, Tensor, Tensor, float]]) -> None:
        if pieces:
            self.weights[slot] = pieces
        else:
            self.weights.pop(slot, None)
        self._stacked = self._cut = self._kernel = self._device_kernel = None

    def clear_slot(self, slot: int) -> None:
        self.weights.pop(slot, None)
        self._stacked = self._cut = self._kernel = self._device_kernel = None

    def remove(self) -> None:
        if self._partial is not None:
            self._partial.partial_hooks.remove(self._partial_hook)
        if self._handle is not None:
            self._handle.remove()

    def _partial_hook(self, x: Tensor, out: Tensor) -> None:
        assert self._partial is not None
        self._hook(self._partial, (x,), out)

    def _stack(self) -> _Stacked:
        """Every slot's adapter, all of this module's slices in one pair (rebuilt after a slot changed):
        A [slots, sum R, in] and B * scaling [slots, width, sum R] from the first output column on. Slice j
        takes rank rows [o_j, o_j + R_j) of A and the same columns of B, at its own output rows, so B is
        block-diagonal over the slices and one shrink and one expand serve the whole module."""
        by_slice: dict[LoRASlice, list[tuple[int, Tensor, Tensor, float]]] = {}
        for slot, pieces in self.weights.items():
            for sl, a, b, scaling in pieces:
                by_slice.setdefault(sl, []).append((slot, a, b, scaling))
        first = min(sl.offset for sl in by_slice)
        width = max(sl.offset + sl.size for sl in by_slice) - first
        ranks = {sl: max(a.shape[0] for _, a, _, _ in items) for sl, items in by_slice.items()}
        some_a = next(iter(by_slice.values()))[0][1]
        n = self.batch.num_slots
        a_all = some_a.new_zeros(n, sum(ranks.values()), some_a.shape[1])
        b_all = some_a.new_zeros(n, width, sum(ranks.values()))
        at = 0
        cols = np.zeros((sum(ranks.values()), 2), dtype=np.int64)  # each rank row's output columns
        for sl, items in by_slice.items():
            rows = slice(sl.offset - first, sl.offset - first + sl.size)
            for slot, a, b, scaling in items:
                r = a.shape[0]
                a_all[slot, at : at + r] = a
                b_all[slot, rows, at : at + r] = b * scaling
            cols[at : at + ranks[sl]] = (rows.start, rows.stop)
            at += ranks[sl]
        return _Stacked(first, width, a_all, b_all, cols)

    def _stacked_pair(self) -> _Stacked:
        if self._stacked is None:
            self._stacked = self._stack()
        return self._stacked

    def _kernel_pair(self) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
        """(first column, A [slots, sum R, in], B^T [slots, sum R, width], each rank row's output columns
        [sum R, 2]) of every slot, as the CPU kernel takes them (numpy views, made once after a slot
        changed): a rank row of one slice expands only into that slice's columns."""
        if self._kernel is None:
            st = self._stacked_pair()
            bt = st.b.transpose(1, 2).contiguous().numpy()
            self._kernel = (st.first, st.a.contiguous().numpy(), bt, st.cols)
        return self._kernel

    def _device_pair(self) -> tuple[int, Tensor, Tensor, Tensor]:
        """(first column, A [slots, sum R, in], B^T [slots, sum R, width], each rank row's output columns
        int32 [sum R, 2]) of every slot on the device, as the CUDA kernels take them (made once after a
        slot changed)."""
        if self._device_kernel is None:
            st = self._stacked_pair()
            bt = st.b.transpose(1, 2).contiguous()
            cols = torch.from_numpy(st.cols.astype(np.int32)).to(st.a.device)
            self._device_kernel = (st.first, st.a.contiguous(), bt, cols)
        return self._device_kernel

    def _pieces(self, present: tuple[int, ...]) -> tuple[int, int, Tensor, Tensor]:
        """(first column, width, A^T [present, in, sum R], B^T [present, sum R, width]) of the slots present."""
        if self._cut is None or self._cut[0] != present:
            st = self._stacked_pair()
            pick = list(present)
            a_t, b_t = st.a[pick].transpose(1, 2).contiguous(), st.b[pick].transpose(1, 2).contiguous()
            cut = (st.first, st.width, a_t, b_t)
            self._cut = (present, cut)
        return self._cut[1]

    def _kernels_fit(self, x: Tensor, out: Tensor) -> bool:
        """The CUDA kernels are on and take these: 2-d rows with a contiguous last dim, in the adapters'
        dtype (a kernel dtype) and on their device."""
        if not self.batch.use_kernels:
            return False
        a = self._stacked_pair().a
        return (
            x.dim() == 2
            and out.dim() == 2
            and x.stride(1) == 1
            and out.stride(1) == 1
            and x.dtype == out.dtype == a.dtype
            and a.dtype in KERNEL_DTYPES
            and x.device == out.device == a.device
        )

    def _hook(self, module: torch.nn.Module, args: tuple, out: Tensor) -> Tensor:
        rows = self.batch.slot_of_row
        if not self.weights or rows is None:
            return out
        x = args[0]
        if self._kernels_fit(x, out):
            from pagedrs.kernels.lora_ops import lora_add

            first, a, bt, cols = self._device_pair()
            lora_add(x, a, bt, self.batch.slots_on_device(), cols, out, first)
            return out
        if (
            x.device.type == "cpu"
            and x.dim() == 2
            and out.dim() == 2
            and x.shape[0] <= CPU_KERNEL_MAX_ROWS
            and x.dtype == out.dtype == torch.float32
            and x.is_contiguous()
            and out.is_contiguous()
        ):
            first, a_np, bt_np, cols_np = self._kernel_pair()
            threads = torch.get_num_threads()
            _core.cpu_lora_add(x.numpy(), a_np, bt_np, rows, out.numpy(), first, threads, cols_np)
            return out
        if not (rows >= 0).any():
            return out
        present, gather, mask, back = self.batch.layout()
        first, width, a_t, b_t = self._pieces(present)
        xs = x.index_select(0, gather).view(len(present), -1, x.shape[-1])  # [slots, M, in]
        shrunk = torch.bmm(xs, a_t).mul_(mask)  # [slots, M, sum R], padding rows zeroed
        delta = torch.bmm(shrunk, b_t).view(-1, width)  # [slots x M, width]
        out.narrow(-1, first, width).add_(delta.index_select(0, back))
        return out
