"""Host-side launch logic, no GPU and no emulator: split-K partitioning, shared-memory budgets,
argument validation, the decode / prefill launches a step makes (recorded, not run), CUDA-graph capture
sizes."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch

from pagedrs.kernels import (
    HEAD_SIZES,
    Launch,
    decode_partitions,
    paged_attention,
    reshape_and_cache,
    set_host_executor,
    supports,
)
from pagedrs.kernels._loader import GROUP_SIZES, prefill_mma_tiles
from pagedrs.kernels.attention_ops import (
    DECODE_MAX_QUERY,
    decode_rows,
    decode_smem_bytes,
    prefill_m_tiles,
    prefill_smem_bytes,
    scalar_prefill_smem_bytes,
)
from pagedrs.layers.attention import AttentionMetadata
from pagedrs.layers.attention.cupy import decode_query_len
from pagedrs.runner.cuda_graphs import default_capture_sizes

_SMEM_LIMIT = 48 * 1024  # without opting in to more dynamic shared memory


@pytest.mark.parametrize("num_ctas", [1, 8, 64, 2048])
@pytest.mark.parametrize("span", [1, 63, 512, 513, 4096, 32768, 131072])
def test_decode_partitions_cover_the_context(num_ctas: int, span: int) -> None:
    size, parts = decode_partitions(num_ctas, span, num_sms=132)
    assert size * parts >= span and size * (parts - 1) < span  # no partition is empty at the longest span
    assert 64 <= size <= 512
    if parts > 1:  # split: a power of two, halved only while the grid would not fill the device twice
        assert size & (size - 1) == 0 and parts == math.ceil(span / size)
        assert num_ctas * parts >= 2 * 132 or size == 64
        if size < min(512, 1 << max(6, math.ceil(math.log2(span)))):  # halved: the larger size fell short
            assert num_ctas * math.ceil(span / (2 * size)) < 2 * 132
    if num_ctas >= 2 * 132:
        assert size == min(512, max(64, -(-span // 64) * 64)) or parts > 1 and size == 512


def test_few_ctas_get_smaller_partitions() -> None:
    assert decode_partitions(8, 4096, num_sms=132)[0] < decode_partitions(4096, 4096, num_sms=132)[0]
    # one short request (8 kv-head CTAs) is spread over the device instead of 8 CTAs
    size, parts = decode_partitions(8, 512, num_sms=132)
    assert (size, parts) == (64, 8)
    assert decode_partitions(2048, 512, num_sms=132) == (512, 1)
    assert decode_partitions(2048, 300, num_sms=132) == (320, 1)


@pytest.mark.parametrize("head_size", HEAD_SIZES)
def test_shared_memory_budgets(head_size: int) -> None:
    """Decode and the scalar prefill fit the 48 KiB every kernel gets; the tensor-core prefill fits what
    every sm_80+ part can opt in to (99 KiB on sm_86/89; the launcher opts in past 48 KiB)."""
    for gp in GROUP_SIZES:
        for part in (64, 128, 256, 512):
            one = decode_smem_bytes(head_size, gp, part)
            assert one < decode_smem_bytes(head_size, gp, part, multi_query=True) <= _SMEM_LIMIT
    for mt in prefill_mma_tiles(head_size):
        assert prefill_smem_bytes(head_size, mt) <= 99 * 1024
    # head 256: both prefills opt in past 48 KiB (66 and 80 KiB; sm_80+ parts give 99 KiB or more)
    limit = _SMEM_LIMIT if head_size <= 128 else 99 * 1024
    assert prefill_smem_bytes(head_size, 1) <= limit
    assert scalar_prefill_smem_bytes(head_size) <= limit


def test_prefill_tile_choice() -> None:
    assert prefill_m_tiles("auto", 2048, 1) == 2 and prefill_m_tiles("mma", 128, 1) == 2
    assert prefill_m_tiles("auto", 20, 4) == 1  # 80 rows: a 128-row tile would be mostly padding
    assert prefill_m_tiles("mma64", 4096, 8) == 1 and prefill_m_tiles("mma128", 2, 1) == 2


def test_supports() -> None:
    assert supports(128, torch.bfloat16) and supports(64, torch.float32) and supports(80, torch.float16)
    assert (
        supports(256, torch.float16) and not supports(128, torch.float64) and not supports(48, torch.float16)
    )
    assert supports(256, torch.bfloat16, soft_cap=True) and supports(128, torch.float32, soft_cap=True)
    assert not supports(64, torch.float16, soft_cap=True)


def _args(**over: object) -> dict:
    q = torch.zeros(3, 4, 16, dtype=torch.float16)
    args = dict(
        out=torch.empty_like(q),
        q=q,
        key_cache=torch.zeros(8, 16, 2, 16, dtype=torch.float16),
        value_cache=torch.zeros(8, 16, 2, 16, dtype=torch.float16),
        block_tables=torch.zeros(2, 4, dtype=torch.int32),
        seq_lens=torch.tensor([2, 1], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 2, 3], dtype=torch.int32),
    )
    args.update(over)
    return args


def _call(**over: object) -> None:
    paged_attention(**_args(**over), scale=0.25, sliding_window=None, max_query_len=2, max_seq_len=2)


def test_paged_attention_validates_arguments() -> None:
    with pytest.raises(ValueError, match="head_size=24"):
        q = torch.zeros(3, 4, 24, dtype=torch.float16)
        c = torch.zeros(8, 16, 2, 24, dtype=torch.float16)
        _call(q=q, out=torch.empty_like(q), key_cache=c, value_cache=c)
    with pytest.raises(ValueError, match="seq_lens"):
        _call(seq_lens=torch.tensor([2, 1], dtype=torch.int64))
    with pytest.raises(ValueError, match="power of two"):
        c = torch.zeros(8, 12, 2, 16, dtype=torch.float16)
        _call(key_cache=c, value_cache=c)
    with pytest.raises(ValueError, match="kv heads"):
        c = torch.zeros(8, 16, 3, 16, dtype=torch.float16)
        _call(key_cache=c, value_cache=c)
    with pytest.raises(RuntimeError, match="CUDA device"):  # valid, but no GPU and no emulator
        _call()


def test_max_decode_query_len_is_validated() -> None:
    with pytest.raises(ValueError, match="max_decode_query_len"):
        paged_attention(
            **_args(),
            scale=0.25,
            sliding_window=None,
            max_query_len=2,
            max_seq_len=2,
            max_decode_query_len=DECODE_MAX_QUERY + 1,
        )


def test_decode_rows() -> None:
    """One query: the group's heads, as a decode step always had them; several: (query, head) rows in CTAs
    of up to 8."""
    for group in range(1, 13):
        gp = next((g for g in GROUP_SIZES if g >= group), GROUP_SIZES[-1])
        assert decode_rows(group, 1) == (gp, -(-group // gp))
    assert decode_rows(1, 2) == (2, 1) and decode_rows(1, 5) == (8, 1) and decode_rows(1, 9) == (8, 2)
    assert decode_rows(3, 3) == (8, 2) and decode_rows(8, DECODE_MAX_QUERY) == (8, 16)


@pytest.fixture
def launches() -> Iterator[list[Launch]]:
    """The launches paged_attention makes on CPU tensors, recorded instead of run."""
    seen: list[Launch] = []
    previous = set_host_executor(seen.append)
    try:
        yield seen
    finally:
        set_host_executor(previous)


def _step(q_lens: list[int], *, num_heads: int = 12, **kw: int) -> None:
    """paged_attention over a batch of these query lengths (1 kv head, head size 16, 4096 keys)."""
    t = sum(q_lens)
    q = torch.zeros(t, num_heads, 16, dtype=torch.float16)
    cache = torch.zeros(300, 16, 1, 16, dtype=torch.float16)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    paged_attention(
        torch.empty_like(q),
        q,
        cache,
        cache,
        torch.zeros(len(q_lens), 256, dtype=torch.int32),
        torch.full((len(q_lens),), 4096, dtype=torch.int32),
        qsl,
        scale=0.25,
        sliding_window=None,
        max_seq_len=4096,
        **kw,
    )


def _kernel(spec: Launch) -> str:
    return spec.name.removeprefix("pagedrs::paged_attention_").split("<")[0]


def test_one_token_step_keeps_the_decode_launches(launches: list[Launch]) -> None:
    """max_query_len 1 (what a CUDA graph captures): the one-token instances (MQ false, the kernels as
    they were before they took several queries, shared memory included), group 12 in 2 CTAs of 8 heads, 64
    partitions of 64 keys, the reduce over (request, head), no prefill launch."""
    _step([1] * 4, max_query_len=1)
    assert [_kernel(s) for s in launches] == ["decode", "reduce"]
    decode, reduce = launches
    assert decode.name == "pagedrs::paged_attention_decode<pagedrs::half_t, 16, 8>"
    assert reduce.name == "pagedrs::paged_attention_reduce<pagedrs::half_t, 16>"
    assert decode.grid == (4, 2, 64) and decode.shared_mem == decode_smem_bytes(16, 8, 64) == 4 * (
        128 + 512 + 16 + 64
    )
    assert reduce.grid == (4, 12, 1)
    assert int(decode.args[-2]) == 1 and int(reduce.args[-1]) == 1  # max_query (decode: then the cap)


def test_one_token_requests_beside_long_chunks_keep_the_one_token_instance(launches: list[Launch]) -> None:
    _step([1, 1, 40], max_query_len=40, max_decode_query_len=1)
    assert [s.name.endswith(", true>") for s in launches] == [False, False, False]
    assert [_kernel(s) for s in launches] == ["decode", "reduce", "prefill"]


def test_verification_step_runs_on_the_decode_kernel_only(launches: list[Launch]) -> None:
    """Some request of 2+ queries: the multi-query instances, with their larger shared memory."""
    _step([5, 1, 3, 5], max_query_len=5)
    assert [_kernel(s) for s in launches] == ["decode", "reduce"]
    decode, reduce = launches
    assert decode.name == "pagedrs::paged_attention_decode<pagedrs::half_t, 16, 8, pagedrs::half_t, true>"
    assert reduce.name == "pagedrs::paged_attention_reduce<pagedrs::half_t, 16, true>"
    assert decode.shared_mem == decode_smem_bytes(16, 8, int(decode.args[-4]), multi_query=True)
    assert decode.grid[:2] == (4, 8) and reduce.grid == (4, 12, 5)  # ceil(5 * 12 / 8) row chunks


def test_long_chunks_go_to_the_prefill_kernel(launches: list[Launch]) -> None:
    """A step with a chunk past DECODE_MAX_QUERY: both kernels, told the same decode bound; the bound
    passed (the longest short query) sizes the decode grid; 0 leaves decode out."""
    _step([1, 3, 40], max_query_len=40)
    assert [_kernel(s) for s in launches] == ["decode", "reduce", "prefill"]
    assert launches[0].grid[1] == -(-DECODE_MAX_QUERY * 12 // 8)
    # the decode bound: decode's and prefill's argument before the soft cap, the reduce's last
    assert {int(s.args[-1 if _kernel(s) == "reduce" else -2]) for s in launches} == {DECODE_MAX_QUERY}
    launches.clear()
    _step([1, 3, 40], max_query_len=40, max_decode_query_len=3)
    assert launches[0].grid[1] == 5 and {
        int(s.args[-1 if _kernel(s) == "reduce" else -2]) for s in launches
    } == {3}
    launches.clear()
    _step([40, 20], max_query_len=40, max_decode_query_len=0)
    assert [_kernel(s) for s in launches] == ["prefill"] and int(launches[0].args[-2]) == 0


def _meta(q_lens: list[int]) -> AttentionMetadata:
    qsl = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    empty = torch.zeros(0, dtype=torch.int32)
    return AttentionMetadata(
        slot_mapping=empty.long(),
        query_start_loc=empty,
        seq_lens=empty,
        block_tables=empty.view(0, 0),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=[100] * len(q_lens),
        max_query_len=max(q_lens),
        max_seq_len=100,
        block_size=16,
    )


def test_decode_query_len_of_a_step() -> None:
    """The cupy backend's bound: max_query_len while it is short, else the longest short query (0: none),
    found once per step."""
    assert decode_query_len(_meta([1, 1, 1])) == 1 and decode_query_len(_meta([4, 1, 9])) == 9
    meta = _meta([1, 5, 300, DECODE_MAX_QUERY + 1])
    assert decode_query_len(meta) == 5 and meta.cache["cupy_decode_query_len"] == 5
    assert decode_query_len(_meta([DECODE_MAX_QUERY + 1, 40])) == 0


def test_reshape_and_cache_validates_arguments() -> None:
    k = torch.zeros(3, 2, 16, dtype=torch.float16)
    cache = torch.zeros(4, 16, 2, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match="slot_mapping"):
        reshape_and_cache(k, k, cache, cache, torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="dtype"):
        reshape_and_cache(k.float(), k.float(), cache, cache, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="contiguous"):
        reshape_and_cache(
            k.transpose(1, 2).contiguous().transpose(1, 2), k, cache, cache, torch.zeros(3, dtype=torch.int64)
        )


def test_default_capture_sizes() -> None:
    assert default_capture_sizes(1) == [1]
    assert default_capture_sizes(6) == [1, 2, 4, 6]
    sizes = default_capture_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and all(s % 16 == 0 for s in sizes[4:])


def test_soft_cap_launches_the_capping_instances() -> None:
    """A soft cap: every launch on the CAP instances, the logits scaled by scale / cap and capped at
    cap * log2(e); without one the instances keep their names and read no cap (0 passed)."""
    seen: list[Launch] = []
    previous = set_host_executor(seen.append)
    try:
        for cap in (None, 50.0):
            q = torch.zeros(41, 2, 128, dtype=torch.float16)
            cache = torch.zeros(300, 16, 1, 128, dtype=torch.float16)
            paged_attention(
                torch.empty_like(q),
                q,
                cache,
                cache,
                torch.zeros(2, 256, dtype=torch.int32),
                torch.full((2,), 4096, dtype=torch.int32),
                torch.tensor([0, 1, 41], dtype=torch.int32),
                scale=0.125,
                sliding_window=None,
                max_query_len=40,
                max_seq_len=4096,
                max_decode_query_len=1,
                logits_soft_cap=cap,
            )
    finally:
        set_host_executor(previous)
    plain, capped = seen[:3], seen[3:]
    assert [_kernel(s) for s in capped] == ["decode", "reduce", "prefill"]
    assert not any(s.name.endswith(", true>") for s in plain) and float(plain[0].args[-1]) == 0.0
    decode, _, prefill = capped
    assert decode.name.endswith("128, 2, pagedrs::half_t, false, true>")
    assert prefill.name.endswith(", true>") and "reduce" in capped[1].name
    for s in (decode, prefill):
        assert float(s.args[-1]) == pytest.approx(50.0 * math.log2(math.e))
        assert float(s.args[-3 if s is prefill else -5]) == pytest.approx(0.125 / 50.0)
    assert prefill_m_tiles("auto", 4096, 8, head_size=256) == 1
