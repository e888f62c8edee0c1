"""Launch wrappers for cuda/paged_attention.cu: decode (split-K + reduction) and varlen prefill.

`paged_attention` runs one flattened varlen batch: the decode kernel takes the requests whose query is at
most `max_decode_query_len` tokens (a decode step, or a speculative verification of k drafts: k + 1
tokens; at most DECODE_MAX_QUERY), a prefill kernel the longer ones (each kernel skips the other's
requests on the device, so the host needs no per-request split and the launch sequence depends only on
host integers: CUDA-graph safe).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from pagedrs.kernels._launch import Launch, launch, ptr
from pagedrs.kernels._loader import (
    CACHE_CTYPES,
    CTYPES,
    GROUP_SIZES,
    HEAD_SIZES,
    SOFT_CAP_HEAD_SIZES,
    attention_names,
    decode_name,
    fp8_write_name,
    prefill_mma_tiles,
    prefill_name,
    reduce_name,
)

__all__ = [
    "DECODE_MAX_QUERY",
    "PrefillImpl",
    "decode_partitions",
    "decode_smem_bytes",
    "launch_fp8_write",
    "paged_attention",
    "prefill_m_tiles",
    "prefill_smem_bytes",
    "scalar_prefill_smem_bytes",
    "supports",
]

_SOURCE = "paged_attention"
_THREADS = (128, 1, 1)
_LOG2E = 1.4426950408889634
_SCALAR_ROWS = 16  # query rows (token x head) per scalar prefill CTA; the mma one takes 64 * m_tiles
_MAX_PARTITION, _MIN_PARTITION = 512, 64  # keys per decode partition (split-K)
# Longest query the decode kernel takes. Its CTA holds at most 8 (query, head) rows (GROUP_SIZES: the
# accumulators and logits of 8 rows fill its registers and shared memory), so a request of q_len queries
# takes ceil(q_len * G / 8) CTAs per kv head and partition, each reading the partition's K/V: cheap next to
# split-K's parallelism over a long context while that is a few CTAs (q_len <= 16: at most 2 * G), and
# covering speculative verification (k <= 15 drafts). Longer chunks read K/V once per 64 or 128 rows in the
# tensor-core prefill kernel instead.
DECODE_MAX_QUERY = 16
# "mma": tensor cores, tile chosen by prefill_m_tiles; "mma64" / "mma128": that many rows per CTA
PrefillImpl = Literal["auto", "mma", "mma64", "mma128", "scalar"]


def prefill_m_tiles(impl: PrefillImpl, max_query_len: int, group: int, head_size: int = 128) -> int:
    """m16 tiles per warp of the tensor-core prefill: 2 (128-row CTAs, each K/V fragment feeds two mma)
    once a request brings 128 query rows (tokens x group), else 1 (64-row CTAs waste less on short
    chunks); always 1 where the head size has no 128-row tile (`prefill_mma_tiles`)."""
    tiles = prefill_mma_tiles(head_size)
    if impl == "mma128" and 2 not in tiles:
        raise ValueError(f"prefill_impl 'mma128' has no tile for head_size={head_size}; use 'mma64'")
    if impl == "mma64" or 2 not in tiles:
        return 1
    if impl == "mma128":
        return 2
    return 2 if max_query_len * group >= 128 else 1


def prefill_smem_bytes(head_size: int, m_tiles: int) -> int:
    """Dynamic shared memory of paged_attention_prefill<T, head_size, m_tiles> (its header comment)."""
    q_smem = (m_tiles == 2 and head_size > 64) or head_size > 128
    row, keys = head_size + 8, 32 if q_smem else 64
    q_rows = 64 * m_tiles if q_smem else 0
    return 2 * (q_rows + 2 * keys) * row + 4 * (8 + 2 * keys)


def scalar_prefill_smem_bytes(head_size: int) -> int:
    """Dynamic shared memory of paged_attention_prefill_scalar<T, head_size> (its header comment)."""
    return 4 * (_SCALAR_ROWS * head_size + 2 * 32 * (head_size + 1)) + 32


def supports(
    head_size: int, dtype: torch.dtype, cache_dtype: torch.dtype | None = None, *, soft_cap: bool = False
) -> bool:
    """Whether the kernels are instantiated for this head size and dtype (and cache dtype: the same, or
    an fp8 type; and with `soft_cap`, logit soft-capping: head sizes SOFT_CAP_HEAD_SIZES)."""
    ok = head_size in (SOFT_CAP_HEAD_SIZES if soft_cap else HEAD_SIZES) and _name(dtype) in CTYPES
    return ok and (cache_dtype is None or cache_dtype == dtype or _name(cache_dtype) in CACHE_CTYPES)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _cache_ctype(cache_dtype: torch.dtype, dtype: torch.dtype) -> str | None:
    """The kernels' C for a cache of `cache_dtype` holding K/V of `dtype` (None: C = T)."""
    if cache_dtype == dtype:
        return None
    ctype = CACHE_CTYPES.get(_name(cache_dtype))
    if ctype is None:
        raise ValueError(
            f"a {cache_dtype} cache cannot hold {dtype} K/V: the cache takes the model's dtype or an fp8 type"
        )
    return ctype


def launch_fp8_write(
    key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor
) -> None:
    """The converting cache write for an fp8 cache (the kernel lives with the attention kernels of its
    dtype and head size); `cache_ops.reshape_and_cache` checks the arguments and calls this."""
    _, _, kvh, d = key_cache.shape
    if _name(key.dtype) not in CTYPES or d not in HEAD_SIZES:
        raise ValueError(f"no fp8 cache write for dtype={key.dtype}, head_size={d}")
    cache_ctype = _cache_ctype(key_cache.dtype, key.dtype)
    assert cache_ctype is not None
    ctype = CTYPES[_name(key.dtype)]
    row = kvh * d
    launch(
        Launch(
            _SOURCE,
            attention_names(ctype, d, cache_ctype),
            fp8_write_name(ctype, cache_ctype),
            (key.shape[0], 1, 1),
            (min(256, -(-row // 32) * 32), 1, 1),
            0,
            (
                ptr(key),
                ptr(value),
                ptr(key_cache),
                ptr(value_cache),
                ptr(slot_mapping),
                np.int64(key.stride(0)),
                np.int64(value.stride(0)),
                np.int32(row),
            ),
        ),
        key_cache.device,
    )


@functools.cache
def _device_info(device: torch.device) -> tuple[int, int]:
    """(SM count, compute capability major*10+minor); a CPU (emulator) poses as an sm_90 with 132 SMs."""
    if device.type != "cuda":
        return 132, 90
    props = torch.cuda.get_device_properties(device)
    return props.multi_processor_count, props.major * 10 + props.minor


def decode_partitions(num_ctas: int, max_span: int, num_sms: int) -> tuple[int, int]:
    """(partition_size, max_parts) for the decode kernel. max_span bounds the keys a decode request's
    queries read (max_seq_len, or the sliding window plus the queries after the first). Partitions of up to 512 keys (a power of two), halved (down to
    64) while the grid would not fill the device twice: few requests with short contexts still spread
    over the SMs. One partition (sized to the span) when that already fills the device."""
    size = min(_MAX_PARTITION, 1 << max(6, math.ceil(math.log2(max(max_span, 1)))))
    while size > _MIN_PARTITION and num_ctas * math.ceil(max_span / size) < 2 * num_sms:
        size //= 2
    parts = math.ceil(max_span / size)
    if parts == 1:
        return max(64, -(-max_span // 64) * 64), 1
    return size, parts


def decode_rows(group: int, max_query: int) -> tuple[int, int]:
    """(rows per CTA, CTAs per kv head) of the decode kernel for requests of up to max_query queries: the
    max_query * group (query, head) rows of a (request, kv head) in CTAs of the smallest GROUP_SIZES entry
    holding them all, else of the largest. With max_query 1: the group's heads, as a decode step."""
    rows = max(max_query, 1) * group
    gp = next((g for g in GROUP_SIZES if g >= rows), GROUP_SIZES[-1])
    return gp, -(-rows // gp)


def decode_smem_bytes(head_size: int, group: int, partition_size: int, *, multi_query: bool = False) -> int:
    """Dynamic shared memory of paged_attention_decode<T, head_size, group> (its header comment; group is
    the rows per CTA); the multi-query instance adds 4 words a row."""
    logits = max(group * partition_size, 4 * group * head_size)
    return 4 * (group * head_size + logits + (6 if multi_query else 2) * group + partition_size)


def _check(name: str, t: Tensor, dtype: torch.dtype, dims: int, device: torch.device) -> None:
    if t.dtype != dtype or t.dim() != dims:
        raise ValueError(f"{name} must be a {dims}-d {dtype} tensor, got {t.dim()}-d {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")


@dataclass(frozen=True)
class _Shapes:
    """What the checks found, for the launches."""

    num_tokens: int
    num_heads: int
    head_size: int
    block_size: int
    num_kv_heads: int
    num_seqs: int
    cache_ctype: str | None


def _check_args(
    out: Tensor,
    q: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
) -> _Shapes:
    """Every shape, dtype, device, contiguity and size rule of `paged_attention`, as ValueErrors."""
    device = q.device
    if q.dim() != 3:
        raise ValueError(f"q must be [T, H, D], got {tuple(q.shape)}")
    num_tokens, num_heads, head_size = q.shape
    if key_cache.dim() != 4 or not key_cache.is_contiguous() or not value_cache.is_contiguous():
        raise ValueError("key/value caches must be contiguous [num_blocks, block_size, KVH, D]")
    if value_cache.shape != key_cache.shape:
        raise ValueError(f"value_cache {tuple(value_cache.shape)} != key_cache {tuple(key_cache.shape)}")
    _, block_size, num_kv_heads, cache_head = key_cache.shape
    if cache_head != head_size or num_heads % num_kv_heads:
        raise ValueError(
            f"q [T, {num_heads}, {head_size}] does not fit a cache of {num_kv_heads} kv heads "
            f"of size {cache_head}"
        )
    if not supports(head_size, q.dtype):
        raise ValueError(
            f"no paged attention kernel for head_size={head_size}, dtype={q.dtype}; "
            f"head sizes {HEAD_SIZES}, dtypes float16/bfloat16/float32"
        )
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if key_cache.shape[0] * block_size >= 2**31:  # the kernels keep slot numbers in 32-bit ints
        raise ValueError(f"a pool of {key_cache.shape[0]} blocks x {block_size} slots exceeds 2^31 slots")
    cache_ctype = _cache_ctype(key_cache.dtype, q.dtype)
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        _check(name, t, key_cache.dtype, t.dim(), device)
    _check("out", out, q.dtype, out.dim(), device)
    if out.shape != q.shape or not out.is_contiguous() or out.data_ptr() % 4:
        raise ValueError(
            f"out must be contiguous and 4-byte aligned {tuple(q.shape)}, got {tuple(out.shape)}"
        )
    _check("block_tables", block_tables, torch.int32, 2, device)
    _check("seq_lens", seq_lens, torch.int32, 1, device)
    _check("query_start_loc", query_start_loc, torch.int32, 1, device)
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_seqs + 1 or block_tables.shape[0] < num_seqs:
        raise ValueError(f"query_start_loc must be [{num_seqs + 1}] and block_tables [>={num_seqs}, M]")
    if not (seq_lens.is_contiguous() and query_start_loc.is_contiguous()) or block_tables.stride(1) != 1:
        raise ValueError("seq_lens, query_start_loc and block_tables rows must be contiguous")
    return _Shapes(num_tokens, num_heads, head_size, block_size, num_kv_heads, num_seqs, cache_ctype)


def paged_attention(
    out: Tensor,
    q: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    *,
    scale: float,
    sliding_window: int | None,
    max_query_len: int,
    max_seq_len: int,
    max_decode_query_len: int | None = None,
    prefill_impl: PrefillImpl = "auto",
    logits_soft_cap: float | None = None,
) -> Tensor:
    """out[t] = attention of query q[t] over its request's cached keys/values.

    out, q [T, H, D]; key_cache, value_cache [num_blocks, block_size, KVH, D] in q's dtype or an fp8 type
    (widened to q's dtype as it is read); block_tables [B, M] int32;
    seq_lens [B] int32; query_start_loc [B+1] int32 (all on one device). max_query_len and max_seq_len are
    upper bounds (a CUDA graph passes its capacity); the kernels read the true lengths on the device.
    Requests of 1..max_decode_query_len queries go to the decode kernel (split-K, causal per query), longer
    ones to a prefill kernel, launched one after the other; each skips the other's requests on the device.
    max_decode_query_len (0..DECODE_MAX_QUERY; default min(max_query_len, DECODE_MAX_QUERY)) sizes the
    decode grid: pass the longest such query of the step (1 for a decode step) to keep the grid tight when
    the step also holds long prefill chunks. logits_soft_cap: the scaled scores s become
    ``cap * tanh(s / cap)`` before the softmax (HF's Gemma 2 attention soft-capping)."""
    shapes = _check_args(out, q, key_cache, value_cache, block_tables, seq_lens, query_start_loc)
    if logits_soft_cap is not None and not (0 < logits_soft_cap < math.inf):
        raise ValueError(f"logits_soft_cap must be a positive finite number, got {logits_soft_cap}")
    if logits_soft_cap is not None and shapes.head_size not in SOFT_CAP_HEAD_SIZES:
        raise ValueError(
            f"no soft-capping attention kernel for head_size={shapes.head_size}; head sizes {SOFT_CAP_HEAD_SIZES}"
        )
    if max_decode_query_len is None:
        max_decode_query_len = min(max_query_len, DECODE_MAX_QUERY)
    if not 0 <= max_decode_query_len <= DECODE_MAX_QUERY:
        raise ValueError(
            f"max_decode_query_len must be in [0, {DECODE_MAX_QUERY}], got {max_decode_query_len}"
        )
    if (
        q.stride(2) != 1
        or q.stride(1) != shapes.head_size
        or (q.stride(0) * q.element_size()) % 16
        or q.data_ptr() % 16
    ):
        q = q.contiguous()
    if shapes.num_tokens == 0 or shapes.num_seqs == 0:
        return out
    ctype = CTYPES[_name(q.dtype)]
    window = sliding_window if sliding_window is not None and sliding_window > 0 else 0
    launch_args = _LaunchArgs(
        shapes=shapes,
        ctype=ctype,
        names=attention_names(
            ctype, shapes.head_size, shapes.cache_ctype, soft_cap=logits_soft_cap is not None
        ),
        window=window,
        # with a cap the kernels take logits q.k * scale / cap, then cap * log2(e) * tanh(.)
        scale_log2=np.float32(scale / logits_soft_cap if logits_soft_cap else scale * _LOG2E),
        soft_cap_log2=np.float32(logits_soft_cap * _LOG2E if logits_soft_cap else 0.0),
        block_shift=np.int32(shapes.block_size.bit_length() - 1),
        max_decode_query=max_decode_query_len,
        common=(
            ptr(key_cache),
            ptr(value_cache),
            ptr(block_tables),
            np.int32(block_tables.stride(0)),
            ptr(seq_lens),
            ptr(query_start_loc),
        ),
    )
    if max_decode_query_len > 0:
        _launch_decode(launch_args, out, q, seq_lens, query_start_loc, max_seq_len)
    if max_query_len > max_decode_query_len:
        _launch_prefill(launch_args, out, q, max_query_len, prefill_impl)
    return out


@dataclass(frozen=True)
class _LaunchArgs:
    """What the decode and prefill launches share."""

    shapes: _Shapes
    ctype: str
    names: Any
    window: int
    scale_log2: np.float32
    soft_cap_log2: np.float32  # cap * log2(e), read by the soft-capping instances only

    @property
    def soft_cap(self) -> bool:
        return bool(self.soft_cap_log2 > 0)

    block_shift: np.int32
    max_decode_query: int  # requests of 1..this many queries are the decode kernel's, longer ones prefill's
    common: tuple[Any, ...]  # caches, block tables (and row stride), seq_lens, query_start_loc


def _launch_decode(
    a: _LaunchArgs, out: Tensor, q: Tensor, seq_lens: Tensor, query_start_loc: Tensor, max_seq_len: int
) -> None:
    """Decode: every request (the ones longer than a.max_decode_query exit at once), each (request, kv
    head)'s (query, head) rows in CTAs of up to 8, split into partitions of the context when there are too
    few CTAs to fill the SMs, then reduced per query. With max_decode_query 1 the launches are those of a
    one-token decode step (what a CUDA graph captures), on the kernels' one-token instances (MQ false);
    past 1 on the multi-query ones. Long because of the two launches' argument lists, one argument per
    line."""
    sh, device = a.shapes, q.device
    num_sms, _ = _device_info(device)
    max_query = a.max_decode_query
    multi_query = max_query > 1
    gp, chunks = decode_rows(sh.num_heads // sh.num_kv_heads, max_query)
    # a request's queries read keys from the first one's window edge to the last one's position
    max_span = min(max_seq_len, a.window + max_query - 1) if a.window else max_seq_len
    part, max_parts = decode_partitions(sh.num_seqs * sh.num_kv_heads * chunks, max(max_span, 1), num_sms)
    if max_parts > 1:
        # one scratch row per decode query (decode_tmp_row in the kernel): a request's, or with several
        # queries min(T, B * max_query)
        rows = min(sh.num_tokens, sh.num_seqs * max_query) if multi_query else sh.num_seqs
        tmp_out = torch.empty(
            (rows, sh.num_heads, max_parts, sh.head_size), dtype=torch.float32, device=device
        )
        stats = torch.empty((2, rows, sh.num_heads, max_parts), dtype=torch.float32, device=device)
        tmp_args = (ptr(tmp_out), ptr(stats[0]), ptr(stats[1]))
    else:
        tmp_args = (ptr(out), ptr(out), ptr(out))  # unused by the single-partition path
    launch(
        Launch(
            _SOURCE,
            a.names,
            decode_name(
                a.ctype, sh.head_size, gp, sh.cache_ctype, multi_query=multi_query, soft_cap=a.soft_cap
            ),
            (sh.num_seqs, sh.num_kv_heads * chunks, max_parts),
            _THREADS,
            decode_smem_bytes(sh.head_size, gp, part, multi_query=multi_query),
            (
                ptr(out),
                *tmp_args,
                ptr(q),
                np.int64(q.stride(0)),
                *a.common,
                np.int32(sh.num_heads),
                np.int32(sh.num_kv_heads),
                a.block_shift,
                np.int32(a.window),
                a.scale_log2,
                np.int32(part),
                np.int32(max_parts),
                np.int32(max_query),
                a.soft_cap_log2,
            ),
        ),
        device,
    )
    if max_parts > 1:
        launch(
            Launch(
                _SOURCE,
                a.names,
                reduce_name(a.ctype, sh.head_size, multi_query=multi_query),
                (sh.num_seqs, sh.num_heads, max_query),
                _THREADS,
                4 * (max_parts + 4),
                (
                    ptr(out),
                    *tmp_args,
                    ptr(seq_lens),
                    ptr(query_start_loc),
                    np.int32(sh.num_heads),
                    np.int32(a.window),
                    np.int32(part),
                    np.int32(max_parts),
                    np.int32(max_query),
                ),
            ),
            device,
        )


def _launch_prefill(
    a: _LaunchArgs, out: Tensor, q: Tensor, max_query_len: int, prefill_impl: PrefillImpl
) -> None:
    """Prefill: requests with q_len > a.max_decode_query; the grid is an upper bound on their row tiles.
    Tensor-core (mma) tiles on sm80+ for half types, the scalar kernel otherwise."""
    sh, device = a.shapes, q.device
    _, arch = _device_info(device)
    group = sh.num_heads // sh.num_kv_heads
    mma = prefill_impl.startswith("mma") or (prefill_impl == "auto" and a.ctype != "float" and arch >= 80)
    if mma and a.ctype == "float":
        raise ValueError("the tensor-core prefill kernel takes float16/bfloat16 queries only")
    m_tiles = prefill_m_tiles(prefill_impl, max_query_len, group, sh.head_size) if mma else 1
    assert m_tiles in prefill_mma_tiles(sh.head_size)
    if mma:
        rows, smem = 64 * m_tiles, prefill_smem_bytes(sh.head_size, m_tiles)
    else:
        rows, smem = _SCALAR_ROWS, scalar_prefill_smem_bytes(sh.head_size)
    tiles = -(-sh.num_tokens * group // rows) + sh.num_seqs
    launch(
        Launch(
            _SOURCE,
            a.names,
            prefill_name(
                a.ctype,
                sh.head_size,
                mma=mma,
                cache_ctype=sh.cache_ctype,
                m_tiles=m_tiles,
                soft_cap=a.soft_cap,
            ),
            (tiles, sh.num_kv_heads, 1),
            _THREADS,
            smem,
            (
                ptr(out),
                ptr(q),
                np.int64(q.stride(0)),
                *a.common,
                np.int32(sh.num_seqs),
                np.int32(sh.num_heads),
                np.int32(sh.num_kv_heads),
                a.block_shift,
                np.int32(a.window),
                a.scale_log2,
                np.int32(a.max_decode_query),
                a.soft_cap_log2,
            ),
        ),
        device,
    )
