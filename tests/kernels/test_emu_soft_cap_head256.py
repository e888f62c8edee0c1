"""The CUDA attention kernels for Gemma 2 / 3 and Qwen3 layers, run on the CPU through the host emulator
against the float64 reference: attention-logit soft-capping (``cap * tanh(s / cap)`` on the scaled scores,
HF's Gemma 2) in decode (one query, several, split-K) and both prefill kernels; head size 256 (Gemma) with
and without it; per-layer windows (a local and a global layer over one cache in one step).

GPU side unverified here: these are the emulator's results (tests/gpu runs the same shapes on a GPU)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from pagedrs.kernels import attention_ops
from pagedrs.kernels._loader import CTYPES, SOFT_CAP_HEAD_SIZES, attention_names, cache_names
from pagedrs.layers.attention.cupy import CupyAttentionBackend
from pagedrs.layers.attention.selector import kernel_takes
from pagedrs.layers.attention.torch_ref import TorchAttentionBackend
from tests.kernels.emu.emulator import needs_emulator, recording_kernels
from tests.kernels.paged_case import (
    assert_close,
    attention_reference,
    make_case,
    run_paged_attention,
    write_reference,
)

pytestmark = needs_emulator

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


@pytest.fixture(scope="module", autouse=True)
def launched() -> Iterator[list[str]]:
    names = list(cache_names())
    for ctype in CTYPES.values():
        names += attention_names(ctype, 256)
        for head in SOFT_CAP_HEAD_SIZES:
            names += attention_names(ctype, head, soft_cap=True)
    with recording_kernels(names) as seen:
        yield seen


def _check(case, dtype, *, scale, cap, window=None, impl="auto", decode_query=None, what=""):
    """The step through the kernels against the float64 reference; the cap must change the result."""
    cache = write_reference(case)
    out = run_paged_attention(
        case,
        cache,
        scale=scale,
        window=window,
        impl=impl,
        max_decode_query_len=decode_query,
        logits_soft_cap=cap,
    )
    ref = attention_reference(case, cache, scale=scale, sliding_window=window, logits_soft_cap=cap)
    assert_close(out, ref, dtype, what)
    if cap is not None:
        plain = attention_reference(case, cache, scale=scale, sliding_window=window)
        assert (plain - ref).abs().max() > 0.05, "the cap must bite in this test"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 9])
def test_decode_soft_cap(dtype: torch.dtype, window: int | None, launched: list[str]) -> None:
    ctx = [1, 5, 17, 40]
    case = make_case(
        [1] * 4, ctx, num_heads=8, num_kv_heads=2, head_size=128, block_size=16, dtype=dtype, seed=21
    )
    launched.clear()
    _check(case, dtype, scale=1.0, cap=3.0, window=window, what="soft-capped decode")
    assert launched and all(name.endswith(", true>") for name in launched)  # only the capping instances


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_soft_cap_split_k_and_multi_query(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """Partitions of 64 keys (forced): the capped logits' maxima and sums are combined across partitions;
    a verification of 5 queries and one-token requests beside it; windowed and not."""
    monkeypatch.setattr(attention_ops, "_MAX_PARTITION", 64)
    case = make_case(
        [1, 5, 1],
        [300, 130, 65],
        num_heads=4,
        num_kv_heads=2,
        head_size=128,
        block_size=32,
        dtype=dtype,
        seed=22,
    )
    for window in (None, 50):
        _check(case, dtype, scale=0.7, cap=2.0, window=window, what=f"split-k capped decode w{window}")


@pytest.mark.parametrize("impl", ["mma64", "mma128", "scalar"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefill_soft_cap(impl: str, dtype: torch.dtype) -> None:
    """Chunks over cached prefixes and fresh prompts, windowed (crossing tiles) and not."""
    case = make_case(
        [70, 5, 17],
        [70, 100, 50],
        num_heads=8,
        num_kv_heads=2,
        head_size=128,
        block_size=16,
        dtype=dtype,
        seed=23,
    )
    for window in (None, 21):
        _check(
            case,
            dtype,
            scale=1.0,
            cap=3.0,
            window=window,
            impl=impl,
            decode_query=1,
            what=f"{impl} w{window}",
        )


def test_prefill_soft_cap_fp32_scalar() -> None:
    case = make_case(
        [20, 40],
        [25, 100],
        num_heads=6,
        num_kv_heads=2,
        head_size=128,
        block_size=16,
        dtype=torch.float32,
        seed=24,
    )
    _check(case, torch.float32, scale=1.0, cap=5.0, decode_query=1, what="fp32 capped prefill")


@pytest.mark.parametrize("dtype", DTYPES)
def test_head_256_decode_and_prefill(dtype: torch.dtype) -> None:
    """Gemma's head size: decodes, a verification, a chunk over a prefix and a fresh prompt, in one step
    (tensor-core prefill for 16-bit types, 64-row tiles, Q in shared memory; scalar for fp32), soft-capped
    (Gemma 2: scale query_pre_attn_scalar**-0.5, cap 50 and one that bites) and not; one KV head (Gemma 3's
    small checkpoints) and GQA."""
    for kvh in (1, 2):
        case = make_case(
            [1, 3, 40, 70],
            [33, 20, 90, 70],
            num_heads=4,
            num_kv_heads=kvh,
            head_size=256,
            block_size=16,
            dtype=dtype,
            seed=25 + kvh,
        )
        cache = write_reference(case)
        for cap in (None, 50.0):
            out = run_paged_attention(case, cache, scale=256**-0.5, logits_soft_cap=cap)
            ref = attention_reference(case, cache, scale=256**-0.5, sliding_window=None, logits_soft_cap=cap)
            assert_close(out, ref, dtype, f"head 256 kvh {kvh} cap {cap}")
        case.q = case.q * 4  # scores up to ~10: a cap of 2 changes them
        _check(case, dtype, scale=256**-0.5, cap=2.0, what=f"head 256 kvh {kvh}, biting cap")


def test_local_and_global_layers_in_one_step() -> None:
    """Gemma 3 interleaves sliding-window and global layers: the same step's metadata, each layer's cache
    and window (and Gemma 2's cap on both), each equal to its own reference."""
    dtype = torch.float16
    case = make_case(
        [1, 1, 30],
        [200, 40, 90],
        num_heads=4,
        num_kv_heads=1,
        head_size=256,
        block_size=16,
        dtype=dtype,
        seed=27,
    )
    for window in (32, None):
        for cap in (None, 50.0):
            cache = write_reference(case)
            out = run_paged_attention(case, cache, scale=0.0625, window=window, logits_soft_cap=cap)
            ref = attention_reference(case, cache, scale=0.0625, sliding_window=window, logits_soft_cap=cap)
            assert_close(out, ref, dtype, f"window {window} cap {cap}")


def test_bad_soft_cap_and_tile_are_refused() -> None:
    case = make_case([1], [4], num_heads=2, num_kv_heads=1, head_size=256, block_size=16, dtype=torch.float16)
    cache = write_reference(case)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="logits_soft_cap"):
            run_paged_attention(case, cache, scale=1.0, logits_soft_cap=bad)
    long = make_case(
        [40], [40], num_heads=2, num_kv_heads=1, head_size=256, block_size=16, dtype=torch.float16
    )
    narrow = make_case(
        [1], [4], num_heads=2, num_kv_heads=1, head_size=32, block_size=16, dtype=torch.float16
    )
    with pytest.raises(ValueError, match="head_size=32"):
        run_paged_attention(narrow, write_reference(narrow), scale=1.0, logits_soft_cap=50.0)
    with pytest.raises(ValueError, match="mma128"):
        run_paged_attention(long, write_reference(long), scale=1.0, impl="mma128", max_decode_query_len=1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cupy_backend_equals_the_torch_reference(dtype: torch.dtype) -> None:
    """The backend a Gemma 2 layer runs on: the cupy backend takes soft-capped layers of head 128 and 256
    itself now (no routing to the reference), and equals the reference on a mixed step."""
    assert kernel_takes("cupy", head_size=256, logits_soft_cap=50.0)
    assert kernel_takes("cupy", head_size=128, logits_soft_cap=50.0)
    assert not kernel_takes("cupy", head_size=64, logits_soft_cap=50.0)
    case = make_case(
        [1, 7, 1, 20], [9, 7, 30, 40], num_heads=4, num_kv_heads=2, head_size=256, block_size=8, dtype=dtype
    )
    meta = case.meta()
    ref_cache, our_cache = case.kv_cache.clone(), case.kv_cache.clone()
    kw = {"scale": 0.25, "sliding_window": 6, "logits_soft_cap": 2.0}
    ref = TorchAttentionBackend().forward(case.q, case.k, case.v, ref_cache, meta, **kw)
    ours = CupyAttentionBackend().forward(case.q, case.k, case.v, our_cache, meta, **kw)
    assert torch.equal(our_cache, ref_cache)
    assert_close(ours, ref.float(), dtype, "cupy vs torch backend, soft-capped")
