"""The LoRA kernels of cuda/lora_ops.cu (punica's BGMV shrink and expand), run by the CPU emulator, against a
per-row float64 reference: three slots, two packed slices with their own rank rows and column ranges, rows
of the base model between adapter rows; then the LoRA hook of a linear layer with the kernels on, against
its torch path (kernels off), and a tiny model serving two adapters and the base model in one batch."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from pagedrs.config import LoRAConfig
from pagedrs.kernels import lora_ops
from pagedrs.kernels._loader import CTYPES, lora_op_names
from pagedrs.loader import load_model
from pagedrs.lora import layers
from pagedrs.lora.adapter import load_peft_adapter
from pagedrs.lora.layers import LoRABatch, LoRALinear, LoRASlice
from pagedrs.lora.manager import LoRASlots
from tests.helpers import make_tiny_llama
from tests.kernels.emu.emulator import needs_emulator, recording_kernels
from tests.lora.helpers_lora import make_peft_adapter
from tests.models.paged_harness import MIXED_STEPS, PagedHarness, assert_steps_close

pytestmark = needs_emulator

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SLOTS, IN = 3, 40
# Two slices of one module: rank rows 0..3 expand into columns 0..12 of the module, rows 4..6 into 12..24
# (a 16-byte vector of 16-bit columns straddles them).
COLS = [(0, 12)] * 4 + [(12, 24)] * 3
RANK, WIDTH, FIRST, OUT = len(COLS), 24, 8, 40
ROWS = [2, -1, 0, 1, 2, 2, 0, -1, 1]


@pytest.fixture(scope="module")
def launched() -> Iterator[list[str]]:
    names = [n for ctype in CTYPES.values() for n in lora_op_names(ctype)]
    with recording_kernels(names) as seen:
        yield seen


def _randn(*shape: int, seed: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).mul_(scale).to(dtype)


def _case(dtype: torch.dtype, *, x_pad: int = 0) -> tuple[torch.Tensor, ...]:
    """(x [rows, IN] (a view of token stride IN + x_pad), A, Bt (random outside the column ranges too),
    slot_of_row int32, cols int32, out [rows, OUT])."""
    rows = len(ROWS)
    x = _randn(rows, IN + x_pad, seed=1, dtype=dtype)[:, :IN]
    a = _randn(SLOTS, RANK, IN, seed=2, dtype=dtype, scale=0.5)
    bt = _randn(SLOTS, RANK, WIDTH, seed=3, dtype=dtype, scale=0.5)
    out = _randn(rows, OUT, seed=4, dtype=dtype)
    slots = torch.tensor(ROWS, dtype=torch.int32)
    cols = torch.tensor(COLS, dtype=torch.int32)
    return x, a, bt, slots, cols, out


def _reference(
    x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, out: torch.Tensor, first: int = FIRST
) -> torch.Tensor:
    """out + each row's delta in float64, each rank row expanding only into its columns."""
    ref = out.double().clone()
    for i, slot in enumerate(ROWS):
        if slot < 0:
            continue
        t = a[slot].double() @ x[i].double()
        for k, (c0, c1) in enumerate(COLS):
            ref[i, first + c0 : first + c1] += t[k] * bt[slot, k, c0:c1].double()
    return ref


def _assert_rounded(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """float32 within 1e-5 of the float64 value; a 16-bit result is that value rounded once, or a neighbour
    of it (where the fp32 sums flip a rounding): within one unit in the last place, at most eps * |x|."""
    if got.dtype == torch.float32:
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5, msg=what)
        return
    eps = torch.finfo(got.dtype).eps
    torch.testing.assert_close(got.double(), ref.to(got.dtype).double(), rtol=eps, atol=1e-30, msg=what)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("x_pad", [0, 3])
def test_lora_add_matches_a_per_row_reference(launched: list[str], dtype: torch.dtype, x_pad: int) -> None:
    x, a, bt, slots, cols, out = _case(dtype, x_pad=x_pad)
    before = out.clone()
    ref = _reference(x, a, bt, out)
    del launched[:]
    lora_ops.lora_add(x, a, bt, slots, cols, out, FIRST)
    ctype = CTYPES[str(dtype).removeprefix("torch.")]
    vec = 4 if dtype == torch.float32 else 8
    shrink_vec = 1 if x_pad else vec  # a token stride of IN + 3 allows no 16-byte vectors
    assert launched == [
        f"pagedrs::lora_shrink<{ctype}, {shrink_vec}>",
        f"pagedrs::lora_expand<{ctype}, {vec}>",
    ]
    _assert_rounded(out, ref, f"lora_add {dtype}")
    base = torch.tensor(ROWS) < 0
    assert torch.equal(out[base], before[base])  # base-model rows keep their bits
    assert torch.equal(out[:, :FIRST], before[:, :FIRST])  # columns outside the module's
    assert torch.equal(out[:, FIRST + WIDTH :], before[:, FIRST + WIDTH :])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_scalar_expand_at_an_unaligned_first_column(launched: list[str], dtype: torch.dtype) -> None:
    x, a, bt, slots, cols, out = _case(dtype)
    first = FIRST + 1  # no 16-byte vectors along the output row
    ref = _reference(x, a, bt, out, first)
    del launched[:]
    lora_ops.lora_add(x, a, bt, slots, cols, out, first)
    assert launched[1].endswith(", 1>")
    _assert_rounded(out, ref, f"lora_add first={first}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_gets_the_same_bits_alone_or_in_a_batch(dtype: torch.dtype, launched: list[str]) -> None:
    x, a, bt, slots, cols, out = _case(dtype)
    full = out.clone()
    lora_ops.lora_add(x, a, bt, slots, cols, full, FIRST)
    for i in range(len(ROWS)):
        alone = out[i : i + 1].clone()
        lora_ops.lora_add(x[i : i + 1], a, bt, slots[i : i + 1], cols, alone, FIRST)
        assert torch.equal(alone, full[i : i + 1]), f"row {i}"


def test_shrink_and_expand_alone(launched: list[str]) -> None:
    x, a, bt, slots, cols, out = _case(torch.float32)
    s = lora_ops.lora_shrink(x, a, slots)
    assert s.shape == (len(ROWS), RANK) and s.dtype == torch.float32
    for i, slot in enumerate(ROWS):
        if slot >= 0:
            torch.testing.assert_close(s[i].double(), a[slot].double() @ x[i].double(), rtol=1e-5, atol=1e-5)
    ref = _reference(x, a, bt, out)
    lora_ops.lora_expand(s, bt, slots, cols, out, FIRST)
    _assert_rounded(out, ref, "shrink + expand")


def test_bad_arguments_are_value_errors() -> None:
    x, a, bt, slots, cols, out = _case(torch.float32)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        lora_ops.lora_shrink(x.double(), a.double(), slots)
    with pytest.raises(ValueError, match="a dtype torch.float16 != torch.float32"):
        lora_ops.lora_shrink(x, a.half(), slots)
    with pytest.raises(ValueError, match=f"a must have {IN} as its last dim"):
        lora_ops.lora_shrink(x, a[:, :, :8].contiguous(), slots)
    with pytest.raises(ValueError, match="a must be contiguous"):
        lora_ops.lora_shrink(x, a.transpose(1, 2), slots)
    with pytest.raises(ValueError, match=r"slot_of_row must be contiguous int32 \[9\]"):
        lora_ops.lora_shrink(x, a, slots.long())
    with pytest.raises(ValueError, match=r"slot_of_row must be contiguous int32 \[9\]"):
        lora_ops.lora_shrink(x, a, slots[:4])
    with pytest.raises(ValueError, match="x must be 2-d"):
        lora_ops.lora_shrink(x.t(), a, slots)
    s = torch.zeros(len(ROWS), RANK)
    with pytest.raises(ValueError, match=r"cols must be contiguous int32 \[7, 2\]"):
        lora_ops.lora_expand(s, bt, slots, cols.long(), out, FIRST)
    with pytest.raises(ValueError, match=r"s must be contiguous float32 \[9, 7\]"):
        lora_ops.lora_expand(s.half(), bt, slots, cols, out, FIRST)
    with pytest.raises(ValueError, match=f"columns 17..41 are outside out's {OUT}"):
        lora_ops.lora_expand(s, bt, slots, cols, out, 17)
    with pytest.raises(ValueError, match="columns -1..23"):
        lora_ops.lora_expand(s, bt, slots, cols, out, -1)
    with pytest.raises(ValueError, match="bt dtype torch.bfloat16 != torch.float32"):
        lora_ops.lora_expand(s, bt.bfloat16(), slots, cols, out, FIRST)
    with pytest.raises(ValueError, match="must be .slots, rank, n. alike"):
        lora_ops.lora_add(x, a, bt[:2], slots, cols, out, FIRST)
    with pytest.raises(ValueError, match="out dtype torch.float16 != x dtype torch.float32"):
        lora_ops.lora_add(x, a, bt, slots, cols, out.half(), FIRST)
    with pytest.raises(ValueError, match="out has 8 rows, x 9"):
        lora_ops.lora_add(x, a, bt, slots, cols, out[:8], FIRST)
    with pytest.raises(ValueError, match="is on meta, expected cpu"):
        lora_ops.lora_shrink(x, a, slots.to("meta"))


# ---- the hook --------------------------------------------------------------------------------------
# q|k|v-like slices of one fused layer, each with its own rank per slot (rank 0: the slot leaves it alone)
SLICES = [LoRASlice(0, 8), LoRASlice(8, 8), LoRASlice(16, 8)]
RANKS = {0: (4, 2, 0), 1: (3, 0, 5), 2: (6, 6, 6)}
HOOK_OUT = 24


def _lora_layer(dtype: torch.dtype) -> tuple[torch.nn.Linear, LoRABatch, LoRALinear]:
    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(IN, HOOK_OUT, bias=False).to(dtype)
    batch = LoRABatch(num_slots=3)
    lora = LoRALinear(lin, batch)
    for slot, ranks in RANKS.items():
        pieces = [
            (
                sl,
                torch.randn(r, IN, generator=g).to(dtype),
                torch.randn(sl.size, r, generator=g).to(dtype),
                0.5,
            )
            for sl, r in zip(SLICES, ranks, strict=True)
            if r
        ]
        lora.set_slot(slot, pieces)
    return lin, batch, lora


@pytest.mark.parametrize("dtype", DTYPES)
def test_hook_with_kernels_equals_the_torch_path(
    launched: list[str], dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batched matmuls (torch) with kernels off, the kernel pair with them on; float32 to the last
    bits, 16-bit within the torch path's extra roundings (its shrink and expand each round to the dtype)."""
    monkeypatch.setattr(layers, "CPU_KERNEL_MAX_ROWS", 0)  # the torch ops, not the Rust kernel
    lin, batch, lora = _lora_layer(dtype)
    x = _randn(len(ROWS), IN, seed=5, dtype=dtype)
    batch.set_rows(np.array(ROWS, dtype=np.int64))
    del launched[:]
    with torch.inference_mode():
        want = lin(x)
        assert launched == []
        batch.use_kernels = True
        got = lin(x)
    assert [n.split("<")[0] for n in launched] == ["pagedrs::lora_shrink", "pagedrs::lora_expand"]
    base = torch.tensor(ROWS) < 0
    assert torch.equal(got[base], want[base])
    tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * 8)
    # after a slot changes, the kernels read the new weights
    lora.clear_slot(2)
    batch.use_kernels = False
    with torch.inference_mode():
        want = lin(x)
        batch.use_kernels = True
        got = lin(x)
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * 8)


def test_hook_falls_back_to_torch_for_inputs_the_kernels_do_not_take(launched: list[str]) -> None:
    """A float64 layer (no kernel dtype) keeps the torch path with the kernels on."""
    lin, batch, _ = _lora_layer(torch.float64)
    batch.use_kernels = True
    batch.set_rows(np.array(ROWS, dtype=np.int64))
    del launched[:]
    with torch.inference_mode():
        lin(_randn(len(ROWS), IN, seed=6, dtype=torch.float64))
    assert launched == []


def test_tiny_model_with_lora_kernels_matches_torch_path(launched: list[str], tmp_path: Path) -> None:
    """float32 Llama, two adapters (every projection at rank 8; q and v only at rank 4, so q|k|v has
    slices of different ranks and an empty one) and the base model mixed in each step of MIXED_STEPS
    (chunked prefill, decodes): every step's logits agree with the kernels on and off."""
    base = make_tiny_llama(tmp_path, "llama")
    paths = [
        make_peft_adapter(base, tmp_path / "all", seed=1, r=8),
        make_peft_adapter(base, tmp_path / "qv", seed=2, r=4, target_modules=("q_proj", "v_proj")),
    ]
    model = load_model(str(base)).model
    slots = LoRASlots(model, LoRAConfig(max_loras=2, max_lora_rank=8), torch.device("cpu"))
    for slot, path in enumerate(paths):
        slots.load(slot, load_peft_adapter(str(path), max_lora_rank=8))
    slot_of_request = {0: 0, 1: -1, 2: 1}
    runs = []
    for kernels in (False, True):
        slots.batch.use_kernels = kernels
        harness = PagedHarness(model, num_blocks=32, block_size=4, seed=1)
        del launched[:]
        steps = []
        for chunks in MIXED_STEPS:
            rows = [slot_of_request[rid] for rid, toks in chunks.items() for _ in toks]
            slots.batch.set_rows(np.array(rows, dtype=np.int64))
            steps.append(harness.step(chunks))
        # a shrink and an expand per LoRA layer (q|k|v, o, gate|up, down of each layer) per step
        assert len(launched) == (2 * 4 * model.num_layers * len(MIXED_STEPS) if kernels else 0)
        runs.append(steps)
    assert_steps_close(*runs, same_argmax=True)
