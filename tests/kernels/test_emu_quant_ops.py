"""The GPTQ and AWQ dequantization kernels of cuda/quant_ops.cu, run by the CPU emulator, against the
loader's reference dequantizers (pagedrs.quantization.dequant): random packed words (every bit pattern,
so every value and zero point occurs), GPTQ at 2/4/8 bits with grouped, act-order and per-channel
layouts and both zero-point conventions, AWQ grouped and per-channel; float32 results equal the reference
exactly, 16-bit ones equal it rounded to the dtype."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from pagedrs.kernels import quant_ops
from pagedrs.kernels._loader import CTYPES, quant_op_names
from pagedrs.quantization import dequant as reference
from pagedrs.quantization.config import QuantConfig
from tests.kernels.emu.emulator import needs_emulator, recording_kernels

pytestmark = needs_emulator

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(scope="module")
def launched() -> Iterator[list[str]]:
    """Runs kernels on the emulator; yields the list of kernel names launched (appended as they run)."""
    names = [n for ctype in CTYPES.values() for n in quant_op_names(ctype)]
    with recording_kernels(names) as seen:
        yield seen


def _words(*shape: int, seed: int) -> torch.Tensor:
    """Random int32 words: every bit pattern, so every packed value and zero point."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**31), 2**31, shape, generator=g, dtype=torch.int64).to(torch.int32)


def _scales(groups: int, out: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(groups, out, generator=g).mul_(0.05).to(dtype)


def _gptq_parts(
    in_features: int, out: int, bits: int, group_size: int, *, act_order: bool, scale_dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    k = 32 // bits
    group = in_features if group_size == -1 else group_size
    groups = -(-in_features // group)
    g_idx = torch.arange(in_features, dtype=torch.int32) // group
    if act_order:
        g_idx = g_idx[torch.randperm(in_features, generator=torch.Generator().manual_seed(bits))]
    return {
        "qweight": _words(in_features // k, out, seed=bits),
        "qzeros": _words(groups, -(-out // k), seed=bits + 1),
        "scales": _scales(groups, out, scale_dtype, seed=bits + 2),
        "g_idx": g_idx,
    }


def _gptq(parts: dict[str, torch.Tensor], bits: int, zero_plus_one: bool, **kw: Any) -> torch.Tensor:
    return quant_ops.dequantize_gptq(
        parts["qweight"],
        parts["qzeros"],
        parts["scales"],
        parts["g_idx"],
        bits=bits,
        zero_plus_one=zero_plus_one,
        **kw,
    )


def _gptq_ref(
    parts: dict[str, torch.Tensor], bits: int, group_size: int, zero_plus_one: bool
) -> torch.Tensor:
    cfg = QuantConfig("gptq", bits=bits, group_size=group_size, zero_plus_one=zero_plus_one)
    return reference.dequantize_gptq("layer", parts, cfg).t()


def _assert_matches(ours: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """float32: exactly the reference; 16-bit: the reference rounded once to the dtype."""
    assert ours.dtype == dtype and ours.shape == ref.shape and ours.is_contiguous()
    expected = ref.to(dtype)
    assert torch.equal(ours, expected), f"{(ours != expected).sum()} of {ours.numel()} values differ"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("zero_plus_one", [True, False])
@pytest.mark.parametrize(
    ("in_features", "group_size", "act_order"), [(128, 32, False), (96, 64, True), (64, -1, False)]
)
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_gptq_equals_reference(
    launched: list[str],
    bits: int,
    in_features: int,
    group_size: int,
    act_order: bool,
    zero_plus_one: bool,
    dtype: torch.dtype,
) -> None:
    # 36 columns: not a multiple of 8 or 16, so the last qzeros word of a row is partly padding
    parts = _gptq_parts(in_features, 36, bits, group_size, act_order=act_order, scale_dtype=dtype)
    del launched[:]
    ours = _gptq(parts, bits, zero_plus_one)
    ctype = CTYPES[str(dtype).removeprefix("torch.")]
    assert launched == [f"pagedrs::dequantize_gptq<{ctype}, {ctype}, {bits}>"]
    _assert_matches(ours, _gptq_ref(parts, bits, group_size, zero_plus_one), dtype)


@pytest.mark.parametrize(
    ("scale_dtype", "dtype"),
    [(torch.float16, torch.bfloat16), (torch.float16, torch.float32), (torch.bfloat16, torch.float16)],
)
def test_scales_and_output_dtypes_are_independent(
    launched: list[str], scale_dtype: torch.dtype, dtype: torch.dtype
) -> None:
    """fp16 checkpoint scales into a bf16 model: no lossy cast of the scales first."""
    parts = _gptq_parts(64, 40, 4, 32, act_order=False, scale_dtype=scale_dtype)
    ref = _gptq_ref(parts, 4, 32, True)
    _assert_matches(_gptq(parts, 4, True, dtype=dtype), ref, dtype)
    awq = _awq_parts(32, 40, 16, scale_dtype=scale_dtype)
    awq_ref = _awq_ref(awq, 16)
    _assert_matches(quant_ops.dequantize_awq(*awq, group_size=16, dtype=dtype), awq_ref, dtype)


def test_gptq_wide_output_and_word_rows_past_the_grid(
    launched: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """More columns than one CTA takes, and more word rows than the grid's y extent (the kernel loops)."""
    monkeypatch.setattr(quant_ops, "_MAX_GRID_Y", 3)
    parts = _gptq_parts(64, 300, 8, 16, act_order=True, scale_dtype=torch.float16)
    _assert_matches(
        _gptq(parts, 8, False, dtype=torch.float32), _gptq_ref(parts, 8, 16, False), torch.float32
    )


def _awq_parts(
    in_features: int, out: int, group_size: int, *, scale_dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups = 1 if group_size == -1 else -(-in_features // group_size)
    return (
        _words(in_features, out // 8, seed=seed),
        _words(groups, out // 8, seed=seed + 1),
        _scales(groups, out, scale_dtype, seed=seed + 2),
    )


def _awq_ref(parts: tuple[torch.Tensor, torch.Tensor, torch.Tensor], group_size: int) -> torch.Tensor:
    qweight, qzeros, scales = parts
    cfg = QuantConfig("awq", bits=4, group_size=group_size)
    named = {"qweight": qweight, "qzeros": qzeros, "scales": scales}
    return reference.dequantize_awq("layer", named, cfg).t()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("in_features", "out", "group_size"), [(64, 48, 32), (40, 16, 16), (24, 40, -1)])
def test_awq_equals_reference(
    launched: list[str], dtype: torch.dtype, in_features: int, out: int, group_size: int
) -> None:
    parts = _awq_parts(in_features, out, group_size, scale_dtype=dtype, seed=in_features)
    del launched[:]
    ours = quant_ops.dequantize_awq(*parts, group_size=group_size)
    ctype = CTYPES[str(dtype).removeprefix("torch.")]
    assert launched == [f"pagedrs::dequantize_awq<{ctype}, {ctype}>"]
    _assert_matches(ours, _awq_ref(parts, group_size), dtype)


def test_awq_wide_output_and_rows_past_the_grid(launched: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quant_ops, "_MAX_GRID_Y", 5)
    parts = _awq_parts(24, 8 * 300, 8, scale_dtype=torch.float16, seed=7)
    _assert_matches(quant_ops.dequantize_awq(*parts, group_size=8), _awq_ref(parts, 8), torch.float16)


def test_into_a_scratch_buffer(launched: list[str]) -> None:
    """`out`: a view at the start of a larger scratch buffer is written in place and returned."""
    scratch = torch.full((4096,), float("nan"), dtype=torch.bfloat16)
    parts = _gptq_parts(32, 24, 4, -1, act_order=False, scale_dtype=torch.float16)
    out = scratch[: 32 * 24].view(32, 24)
    assert _gptq(parts, 4, True, out=out) is out
    _assert_matches(out, _gptq_ref(parts, 4, -1, True), torch.bfloat16)
    assert scratch[32 * 24 :].isnan().all()
    awq = _awq_parts(16, 32, -1, scale_dtype=torch.float16)
    out = scratch[: 16 * 32].view(16, 32)
    assert quant_ops.dequantize_awq(*awq, group_size=-1, out=out) is out
    _assert_matches(out, _awq_ref(awq, -1), torch.bfloat16)


def test_empty_layers_launch_nothing(launched: list[str]) -> None:
    del launched[:]
    parts = _gptq_parts(64, 0, 4, 32, act_order=False, scale_dtype=torch.float16)
    assert _gptq(parts, 4, True).shape == (64, 0)
    awq = _awq_parts(0, 16, -1, scale_dtype=torch.float16)
    assert quant_ops.dequantize_awq(*awq, group_size=-1).shape == (0, 16)
    assert launched == []


def test_every_gptq_bit_width_is_instantiated() -> None:
    for ctype in CTYPES.values():
        names = quant_op_names(ctype)
        for scale_ctype in CTYPES.values():
            assert f"pagedrs::dequantize_awq<{ctype}, {scale_ctype}>" in names
            for bits in quant_ops.GPTQ_BITS:
                assert f"pagedrs::dequantize_gptq<{ctype}, {scale_ctype}, {bits}>" in names
        assert len(names) == len(CTYPES) * (len(quant_ops.GPTQ_BITS) + 1)


def _gptq_bad(**changes: Any) -> None:
    parts = _gptq_parts(64, 16, 4, 32, act_order=False, scale_dtype=torch.float16)
    kw: dict[str, Any] = {"bits": 4, "zero_plus_one": True}
    kw.update({k: v for k, v in changes.items() if k in ("bits", "zero_plus_one", "dtype", "out")})
    parts.update({k: v for k, v in changes.items() if k in parts})
    quant_ops.dequantize_gptq(parts["qweight"], parts["qzeros"], parts["scales"], parts["g_idx"], **kw)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"bits": 3}, "bits must be one of .* got 3"),
        (
            {"qweight": torch.zeros(8, 16, dtype=torch.int64)},
            "qweight must be a 2-d int32 tensor, got 2-d torch.int64",
        ),
        ({"qweight": torch.zeros(8, 32, dtype=torch.int32)[:, ::2]}, "qweight must be contiguous"),
        ({"qzeros": torch.zeros(2, 3, dtype=torch.int32)}, r"qzeros must be \[2, 2\], got \[2, 3\]"),
        ({"qzeros": torch.zeros(2, 2, dtype=torch.int16)}, "qzeros must be torch.int32, got torch.int16"),
        (
            {"scales": torch.zeros(2, 16, dtype=torch.int32)},
            "scales must be float16, bfloat16 or float32, got torch.int32",
        ),
        ({"scales": torch.zeros(2, 17, dtype=torch.float16)}, r"scales must be \[2, 16\], got \[2, 17\]"),
        ({"g_idx": torch.zeros(64, dtype=torch.int64)}, "g_idx must be torch.int32, got torch.int64"),
        ({"g_idx": torch.zeros(63, dtype=torch.int32)}, r"g_idx must be \[64\], got \[63\]"),
        ({"g_idx": torch.zeros(64, dtype=torch.int32, device="meta")}, "g_idx is on meta, expected cpu"),
        ({"dtype": torch.int8}, "dtype must be float16, bfloat16 or float32, got torch.int8"),
        ({"out": torch.empty(64, 15, dtype=torch.float16)}, r"out must be \[64, 16\], got \[64, 15\]"),
        (
            {"out": torch.empty(64, 16, dtype=torch.float64)},
            "out must be float16, bfloat16 or float32, got torch.float64",
        ),
        ({"out": torch.empty(16, 64).t()}, "out must be contiguous"),
        (
            {"out": torch.empty(64, 16), "dtype": torch.float16},
            "out is torch.float32 but dtype=torch.float16",
        ),
    ],
)
def test_gptq_refuses_bad_arguments(changes: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _gptq_bad(**changes)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"group_size": 0}, "group_size must be -1 or > 0, got 0"),
        ({"group_size": 16}, r"scales must be \[2, 16\], got \[1, 16\]"),
        ({"qzeros": torch.zeros(1, 3, dtype=torch.int32)}, r"qzeros must be \[1, 2\], got \[1, 3\]"),
        ({"scales": torch.zeros(1, 16, dtype=torch.float64)}, "scales must be float16, bfloat16 or float32"),
        (
            {"out": torch.empty(32 * 16 + 1, dtype=torch.float16)[1:].view(32, 16)},
            "out must be 16-byte aligned",
        ),
    ],
)
def test_awq_refuses_bad_arguments(changes: dict[str, Any], match: str) -> None:
    qweight, qzeros, scales = _awq_parts(32, 16, -1, scale_dtype=torch.float16)
    args: dict[str, Any] = {
        "qweight": qweight,
        "qzeros": qzeros,
        "scales": scales,
        "group_size": -1,
        "out": None,
    }
    args.update(changes)
    with pytest.raises(ValueError, match=match):
        quant_ops.dequantize_awq(
            args["qweight"], args["qzeros"], args["scales"], group_size=args["group_size"], out=args["out"]
        )
