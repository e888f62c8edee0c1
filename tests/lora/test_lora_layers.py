"""The LoRA layer hook's two CPU forms against a plain per-row reference: the Rust kernel (every CPU step,
up to `CPU_KERNEL_MAX_ROWS` rows) and the batched matmuls (the oracle, and other devices), with packed
slices of different ranks, rows of the base model between adapter rows, and slots that change."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedrs import _core
from pagedrs.lora import layers
from pagedrs.lora.layers import LoRABatch, LoRALinear, LoRASlice

IN, OUT = 40, 24
# q|k|v-like slices of one fused layer, each with its own rank per slot (rank 0: the slot leaves it alone)
SLICES = [LoRASlice(0, 8), LoRASlice(8, 8), LoRASlice(16, 8)]
RANKS = {0: (4, 2, 0), 1: (3, 0, 5), 2: (6, 6, 6)}


def _layer(seed: int = 0) -> tuple[torch.nn.Linear, LoRABatch, LoRALinear, dict]:
    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(IN, OUT, bias=False)
    batch = LoRABatch(num_slots=3)
    lora = LoRALinear(lin, batch)
    weights = {}
    for slot, ranks in RANKS.items():
        pieces = [
            (sl, torch.randn(r, IN, generator=g), torch.randn(sl.size, r, generator=g), 0.5 + slot)
            for sl, r in zip(SLICES, ranks, strict=True)
            if r
        ]
        lora.set_slot(slot, pieces)
        weights[slot] = pieces
    return lin, batch, lora, weights


def _reference(x: torch.Tensor, rows: np.ndarray, weights: dict) -> torch.Tensor:
    out = torch.zeros(x.shape[0], OUT, dtype=torch.float64)
    for i, slot in enumerate(rows.tolist()):
        for sl, a, b, scaling in weights.get(slot, []):
            t = a.double() @ x[i].double()
            out[i, sl.offset : sl.offset + sl.size] += (b.double() @ t) * scaling
    return out


@pytest.mark.parametrize("m", [1, 5, 17, 130])
@pytest.mark.parametrize("form", ["kernel", "bmm"])
@pytest.mark.parametrize("layout", ["turns", "runs"])
def test_both_cpu_forms_match_a_per_row_reference(
    m: int, form: str, layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(layers, "CPU_KERNEL_MAX_ROWS", 1 << 20 if form == "kernel" else 0)
    lin, batch, lora, weights = _layer()
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, IN, generator=g)
    if layout == "turns":  # -1 (base), 0, 1, 2 in turn (decodes)
        rows = np.array([(i % 4) - 1 for i in range(m)], dtype=np.int64)
    else:  # runs of one slot, of uneven lengths (prefill chunks of several requests)
        rows = np.array([((i // 6 + i // 17) % 4) - 1 for i in range(m)], dtype=np.int64)
    batch.set_rows(rows)
    base = (x @ lin.weight.T).detach()  # the layer without its hook
    with torch.inference_mode():
        got = lin(x)
    want = base.double() + _reference(x, rows, weights)
    # float32 sums of terms up to the largest output: a cancelling output keeps their absolute error
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 + 1e-6 * float(want.abs().max()))
    assert torch.equal(got[rows == -1], base[rows == -1])  # base-model rows untouched


def test_kernel_rows_do_not_depend_on_the_batch_and_follow_slot_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A row gets the same bits alone or in a batch (greedy speculative decoding and the fast decode path
    rely on it); after a slot is cleared and set again, the new weights are used."""
    monkeypatch.setattr(layers, "CPU_KERNEL_MAX_ROWS", 1 << 20)
    lin, batch, lora, weights = _layer()
    x = torch.randn(9, IN, generator=torch.Generator().manual_seed(3))
    rows = np.array([2, -1, 0, 1, 2, 2, 0, -1, 1], dtype=np.int64)

    def deltas(xs: torch.Tensor, slots: np.ndarray) -> torch.Tensor:
        batch.set_rows(slots)
        return lora._hook(lin, (xs,), torch.zeros(xs.shape[0], OUT))  # the hook alone, on zeros

    full = deltas(x, rows)
    for i in range(9):
        assert torch.equal(deltas(x[i : i + 1], rows[i : i + 1]), full[i : i + 1]), f"row {i}"
    lora.clear_slot(2)
    g = torch.Generator().manual_seed(9)
    new = [(SLICES[1], torch.randn(2, IN, generator=g), torch.randn(8, 2, generator=g), 1.0)]
    lora.set_slot(2, new)
    want = _reference(x, rows, {**weights, 2: new})
    torch.testing.assert_close(deltas(x, rows).double(), want, rtol=1e-5, atol=1e-5)


def test_kernel_refuses_bad_arguments() -> None:
    x = np.zeros((2, 4), np.float32)
    a, bt = np.zeros((2, 3, 4), np.float32), np.zeros((2, 3, 5), np.float32)
    out = np.zeros((2, 5), np.float32)
    with pytest.raises(ValueError, match=r"ids\[1\] = 2 is outside 0\.\.2"):
        _core.cpu_lora_add(x, a, bt, np.array([0, 2], np.int64), out)
    with pytest.raises(ValueError, match="bt"):
        _core.cpu_lora_add(x, a, np.zeros((2, 2, 5), np.float32), np.array([0, -1], np.int64), out)
    with pytest.raises(ValueError, match="columns 1"):
        _core.cpu_lora_add(x, a, bt, np.array([0, -1], np.int64), out, col0=1)
    bad_cols = np.array([[0, 5], [2, 6], [0, 1]], np.int64)
    with pytest.raises(ValueError, match=r"cols\[1\] = 2\.\.6 is not a column range within 0\.\.5"):
        _core.cpu_lora_add(x, a, bt, np.array([0, -1], np.int64), out, cols=bad_cols)
