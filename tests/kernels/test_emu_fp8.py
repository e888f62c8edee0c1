"""The CUDA kernels over an fp8 KV cache (kv_cache_dtype fp8 = e4m3, fp8_e5m2), run on the CPU through the
host emulator: the converting cache write gives the same bytes as the torch backend's rounding (round to
nearest even, saturation, subnormals, signed zero), and decode (one query token or several, one partition
and split-K, windowed) and the prefill kernels over the fp8 cache equal a float64 attention over the same
fp8 values."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from pagedrs.kernels import attention_ops, reshape_and_cache
from pagedrs.kernels._loader import CACHE_CTYPES, CTYPES, attention_names, cache_names
from pagedrs.layers.attention.torch_ref import to_cache_dtype
from tests.kernels.emu.emulator import host_kernels, needs_emulator
from tests.kernels.paged_case import (
    assert_close,
    attention_reference,
    make_case,
    run_paged_attention,
    write_reference,
)

pytestmark = needs_emulator

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
HEADS = (32, 80)


@pytest.fixture(scope="module", autouse=True)
def emulator() -> Iterator[None]:
    names = list(cache_names())
    for ctype in CTYPES.values():
        for cache_ctype in CACHE_CTYPES.values():
            for head in HEADS:
                names += attention_names(ctype, head, cache_ctype)
    with host_kernels(names):
        yield


def _quantized(cache: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    return to_cache_dtype(cache, fp8)


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_cache_write_equals_torch_rounding(dtype: torch.dtype, fp8: torch.dtype) -> None:
    case = make_case(
        [3, 1, 5], [7, 17, 5], num_heads=4, num_kv_heads=2, head_size=32, block_size=4, dtype=dtype
    )
    g = torch.Generator().manual_seed(4)
    # every regime: normal values, far past the largest finite value (saturation), subnormals, zeros
    scales = torch.tensor([1.0, 1e5, 1e-3, 3e-6, 0.0])
    pick = torch.randint(0, len(scales), case.k.shape, generator=g)
    case.k = (case.k.float() * scales[pick]).to(dtype)
    case.v = (-case.v.float() * scales[pick.flip(0)]).to(dtype)  # negative zeros too
    case.slot_mapping[1] = -1  # a padding token: written nowhere
    start = _quantized(case.kv_cache, fp8)
    cache = start.clone()
    reshape_and_cache(case.k, case.v, cache[0], cache[1], case.slot_mapping)
    case.kv_cache = start.float().to(dtype)  # the reference writes T values, then rounds the whole cache
    expected = _quantized(write_reference(case), fp8)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
    assert not torch.isnan(cache.float()).any()


def _run(
    case,
    fp8: torch.dtype,
    *,
    scale: float,
    window=None,
    monkeypatch=None,
    max_partition=None,
    decode_query=None,
):
    """The step through the kernels on an fp8 cache, and the float64 reference over the same fp8 values."""
    if max_partition is not None:
        monkeypatch.setattr(attention_ops, "_MAX_PARTITION", max_partition)
    cache = _quantized(case.kv_cache, fp8)
    reshape_and_cache(case.k, case.v, cache[0], cache[1], case.slot_mapping)
    out = run_paged_attention(case, cache, scale=scale, window=window, max_decode_query_len=decode_query)
    return out, attention_reference(case, cache.float(), scale=scale, sliding_window=window)


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_size"), [(8, 2, 32), (4, 4, 80), (6, 2, 32), (16, 2, 32)]
)
@pytest.mark.parametrize("decode_query", [None, 1])
def test_decode_and_prefill_over_fp8_cache(
    dtype: torch.dtype,
    fp8: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    decode_query: int | None,
) -> None:
    """A mixed step over cached prefixes: decodes (one query token) and short chunks (several), the chunks
    on the decode kernel (default) or on the prefill kernel (max_decode_query_len 1)."""
    case = make_case(
        [1, 5, 1, 12, 1],
        [1, 9, 40, 30, 17],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        block_size=16,
        dtype=dtype,
        seed=head_size + num_heads,
    )
    out, ref = _run(case, fp8, scale=head_size**-0.5, decode_query=decode_query)
    assert_close(out, ref, dtype, f"fp8 ({fp8}) cache, {dtype}")


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("window", [None, 50])
def test_split_k_decode_over_fp8_cache(
    fp8: torch.dtype, window: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    ctx = [300, 64, 65, 1, 129]
    case = make_case(
        [1] * len(ctx),
        ctx,
        num_heads=4,
        num_kv_heads=2,
        head_size=32,
        block_size=32,
        dtype=torch.bfloat16,
        seed=5,
    )
    out, ref = _run(case, fp8, scale=0.3, window=window, monkeypatch=monkeypatch, max_partition=64)
    assert_close(out, ref, torch.bfloat16, "split-k decode over fp8")


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", HEADS)
@pytest.mark.parametrize("window", [None, 5, 70])
def test_multi_query_split_k_decode_over_fp8_cache(
    fp8: torch.dtype, dtype: torch.dtype, head_size: int, window: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Verifications (k + 1 queries) over an fp8 cache, split into 64-key partitions (forced), GQA 3 (a
    query's heads cut between CTAs), windows inside the verified tokens and across partitions."""
    case = make_case(
        [4, 1, 9, 16],
        [300, 60, 150, 16],
        num_heads=6,
        num_kv_heads=2,
        head_size=head_size,
        block_size=16,
        dtype=dtype,
        seed=head_size + 7,
    )
    out, ref = _run(
        case, fp8, scale=head_size**-0.5, window=window, monkeypatch=monkeypatch, max_partition=64
    )
    assert_close(out, ref, dtype, f"multi-query split-k decode over fp8 ({fp8}), {dtype}")


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("impl", ["mma64", "mma128", "scalar"])
@pytest.mark.parametrize("head_size", [32, 80])
def test_every_prefill_kernel_reads_an_fp8_cache(
    fp8: torch.dtype, dtype: torch.dtype, impl: str, head_size: int
) -> None:
    """The tensor-core prefill widens fp8 K/V to the 16-bit type in shared memory (head 80 with 128-row
    tiles: Q in shared memory, 32-key tiles); long chunks over cached prefixes, partial key tiles."""
    case = make_case(
        [70, 5, 140],
        [70, 100, 200],
        num_heads=4,
        num_kv_heads=2,
        head_size=head_size,
        block_size=16,
        dtype=dtype,
        seed=head_size,
    )
    cache = _quantized(case.kv_cache, fp8)
    reshape_and_cache(case.k, case.v, cache[0], cache[1], case.slot_mapping)
    out = run_paged_attention(case, cache, scale=head_size**-0.5, impl=impl)
    ref = attention_reference(case, cache.float(), scale=head_size**-0.5, sliding_window=None)
    assert_close(out, ref, dtype, f"{impl} prefill over an fp8 ({fp8}) cache, {dtype}")


def test_tensor_core_prefill_refuses_float32_queries() -> None:
    case = make_case(
        [20], [20], num_heads=2, num_kv_heads=2, head_size=32, block_size=16, dtype=torch.float32
    )
    cache = _quantized(case.kv_cache, torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="tensor-core prefill"):
        run_paged_attention(case, cache, scale=0.2, impl="mma")
