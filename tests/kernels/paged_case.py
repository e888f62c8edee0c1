"""Random paged-attention batches and a float64 dense reference, shared by tests/kernels (CPU emulator)
and tests/gpu (real kernels).

A case is a step of a varlen batch: request b has seq_lens[b] tokens of context after the step, the last
q_lens[b] of them new (their K/V written through slot_mapping), the rest already cached. Blocks are
assigned in a random order; block-table padding is 0 (like the scheduler's), slots past a request's
length hold random garbage that must never be read.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from pagedrs.layers.attention import AttentionMetadata

# Tolerances against the float64 reference (|out - ref| <= atol + rtol * |ref|), by dtype. fp16/bf16:
# inputs are rounded to the dtype first, softmax and accumulation are fp32, the tensor-core prefill also
# rounds P to the dtype (FlashAttention-2 does the same), and the output is rounded once.
TOLERANCES = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3e-2, 3e-2),
}


@dataclass
class PagedCase:
    q: Tensor  # [T, H, D]
    k: Tensor  # [T, KVH, D] new tokens
    v: Tensor
    kv_cache: Tensor  # [2, num_blocks, block_size, KVH, D], prefixes filled, new slots not yet written
    block_tables: Tensor  # [B, M] int32
    seq_lens: Tensor  # [B] int32
    query_start_loc: Tensor  # [B+1] int32
    slot_mapping: Tensor  # [T] int64
    q_lens: list[int]
    ctx_lens: list[int]
    block_size: int

    def meta(self) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping,
            query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens,
            block_tables=self.block_tables,
            query_start_loc_cpu=self.query_start_loc.tolist(),
            seq_lens_cpu=self.seq_lens.tolist(),
            max_query_len=max(self.q_lens, default=0),
            max_seq_len=max(self.ctx_lens, default=0),
            block_size=self.block_size,
            num_decode_tokens=sum(1 for n in self.q_lens if n == 1),
        )


def make_case(
    q_lens: Sequence[int],
    ctx_lens: Sequence[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    seed: int = 0,
    spare_blocks: int = 3,
    spare_columns: int = 2,
) -> PagedCase:
    assert len(q_lens) == len(ctx_lens) and all(c >= q for q, c in zip(q_lens, ctx_lens, strict=True))
    g = torch.Generator().manual_seed(seed)
    blocks_per_req = [math.ceil(c / block_size) for c in ctx_lens]
    num_blocks = sum(blocks_per_req) + spare_blocks
    order = torch.randperm(num_blocks, generator=g).tolist()
    width = max(blocks_per_req, default=0) + spare_columns
    tables = torch.zeros((len(q_lens), width), dtype=torch.int32)
    slots: list[int] = []
    next_block = 0
    for b, (q_len, ctx) in enumerate(zip(q_lens, ctx_lens, strict=True)):
        ids = order[next_block : next_block + blocks_per_req[b]]
        next_block += blocks_per_req[b]
        tables[b, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        slots += [ids[p // block_size] * block_size + p % block_size for p in range(ctx - q_len, ctx)]
    num_tokens = sum(q_lens)

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float32).to(dtype)

    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(list(q_lens), dtype=torch.int32), 0)
    return PagedCase(
        q=randn(num_tokens, num_heads, head_size).to(device),
        k=randn(num_tokens, num_kv_heads, head_size).to(device),
        v=randn(num_tokens, num_kv_heads, head_size).to(device),
        kv_cache=randn(2, num_blocks, block_size, num_kv_heads, head_size).to(device),
        block_tables=tables.to(device),
        seq_lens=torch.tensor(list(ctx_lens), dtype=torch.int32).to(device),
        query_start_loc=qsl.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64).to(device),
        q_lens=list(q_lens),
        ctx_lens=list(ctx_lens),
        block_size=block_size,
    )


def write_reference(case: PagedCase) -> Tensor:
    """The cache after the step's K/V writes (index_copy, like the torch backend)."""
    cache = case.kv_cache.clone()
    _, nb, bs, kvh, d = cache.shape
    flat = cache.view(2, nb * bs, kvh, d)
    keep = case.slot_mapping >= 0
    flat[0].index_copy_(0, case.slot_mapping[keep], case.k[keep])
    flat[1].index_copy_(0, case.slot_mapping[keep], case.v[keep])
    return cache


def run_paged_attention(
    case: PagedCase,
    kv_cache: Tensor,
    *,
    scale: float,
    window: int | None = None,
    impl: str = "auto",
    max_seq_len: int | None = None,
    max_decode_query_len: int | None = None,
    logits_soft_cap: float | None = None,
) -> Tensor:
    """`pagedrs.kernels.paged_attention` for the case's step over kv_cache [2, ...] (holding the step's
    K/V); out starts as NaN so an unwritten row shows. max_seq_len: an upper bound (CUDA graphs);
    max_decode_query_len: the longest query the decode kernel takes (default: the wrapper's)."""
    from pagedrs.kernels import paged_attention

    meta = case.meta()
    out = torch.full_like(case.q, float("nan"))
    paged_attention(
        out,
        case.q,
        kv_cache[0],
        kv_cache[1],
        case.block_tables,
        case.seq_lens,
        case.query_start_loc,
        scale=scale,
        sliding_window=window,
        max_query_len=meta.max_query_len,
        max_seq_len=max_seq_len or meta.max_seq_len,
        max_decode_query_len=max_decode_query_len,
        prefill_impl=impl,  # type: ignore[arg-type]
        logits_soft_cap=logits_soft_cap,
    )
    return out


def attention_reference(
    case: PagedCase,
    kv_cache: Tensor,
    *,
    scale: float,
    sliding_window: int | None,
    query_chunk: int = 256,
    logits_soft_cap: float | None = None,
) -> Tensor:
    """float64 paged attention over kv_cache (already holding the step's K/V), [T, H, D], computed on the
    cache's device, request by request, `query_chunk` queries at a time; scores soft-capped as HF's Gemma 2
    (``cap * tanh(s / cap)``) when logits_soft_cap is given."""
    dev = kv_cache.device
    q = case.q.to(dev, torch.float64)
    cache = kv_cache.double()
    tables = case.block_tables.to(dev)
    num_tokens, num_heads, head_size = q.shape
    kvh = cache.shape[3]
    group = num_heads // kvh
    bs = case.block_size
    out = torch.zeros((num_tokens, num_heads, head_size), dtype=torch.float64, device=dev)
    start = 0
    for b, (q_len, ctx) in enumerate(zip(case.q_lens, case.ctx_lens, strict=True)):
        if ctx == 0:
            start += q_len
            continue
        pos = torch.arange(ctx, device=dev)
        blocks = tables[b, pos // bs].long()
        k = cache[0, blocks, pos % bs].repeat_interleave(group, dim=1)  # [ctx, H, D]
        v = cache[1, blocks, pos % bs].repeat_interleave(group, dim=1)
        for c0 in range(0, q_len, query_chunk):
            c1 = min(q_len, c0 + query_chunk)
            scores = torch.einsum("qhd,khd->hqk", q[start + c0 : start + c1], k) * scale
            if logits_soft_cap is not None:
                scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
            q_pos = torch.arange(ctx - q_len + c0, ctx - q_len + c1, device=dev)
            rel = q_pos[:, None] - pos[None, :]
            mask = rel >= 0
            if sliding_window:
                mask &= rel < sliding_window
            scores.masked_fill_(~mask[None], float("-inf"))
            out[start + c0 : start + c1] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        start += q_len
    return out


def assert_close(actual: Tensor, expected: Tensor, dtype: torch.dtype, what: str = "") -> None:
    atol, rtol = TOLERANCES[dtype]
    a = actual.double().cpu()
    e = expected.double().cpu()
    err = (a - e).abs()
    bad = err > atol + rtol * e.abs()
    if bool(bad.any()) or not bool(torch.isfinite(a).all()):
        idx = tuple(int(i) for i in torch.nonzero(bad | ~torch.isfinite(a))[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {a.numel()} elements off (max abs err {float(err.max()):.3g}, "
            f"first at {idx}: {float(a[idx]):.6g} vs {float(e[idx]):.6g}; atol {atol}, rtol {rtol})"
        )
