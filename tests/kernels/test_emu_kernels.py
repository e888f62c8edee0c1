"""The CUDA kernels, run on the CPU through the host emulator (tests/kernels/emu), against a float64
reference: indexing, tiling, split-K, masking and fragment layouts are checked without a GPU.

The emulator runs every CUDA thread as a coroutine, so shapes stay small; tests/gpu runs the same checks
on a GPU over large shapes. Needs a C++ compiler (g++); skipped without one.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from pagedrs.kernels import Launch, attention_ops, copy_blocks, reshape_and_cache, set_host_executor
from pagedrs.kernels._loader import CTYPES, attention_names, cache_names
from pagedrs.kernels.attention_ops import DECODE_MAX_QUERY
from tests.kernels.emu.emulator import Emulator, host_kernels, needs_emulator
from tests.kernels.paged_case import (
    assert_close,
    attention_reference,
    make_case,
    run_paged_attention,
    write_reference,
)

pytestmark = needs_emulator

EMU_HEADS = (16, 32, 64, 80)


@pytest.fixture(scope="module", autouse=True)
def emulator() -> Iterator[Emulator]:
    names = list(cache_names())
    for ctype in CTYPES.values():
        for head in EMU_HEADS:
            names += attention_names(ctype, head)
    with host_kernels(names) as emu:
        yield emu


def _attention(
    case, *, scale, window=None, impl="auto", max_partition=None, monkeypatch=None, decode_query=None
):
    """The step through the kernels and the float64 reference. decode_query: max_decode_query_len (the
    prefill tests pass 1, so the prefill kernels keep taking short chunks, as they do for a caller that
    sends only one-token queries to decode)."""
    if max_partition is not None:
        monkeypatch.setattr(attention_ops, "_MAX_PARTITION", max_partition)
    cache = write_reference(case)
    out = run_paged_attention(
        case, cache, scale=scale, window=window, impl=impl, max_decode_query_len=decode_query
    )
    return out, attention_reference(case, cache, scale=scale, sliding_window=window)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_reshape_and_cache(dtype: torch.dtype) -> None:
    case = make_case(
        [3, 1, 5], [7, 17, 5], num_heads=4, num_kv_heads=2, head_size=16, block_size=4, dtype=dtype, seed=1
    )
    case.slot_mapping[1] = -1  # a padding token: written nowhere
    expected = write_reference(case)
    cache = case.kv_cache.clone()
    reshape_and_cache(case.k, case.v, cache[0], cache[1], case.slot_mapping)
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("offset", [0, 1, 2, 4])
def test_reshape_and_cache_strided_views(offset: int) -> None:
    """K/V as views of a fused qkv buffer (token stride > row), at every alignment (all word sizes)."""
    case = make_case(
        [4, 2], [6, 9], num_heads=2, num_kv_heads=2, head_size=16, block_size=4, dtype=torch.float16, seed=2
    )
    t, kvh, d = case.k.shape
    fused = torch.zeros(t * (3 * kvh * d) + offset, dtype=torch.float16)[offset:].view(t, 3 * kvh * d)
    fused[:, kvh * d : 2 * kvh * d] = case.k.reshape(t, -1)
    fused[:, 2 * kvh * d :] = case.v.reshape(t, -1)
    k = fused[:, kvh * d : 2 * kvh * d].view(t, kvh, d)
    v = fused[:, 2 * kvh * d :].view(t, kvh, d)
    cache = case.kv_cache.clone()
    reshape_and_cache(k, v, cache[0], cache[1], case.slot_mapping)
    assert torch.equal(cache, write_reference(case))


@pytest.mark.parametrize("as_numpy", [True, False])
def test_copy_blocks(as_numpy: bool) -> None:
    g = torch.Generator().manual_seed(3)
    caches = [torch.randn(2, 9, 4, 2, 16, generator=g).to(torch.bfloat16) for _ in range(3)]
    expected = [c.clone() for c in caches]
    pairs = [(0, 5), (7, 1), (2, 8)]
    for c in expected:
        for s, d in pairs:
            c[:, d] = c[:, s]
    arr = torch.tensor(pairs, dtype=torch.int64)
    copy_blocks(caches, arr.numpy() if as_numpy else arr)
    for c, e in zip(caches, expected, strict=True):
        assert torch.equal(c, e)


def test_copy_blocks_rejects_out_of_range() -> None:
    caches = [torch.zeros(2, 4, 4, 1, 16, dtype=torch.float16)]
    with pytest.raises(ValueError, match="out of range"):
        copy_blocks(caches, torch.tensor([[0, 4]]).numpy())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 2), (8, 1), (12, 1), (6, 2)])
def test_decode(dtype: torch.dtype, num_heads: int, num_kv_heads: int) -> None:
    ctx = [1, 5, 16, 17, 40]
    case = make_case(
        [1] * len(ctx),
        ctx,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=32,
        block_size=16,
        dtype=dtype,
        seed=num_heads,
    )
    out, ref = _attention(case, scale=32**-0.5)
    assert_close(out, ref, dtype, "decode")


@pytest.mark.parametrize("head_size", EMU_HEADS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_decode_head_sizes(head_size: int, dtype: torch.dtype) -> None:
    case = make_case(
        [1, 1, 1],
        [3, 33, 20],
        num_heads=4,
        num_kv_heads=2,
        head_size=head_size,
        block_size=16,
        dtype=dtype,
        seed=head_size,
    )
    out, ref = _attention(case, scale=head_size**-0.5)
    assert_close(out, ref, dtype, f"decode head_size={head_size}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window", [None, 50])
def test_decode_split_k(dtype: torch.dtype, window: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Partitions of 64 keys (forced): several per request, a ragged last one, one-partition requests."""
    ctx = [300, 64, 65, 1, 129]
    case = make_case(
        [1] * len(ctx), ctx, num_heads=4, num_kv_heads=2, head_size=16, block_size=32, dtype=dtype, seed=5
    )
    out, ref = _attention(case, scale=0.3, window=window, max_partition=64, monkeypatch=monkeypatch)
    assert_close(out, ref, dtype, "split-k decode")


def test_decode_window_single_partition() -> None:
    case = make_case(
        [1, 1], [40, 7], num_heads=2, num_kv_heads=1, head_size=16, block_size=16, dtype=torch.float32, seed=6
    )
    out, ref = _attention(case, scale=0.25, window=9)
    assert_close(out, ref, torch.float32, "windowed decode")


def test_decode_empty_context_gives_zeros() -> None:
    """CUDA-graph padding rows: seq_len 0 -> zero output (finite), in both decode modes."""
    case = make_case(
        [1, 1], [9, 1], num_heads=2, num_kv_heads=1, head_size=16, block_size=16, dtype=torch.float16, seed=7
    )
    case.seq_lens[1] = 0
    case.ctx_lens[1] = 0
    case.slot_mapping[1] = -1
    for max_seq_len in (9, 5000):  # one partition / split-K with most partitions empty
        cache = write_reference(case)
        out = run_paged_attention(case, cache, scale=0.25, max_seq_len=max_seq_len)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        assert_close(
            out,
            attention_reference(case, cache, scale=0.25, sliding_window=None),
            torch.float16,
            "decode with padding",
        )


@pytest.mark.parametrize("impl", ["mma64", "mma128", "scalar"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (8, 2)])
def test_prefill(impl: str, dtype: torch.dtype, num_heads: int, num_kv_heads: int) -> None:
    """Chunks over cached prefixes (chunked prefill / prefix hits), fresh prompts, tiles split mid-token."""
    q_lens = [70, 5, 17]
    ctx = [70, 100, 17 + 33]
    case = make_case(
        q_lens,
        ctx,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=16,
        block_size=16,
        dtype=dtype,
        seed=num_heads,
    )
    out, ref = _attention(case, scale=0.25, impl=impl, decode_query=1)
    assert_close(out, ref, dtype, f"prefill {impl}")


@pytest.mark.parametrize("impl", ["mma64", "mma128"])
@pytest.mark.parametrize("head_size", [32, 64, 80])
def test_prefill_head_sizes(head_size: int, impl: str) -> None:
    """head 80 with 128-row tiles keeps Q in shared memory (re-read per k-step), the others in registers;
    a 140-token chunk spans two 128-row tiles; its prefix of 60 keys is fully visible to every row."""
    case = make_case(
        [9, 3, 140],
        [9, 20, 200],
        num_heads=4,
        num_kv_heads=1,
        head_size=head_size,
        block_size=32,
        dtype=torch.float16,
        seed=8,
    )
    out, ref = _attention(case, scale=head_size**-0.5, impl=impl, decode_query=1)
    assert_close(out, ref, torch.float16, f"prefill head_size={head_size} {impl}")


@pytest.mark.parametrize("impl", ["mma64", "mma128"])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (4, 1)])
def test_prefill_causal_edge_at_every_tile_boundary(impl: str, num_heads: int, num_kv_heads: int) -> None:
    """Prefixes 60..66 put some warp's first row one key before, at and after the end of a key tile: the
    tile-level "no mask needed" test must not let a row see the key right after its own position."""
    prefixes = list(range(60, 67))
    q_lens = [40] * len(prefixes)
    case = make_case(
        q_lens,
        [p + q for p, q in zip(prefixes, q_lens, strict=True)],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=16,
        block_size=16,
        dtype=torch.float16,
        seed=12,
    )
    out, ref = _attention(case, scale=0.5, impl=impl)
    assert_close(out, ref, torch.float16, f"causal tile edges {impl}")


@pytest.mark.parametrize("impl", ["mma64", "mma128"])
def test_prefill_window_edge_at_a_tile_start(impl: str) -> None:
    """Windows 84..107 over rows at 136..199: key tiles start at the window's edge of the CTA's first row,
    so each warp's later rows cut into the first tile at a different offset (masked tiles), and the middle
    tiles lie inside every row's range (unmasked)."""
    case = make_case(
        [64], [200], num_heads=2, num_kv_heads=2, head_size=16, block_size=16, dtype=torch.float16, seed=13
    )
    for window in [*range(84, 92), *range(100, 108)]:
        out, ref = _attention(case, scale=0.5, window=window, impl=impl)
        assert_close(out, ref, torch.float16, f"window {window} {impl}")


def test_prefill_fp32_scalar() -> None:
    case = make_case(
        [20, 3, 40],
        [25, 3, 100],
        num_heads=6,
        num_kv_heads=2,
        head_size=32,
        block_size=16,
        dtype=torch.float32,
        seed=9,
    )
    out, ref = _attention(case, scale=32**-0.5, decode_query=1)
    assert_close(out, ref, torch.float32, "prefill fp32")


@pytest.mark.parametrize("impl", ["mma64", "mma128", "scalar"])
@pytest.mark.parametrize("window", [21, 150])
def test_prefill_sliding_window(impl: str, window: int) -> None:
    """window 21 crosses every tile; window 150 leaves whole key tiles inside every row's range (unmasked)
    and whole tiles before it (skipped)."""
    case = make_case(
        [30, 12, 10],
        [90, 12, 300],
        num_heads=4,
        num_kv_heads=2,
        head_size=16,
        block_size=16,
        dtype=torch.float16,
        seed=10,
    )
    out, ref = _attention(case, scale=0.25, window=window, impl=impl, decode_query=1)
    assert_close(out, ref, torch.float16, f"windowed prefill {impl}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("decode_query", [None, 1])
def test_mixed_batch(dtype: torch.dtype, decode_query: int | None) -> None:
    """Decodes and prefill chunks interleaved in any order, one launch sequence: the short chunks on the
    decode kernel (default), or on the prefill kernel (max_decode_query_len 1)."""
    q_lens = [1, 9, 1, 1, 4, 1]
    ctx = [33, 9, 1, 70, 19, 16]
    case = make_case(
        q_lens, ctx, num_heads=8, num_kv_heads=2, head_size=16, block_size=16, dtype=dtype, seed=11
    )
    out, ref = _attention(case, scale=0.25, decode_query=decode_query)
    assert_close(out, ref, dtype, "mixed batch")


# ---- several query tokens per request on the decode kernel (speculative verification) -------------------
MULTI_QUERY = [2, 3, 5, 9, DECODE_MAX_QUERY]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("q_len", MULTI_QUERY)
def test_multi_query_decode(dtype: torch.dtype, q_len: int) -> None:
    """k + 1 queries over a cached context, causal per query: a context of only the queries, a short
    prefix, one crossing blocks, and a one-token step beside them."""
    ctx = [q_len, q_len + 3, 40, 1]
    case = make_case(
        [q_len, q_len, q_len, 1],
        ctx,
        num_heads=4,
        num_kv_heads=2,
        head_size=32,
        block_size=16,
        dtype=dtype,
        seed=q_len,
    )
    out, ref = _attention(case, scale=32**-0.5)
    assert_close(out, ref, dtype, f"decode of {q_len} queries")


@pytest.mark.parametrize("q_len", MULTI_QUERY)
@pytest.mark.parametrize("window", [None, 3, 50])
def test_multi_query_decode_split_k(q_len: int, window: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Partitions of 64 keys (forced): a request's queries straddle partition edges (the last queries see
    one more partition than the first), contexts of one and several partitions; window 3 ends inside the
    verified tokens themselves (a query does not see the first drafts), window 50 puts each query's
    window edge at a different key, so the first partitions are seen by some queries only."""
    ctx = [300, 64 + q_len // 2, 129, q_len, 200]
    q_lens = [q_len, q_len, q_len, q_len, 1]
    case = make_case(
        q_lens, ctx, num_heads=4, num_kv_heads=2, head_size=16, block_size=32, dtype=torch.float32, seed=5
    )
    out, ref = _attention(case, scale=0.3, window=window, max_partition=64, monkeypatch=monkeypatch)
    assert_close(out, ref, torch.float32, f"split-k decode of {q_len} queries, window {window}")


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (8, 2), (6, 2), (5, 1), (12, 1)])
@pytest.mark.parametrize("q_len", [3, 9])
@pytest.mark.parametrize("split", [False, True])
def test_multi_query_decode_gqa(
    num_heads: int, num_kv_heads: int, q_len: int, split: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(query, head) rows of groups 1, 4, 3, 5 and 12: a CTA's 8 rows span several queries, and a query's
    heads are cut between two CTAs where the group does not divide 8."""
    case = make_case(
        [q_len, 1, q_len],
        [q_len + 150, 77, q_len + 20],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=32,
        block_size=16,
        dtype=torch.bfloat16,
        seed=num_heads * 10 + q_len,
    )
    out, ref = _attention(
        case, scale=0.2, window=60, max_partition=64 if split else None, monkeypatch=monkeypatch
    )
    assert_close(out, ref, torch.bfloat16, f"GQA {num_heads}/{num_kv_heads} decode of {q_len} queries")


@pytest.mark.parametrize("head_size", EMU_HEADS)
def test_multi_query_decode_head_sizes(head_size: int) -> None:
    case = make_case(
        [4, 7],
        [30, 90],
        num_heads=4,
        num_kv_heads=1,
        head_size=head_size,
        block_size=16,
        dtype=torch.float16,
        seed=head_size,
    )
    out, ref = _attention(case, scale=head_size**-0.5)
    assert_close(out, ref, torch.float16, f"multi-query decode head_size={head_size}")


def _mixed_verify_case(dtype: torch.dtype):
    """One-token steps, verifications, chunks longer than DECODE_MAX_QUERY and a padding request."""
    q_lens = [1, 5, DECODE_MAX_QUERY + 1, 1, 9, 40, 2, DECODE_MAX_QUERY]
    ctx = [33, 200, 90, 1, 9, 140, 70, 130]
    case = make_case(
        q_lens, ctx, num_heads=6, num_kv_heads=2, head_size=16, block_size=16, dtype=dtype, seed=14
    )
    pad = 3  # CUDA-graph padding: seq_len 0, zero output
    case.seq_lens[pad] = 0
    case.ctx_lens[pad] = 0
    case.slot_mapping[int(case.query_start_loc[pad])] = -1
    return case, pad


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("split", [False, True])
def test_mixed_batch_with_verifications(
    dtype: torch.dtype, split: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    case, pad = _mixed_verify_case(dtype)
    out, ref = _attention(case, scale=0.25, max_partition=64 if split else None, monkeypatch=monkeypatch)
    assert_close(out, ref, dtype, "mixed batch with verifications")
    assert torch.equal(out[int(case.query_start_loc[pad])], torch.zeros_like(out[0]))


@pytest.mark.parametrize("decode_query", [DECODE_MAX_QUERY, 5])
def test_each_kernel_writes_only_its_requests(
    emulator: Emulator, decode_query: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run only the decode launches (decode + reduce), then only the prefill launch: each writes exactly
    the rows of its requests (q_len <= max_decode_query_len, and longer), the rest stays NaN."""
    case, _ = _mixed_verify_case(torch.float32)
    monkeypatch.setattr(attention_ops, "_MAX_PARTITION", 64)
    cache = write_reference(case)
    ref = attention_reference(case, cache, scale=0.25, sliding_window=None)
    on_decode = torch.tensor([q <= decode_query for q in case.q_lens for _ in range(q)])
    for kernels, rows in ((("decode", "reduce"), on_decode), (("prefill",), ~on_decode)):

        def only(spec: Launch, kernels: tuple[str, ...] = kernels) -> None:
            if any(f"paged_attention_{k}" in spec.name for k in kernels):
                emulator(spec)

        previous = set_host_executor(only)
        try:
            out = run_paged_attention(case, cache, scale=0.25, max_decode_query_len=decode_query)
        finally:
            set_host_executor(previous)
        assert torch.isnan(out[~rows]).all(), f"{kernels} wrote rows of the other kernel's requests"
        assert_close(out[rows], ref[rows], torch.float32, f"rows of {kernels}")
