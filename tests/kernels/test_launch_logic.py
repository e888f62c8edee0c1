"""Host-side launch logic, no GPU and no emulator: split-K partitioning, shared-memory budgets,
argument validation, CUDA-graph capture sizes."""

from __future__ import annotations

import math

import pytest
import torch

from pagedrs.kernels import HEAD_SIZES, decode_partitions, paged_attention, reshape_and_cache, supports
from pagedrs.kernels._loader import GROUP_SIZES, PREFILL_MMA_TILES
from pagedrs.kernels.attention_ops import (
    decode_smem_bytes,
    prefill_m_tiles,
    prefill_smem_bytes,
    scalar_prefill_smem_bytes,
)
from pagedrs.worker.cuda_graphs import default_capture_sizes

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
            assert decode_smem_bytes(head_size, gp, part) <= _SMEM_LIMIT
    for mt in PREFILL_MMA_TILES:
        assert prefill_smem_bytes(head_size, mt) <= 99 * 1024
    assert prefill_smem_bytes(head_size, 1) <= _SMEM_LIMIT
    assert scalar_prefill_smem_bytes(head_size) <= _SMEM_LIMIT


def test_prefill_tile_choice() -> None:
    assert prefill_m_tiles("auto", 2048, 1) == 2 and prefill_m_tiles("mma", 128, 1) == 2
    assert prefill_m_tiles("auto", 20, 4) == 1  # 80 rows: a 128-row tile would be mostly padding
    assert prefill_m_tiles("mma64", 4096, 8) == 1 and prefill_m_tiles("mma128", 2, 1) == 2


def test_supports() -> None:
    assert supports(128, torch.bfloat16) and supports(64, torch.float32) and supports(80, torch.float16)
    assert not supports(256, torch.float16) and not supports(128, torch.float64)


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
