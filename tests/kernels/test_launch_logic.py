"""Host-side launch logic, no GPU and no emulator: split-K partitioning, shared-memory budgets,
argument validation, CUDA-graph capture sizes."""

from __future__ import annotations

import math

import pytest
import torch

from pagedrs.kernels import HEAD_SIZES, decode_partitions, paged_attention, reshape_and_cache, supports
from pagedrs.kernels._loader import GROUP_SIZES
from pagedrs.worker.cuda_graphs import default_capture_sizes

_SMEM_LIMIT = 48 * 1024  # without opting in to more dynamic shared memory


@pytest.mark.parametrize("num_ctas", [1, 8, 64, 2048])
@pytest.mark.parametrize("span", [1, 63, 512, 513, 4096, 32768, 131072])
def test_decode_partitions_cover_the_context(num_ctas: int, span: int) -> None:
    size, parts = decode_partitions(num_ctas, span, num_sms=132)
    assert size * parts >= span and size * (parts - 1) < span  # no partition is empty at the longest span
    assert 64 <= size <= 512
    if span <= 512:
        assert parts == 1
    else:
        assert size >= 128 and parts == math.ceil(span / size)


def test_few_ctas_get_smaller_partitions() -> None:
    assert decode_partitions(8, 4096, num_sms=132)[0] < decode_partitions(4096, 4096, num_sms=132)[0]


@pytest.mark.parametrize("head_size", HEAD_SIZES)
def test_shared_memory_fits_without_opt_in(head_size: int) -> None:
    for gp in GROUP_SIZES:
        for part in (64, 128, 256, 512):
            assert 4 * (gp * head_size + max(gp * part, 4 * gp * head_size) + 2 * gp) <= _SMEM_LIMIT
    assert 2 * 64 * (head_size + 8) * 2 + 32 <= _SMEM_LIMIT  # tensor-core prefill
    assert 4 * (16 * head_size + 2 * 32 * (head_size + 1)) + 32 <= _SMEM_LIMIT  # scalar prefill


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
