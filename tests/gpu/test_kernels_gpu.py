"""Each kernel on a GPU against the float64 reference over many shapes: block sizes 16/32, every head size,
GQA ratios 1/4/8, contexts 1..8k (and 32k for split-K), ragged batches, slots across block boundaries.
Tolerances (tests/kernels/paged_case.TOLERANCES, |err| <= atol + rtol*|ref|): fp32 2e-5, fp16 4e-3,
bf16 3e-2. Skipped only where no CUDA GPU is present."""

from __future__ import annotations

import random

import pytest
import torch

from pagedrs.kernels import HEAD_SIZES, copy_blocks, reshape_and_cache
from pagedrs.kernels.attention_ops import DECODE_MAX_QUERY
from tests.kernels.paged_case import (
    assert_close,
    attention_reference,
    make_case,
    run_paged_attention,
    write_reference,
)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
GQA = [(8, 8), (16, 4), (32, 4)]  # group sizes 1, 4, 8


def _run(case, *, scale, window=None, impl="auto", max_seq_len=None):
    cache = case.kv_cache.clone()
    reshape_and_cache(case.k, case.v, cache[0], cache[1], case.slot_mapping)
    torch.testing.assert_close(cache, write_reference(case), atol=0, rtol=0)
    out = run_paged_attention(case, cache, scale=scale, window=window, impl=impl, max_seq_len=max_seq_len)
    torch.cuda.synchronize()
    return out, attention_reference(case, cache, scale=scale, sliding_window=window)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_size", [64, 128])
def test_reshape_and_cache(dtype: torch.dtype, block_size: int, head_size: int) -> None:
    rng = random.Random(0)
    q_lens = [rng.randint(1, 300) for _ in range(8)]
    ctx = [q + rng.randint(0, 500) for q in q_lens]  # new tokens start mid-block, cross block boundaries
    case = make_case(
        q_lens,
        ctx,
        num_heads=8,
        num_kv_heads=8,
        head_size=head_size,
        block_size=block_size,
        dtype=dtype,
        device="cuda",
    )
    case.slot_mapping[::7] = -1  # padding tokens: no write
    cache = case.kv_cache.clone()
    reshape_and_cache(case.k, case.v, cache[0], cache[1], case.slot_mapping)
    assert torch.equal(cache, write_reference(case))


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks(dtype: torch.dtype) -> None:
    caches = [torch.randn(2, 300, 16, 4, 128, device="cuda").to(dtype) for _ in range(30)]
    expected = [c.clone() for c in caches]
    perm = torch.randperm(300).tolist()
    pairs = list(zip(perm[:100], perm[100:200], strict=True))
    for c in expected:
        for s, d in pairs:
            c[:, d] = c[:, s]
    copy_blocks(caches, torch.tensor(pairs, device="cuda"))
    for c, e in zip(caches, expected, strict=True):
        assert torch.equal(c, e)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), GQA)
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode(
    dtype: torch.dtype, head_size: int, num_heads: int, num_kv_heads: int, block_size: int
) -> None:
    rng = random.Random(head_size * 100 + num_heads + block_size)
    ctx = [1, 8192, block_size, block_size + 1] + [rng.randint(1, 8192) for _ in range(6)]
    case = make_case(
        [1] * len(ctx),
        ctx,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        block_size=block_size,
        dtype=dtype,
        device="cuda",
        seed=rng.randint(0, 1 << 30),
    )
    out, ref = _run(case, scale=head_size**-0.5)
    assert_close(
        out, ref, dtype, f"decode {dtype} D={head_size} H={num_heads}/{num_kv_heads} bs={block_size}"
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 4, 64])
def test_decode_split_k_long_contexts(dtype: torch.dtype, batch: int) -> None:
    """Split-K at every partition size the heuristic picks (batch 1 -> 128-key partitions), ragged last
    partitions, a 32k context, and a grid sized for a larger capacity (what a CUDA graph passes)."""
    rng = random.Random(batch)
    ctx = [rng.choice([1, 511, 512, 513, 4096, 4097, 32768, rng.randint(1, 20000)]) for _ in range(batch)]
    case = make_case(
        [1] * batch,
        ctx,
        num_heads=16,
        num_kv_heads=2,
        head_size=128,
        block_size=16,
        dtype=dtype,
        device="cuda",
        seed=batch,
    )
    out, ref = _run(case, scale=0.1)
    assert_close(out, ref, dtype, "split-k decode")
    out2, _ = _run(case, scale=0.1, max_seq_len=65536)
    assert_close(out2, ref, dtype, "split-k decode, oversized grid")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), GQA)
@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill(
    dtype: torch.dtype, head_size: int, num_heads: int, num_kv_heads: int, block_size: int
) -> None:
    rng = random.Random(head_size * 7 + num_heads + block_size)
    q_lens = [rng.randint(2, 700) for _ in range(4)] + [2, 1000]
    ctx = [q + rng.choice([0, 0, rng.randint(1, 4000)]) for q in q_lens[:-1]] + [8192]  # fresh / chunked
    case = make_case(
        q_lens,
        ctx,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        block_size=block_size,
        dtype=dtype,
        device="cuda",
        seed=rng.randint(0, 1 << 30),
    )
    out, ref = _run(case, scale=head_size**-0.5)
    assert_close(
        out, ref, dtype, f"prefill {dtype} D={head_size} H={num_heads}/{num_kv_heads} bs={block_size}"
    )


@pytest.mark.parametrize("impl", ["mma64", "mma128"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_size", [64, 80, 128])
@pytest.mark.parametrize("window", [None, 700])
def test_prefill_both_tiles(impl: str, dtype: torch.dtype, head_size: int, window: int | None) -> None:
    """Each tensor-core tile forced (auto picks 128 rows for long chunks, 64 for short ones) over fresh
    prompts, chunks after long prefixes and short chunks, with and without a window."""
    q_lens = [130, 2, 700, 64, 1, 2000]
    ctx = [130, 3000, 700, 4000, 77, 6000]
    case = make_case(
        q_lens,
        ctx,
        num_heads=32,
        num_kv_heads=8,
        head_size=head_size,
        block_size=16,
        dtype=dtype,
        device="cuda",
        seed=head_size,
    )
    out, ref = _run(case, scale=head_size**-0.5, window=window, impl=impl)
    assert_close(out, ref, dtype, f"prefill {impl} D={head_size} window={window}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefill_scalar_fallback(dtype: torch.dtype) -> None:
    """The pre-sm_80 path for 16-bit types, forced."""
    case = make_case(
        [300, 45, 2],
        [300, 1200, 9],
        num_heads=32,
        num_kv_heads=8,
        head_size=128,
        block_size=16,
        dtype=dtype,
        device="cuda",
        seed=3,
    )
    out, ref = _run(case, scale=128**-0.5, impl="scalar")
    assert_close(out, ref, dtype, "scalar prefill")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [1, 17, 512, 4096])
def test_sliding_window(dtype: torch.dtype, window: int) -> None:
    q_lens = [1, 1, 1, 600, 33, 1]
    ctx = [5000, 17, 600, 600, 2000, 4097]
    case = make_case(
        q_lens,
        ctx,
        num_heads=32,
        num_kv_heads=8,
        head_size=128,
        block_size=16,
        dtype=dtype,
        device="cuda",
        seed=window,
    )
    out, ref = _run(case, scale=128**-0.5, window=window)
    assert_close(out, ref, dtype, f"sliding window {window}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_ragged_batch(dtype: torch.dtype) -> None:
    """Decodes and prefill chunks interleaved, padding rows (seq_len 0) included."""
    rng = random.Random(5)
    q_lens = [rng.choice([1, 1, 1, rng.randint(2, 300)]) for _ in range(40)]
    ctx = [q + rng.randint(0, 3000) for q in q_lens]
    case = make_case(
        q_lens,
        ctx,
        num_heads=9,
        num_kv_heads=3,
        head_size=64,
        block_size=16,
        dtype=dtype,
        device="cuda",
        seed=6,
    )
    pad = [i for i, q in enumerate(q_lens) if q == 1][:3]
    for i in pad:  # CUDA-graph padding rows
        case.seq_lens[i] = 0
        case.ctx_lens[i] = 0
        case.slot_mapping[int(case.query_start_loc[i])] = -1
    out, ref = _run(case, scale=0.125)
    assert_close(out, ref, dtype, "mixed batch")
    for i in pad:
        assert torch.equal(out[int(case.query_start_loc[i])], torch.zeros_like(out[0]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_len", [2, 5, 9, DECODE_MAX_QUERY])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [*GQA, (12, 4)])
@pytest.mark.parametrize("window", [None, 4, 700])
def test_multi_query_decode(
    dtype: torch.dtype, q_len: int, num_heads: int, num_kv_heads: int, window: int | None
) -> None:
    """Speculative verification on the decode kernel: q_len queries per request over contexts up to 32k
    (split-K), causal per query, beside one-token steps, a chunk longer than DECODE_MAX_QUERY (prefill)
    and a padding request (seq_len 0); windows inside the verified tokens and across partitions; group 3
    cuts a query's heads between CTAs."""
    rng = random.Random(q_len * 1000 + num_heads)
    ctx = [q_len, 32768, 4097, 513] + [rng.randint(q_len, 8192) for _ in range(6)]
    q_lens = [q_len] * len(ctx)
    q_lens[3] = 1
    q_lens[5] = DECODE_MAX_QUERY + 1
    ctx[5] = max(ctx[5], q_lens[5])
    ctx[6] = 1
    q_lens[6] = 1
    case = make_case(
        q_lens,
        ctx,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=128,
        block_size=16,
        dtype=dtype,
        device="cuda",
        seed=rng.randint(0, 1 << 30),
    )
    case.seq_lens[6] = 0  # CUDA-graph padding
    case.ctx_lens[6] = 0
    case.slot_mapping[int(case.query_start_loc[6])] = -1
    out, ref = _run(case, scale=128**-0.5, window=window)
    assert_close(out, ref, dtype, f"decode of {q_len} queries H={num_heads}/{num_kv_heads} window={window}")
    assert torch.equal(out[int(case.query_start_loc[6])], torch.zeros_like(out[0]))


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_size", [64, 128])
def test_fp8_cache_gpu(fp8: torch.dtype, dtype: torch.dtype, head_size: int) -> None:
    """kv_cache_dtype fp8 on the GPU: the converting write equals the torch backend's rounding byte for
    byte, and decode + prefill (long contexts, split-K) equal float64 attention over the fp8 values."""
    from pagedrs.layers.attention.torch_ref import to_cache_dtype

    case = make_case(
        [1, 37, 1, 1, 300],
        [1, 1000, 4096, 129, 2000],
        num_heads=16,
        num_kv_heads=4,
        head_size=head_size,
        block_size=16,
        dtype=dtype,
        device="cuda",
        seed=head_size,
    )
    cache = to_cache_dtype(case.kv_cache, fp8)
    expected = to_cache_dtype(write_reference(case), fp8)
    reshape_and_cache(case.k, case.v, cache[0], cache[1], case.slot_mapping)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
    out = run_paged_attention(case, cache, scale=head_size**-0.5)
    torch.cuda.synchronize()
    ref = attention_reference(case, cache.float(), scale=head_size**-0.5, sliding_window=None)
    assert_close(out, ref, dtype, f"fp8 {fp8} cache on the GPU")
