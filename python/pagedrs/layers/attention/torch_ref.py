"""Reference paged attention in plain PyTorch (any device). It defines the semantics the CUDA kernels are
tested against.

Per step: K/V of the new tokens are written into their slots; then every request's queries attend to its
own context, read back from the cache through its block table. Single-token queries (decodes) are batched:
grouped by context length, each group goes through one padded gather into reused buffers, a length (and
window) mask and one batched matmul per KV head. Longer queries (prefill chunks) are handled one request
at a time, a short loop since a step holds few of them; a chunk with nothing cached before it attends to
its own k/v directly.

On CPU in float32 the decodes instead go through the fused Rust kernel `pagedrs._core.paged_decode_attention`,
which reads K/V in place through the block tables (no gather copy); PAGEDRS_CPU_KERNELS=0 (or
`TorchAttentionBackend(use_cpu_kernels=False)`) keeps the pure-torch path, which stays the reference.
With `batch_invariant` every query token goes through that kernel, prefill chunks included: a token's
attention is then the same arithmetic whatever chunk, batch or step it is computed in.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from pagedrs import _core
from pagedrs.config import FP8_MAX, as_bytes
from pagedrs.layers.attention import AttentionMetadata, sink_softmax, soft_capped_attention
from pagedrs.layers.attention.support import kernel_takes

__all__ = ["TorchAttentionBackend", "gather_kv", "step_plan", "write_kv_cache"]


def to_cache_dtype(x: Tensor, dtype: torch.dtype) -> Tensor:
    """x in the cache's element type; an fp8 cache saturates at its largest finite value (a plain cast would
    give NaN for e4m3) with a per-tensor scale of 1.0."""
    limit = FP8_MAX.get(dtype)
    if limit is None:
        return x.to(dtype)
    return x.float().clamp(-limit, limit).to(dtype)


def write_kv_cache(k: Tensor, v: Tensor, kv_cache: Tensor, slot_mapping: Tensor) -> None:
    """Store k/v [T,KVH,D] at their slots of kv_cache [2, num_blocks, block_size, KVH, D]."""
    _, num_blocks, block_size, kvh, d = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, kvh, d)
    # as bytes: index_copy_ has no fp8 kernel
    flat = as_bytes(flat)
    flat[0].index_copy_(0, slot_mapping, as_bytes(to_cache_dtype(k, kv_cache.dtype)))
    flat[1].index_copy_(0, slot_mapping, as_bytes(to_cache_dtype(v, kv_cache.dtype)))


def gather_kv(kv_cache: Tensor, block_table: Tensor, num_positions: int) -> tuple[Tensor, Tensor]:
    """K and V of positions 0..num_positions-1 through a block table.

    block_table [M] gives [num_positions, KVH, D]; block_tables [B, M] gives [B, num_positions, KVH, D]
    (rows shorter than num_positions read padding blocks; the caller masks them)."""
    block_size = kv_cache.shape[2]
    num_blocks = -(-num_positions // block_size)
    blocks = block_table[..., :num_blocks].long()
    cache = as_bytes(kv_cache)  # fp8: index the bytes
    k = cache[0][blocks].view(kv_cache.dtype)  # [..., nb, bs, KVH, D]
    v = cache[1][blocks].view(kv_cache.dtype)
    shape = (*blocks.shape[:-1], num_blocks * block_size, *k.shape[-2:])
    return k.reshape(shape)[..., :num_positions, :, :], v.reshape(shape)[..., :num_positions, :, :]


# Threads of the Rust decode kernel: PAGEDRS_CPU_KERNEL_THREADS, else torch's intra-op thread count (the
# kernel runs on the Rust pool that stays warm between calls; measured on the 2-core CI machine, the
# default model at batch 1: 12.7 ms a step with 1 thread, 11.9 ms with 2).
_KERNEL_THREADS_ENV = os.environ.get("PAGEDRS_CPU_KERNEL_THREADS", "")


def cpu_kernel_threads() -> int:
    """Threads the Rust CPU decode-attention kernel runs on."""
    return int(_KERNEL_THREADS_ENV) if _KERNEL_THREADS_ENV.isdigit() else torch.get_num_threads()


# Decodes are grouped by context length so each group pads only to its own longest context: a group
# holds requests needing at least GROUP_FILL of its longest request's blocks, or at most GROUP_SLACK
# fewer (at most MAX_GROUPS groups).
GROUP_FILL = 0.75
GROUP_SLACK = 2
MAX_GROUPS = 8

# Queries of at most this many tokens over a cached context run as decodes (one per token), as a
# speculative verification must (its drafts bound it: num_speculative_tokens + 1 <= 33).
DECODE_LIKE_MAX_QUERY = 33


@dataclass
class _DecodeGroup:
    """Single-token queries batched together, padded to `num_blocks` blocks each."""

    token_idx: Tensor  # [Bd] flat token index of each decode
    blocks: Tensor  # [Bd * nb] int64: each decode's first nb blocks, flattened
    seq_lens: Tensor  # [Bd] int64
    num_blocks: int  # nb: blocks that cover the longest context of the group
    masks: dict[int | None, Tensor] = field(default_factory=dict)  # sliding window -> additive mask

    def mask(self, sliding_window: int | None, block_size: int, dtype: torch.dtype) -> Tensor:
        """[Bd, 1, nb*block_size] additive mask: 0 where a decode may attend, -inf elsewhere."""
        mask = self.masks.get(sliding_window)
        if mask is None or mask.dtype != dtype:
            k_pos = torch.arange(self.num_blocks * block_size, device=self.seq_lens.device)
            last = (self.seq_lens - 1)[:, None]  # the query's own position
            valid = k_pos[None, :] <= last
            if sliding_window is not None:
                valid &= k_pos[None, :] > last - sliding_window
            mask = torch.zeros(valid.shape, dtype=dtype, device=valid.device)
            mask.masked_fill_(~valid, float("-inf"))
            mask = mask[:, None, :]
            self.masks[sliding_window] = mask
        return mask


@dataclass
class _CpuDecodes:
    """Every single-token query of the step, as the Rust CPU kernel takes them (host arrays)."""

    token_idx: Tensor  # [Bd] int64 flat token index of each decode
    block_tables: np.ndarray  # [Bd, M] int32, C-contiguous
    seq_lens: np.ndarray  # [Bd] int32
    all_tokens: bool  # the decodes are exactly tokens 0..T-1 in order (no gather/scatter of q/out needed)


@dataclass
class _StepPlan:
    """How this step's requests split into batched decode groups and per-request prefills."""

    decode_groups: list[_DecodeGroup]
    prefills: list[tuple[int, int, int]]  # (request index, token start, token end)
    cpu_decodes: _CpuDecodes | None = None  # set when the block tables live on the CPU


def _group_bounds(num_blocks_desc: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) ranges over contexts sorted longest first."""
    bounds: list[tuple[int, int]] = []
    start, n = 0, len(num_blocks_desc)
    neg = -num_blocks_desc  # ascending, for searchsorted
    while start < n:
        if len(bounds) == MAX_GROUPS - 1:
            end = n
        else:
            longest = num_blocks_desc[start]
            threshold = min(GROUP_FILL * longest, longest - GROUP_SLACK)
            end = int(np.searchsorted(neg, -threshold, side="right"))
            end = max(end, start + 1)
        bounds.append((start, end))
        start = end
    return bounds


def step_plan(meta: AttentionMetadata, *, every_token: bool = False) -> _StepPlan:
    """The step's decodes (grouped, and as the Rust kernel takes them) and prefills; built once per step.
    `every_token` (batch invariance, on a CPU): every query token is a decode for the Rust kernel, prompt
    chunks included, and no torch decode groups are built."""
    # Built once per step and shared by every layer; keyed on the identity of the step's arrays in case a
    # caller refills one metadata object in place.
    key = (id(meta.query_start_loc_cpu), id(meta.seq_lens_cpu), id(meta.block_tables), every_token)
    cached = meta.cache.get("torch_ref_plan")
    if isinstance(cached, tuple) and cached[0] == key:
        return cached[1]
    qsl = np.asarray(meta.query_start_loc_cpu, dtype=np.int64)
    seq_lens = np.asarray(meta.seq_lens_cpu, dtype=np.int64)
    q_lens = qsl[1:] - qsl[:-1]
    # A short query over a cached context (a speculative verification: the last token and its drafts) is
    # computed as that many decodes, each token attending to its own prefix: the same arithmetic as
    # decoding the tokens one a step, so greedy speculation gives the ids plain decoding gives.
    as_decodes = (q_lens == 1) | ((q_lens > 1) & (q_lens <= DECODE_LIKE_MAX_QUERY) & (seq_lens > q_lens))
    if every_token:
        as_decodes = q_lens > 0
    if meta.key_limits is not None and len(meta.key_limit_reqs):  # a bidirectional chunk needs its mask
        as_decodes[np.asarray(meta.key_limit_reqs, dtype=np.int64)] = False
    device = meta.block_tables.device
    plan = _StepPlan([], [])
    dec = np.nonzero(as_decodes)[0]
    # One entry per decoded token: its flat index, its context length, its request's block-table row.
    if len(dec) and bool((q_lens[dec] == 1).all()):
        e_tok, e_len, e_row = qsl[dec], seq_lens[dec], dec
    else:
        n = q_lens[dec]
        e_row = np.repeat(dec, n)
        offset = np.arange(int(n.sum()), dtype=np.int64) - np.repeat(np.cumsum(n) - n, n)
        e_tok = qsl[e_row] + offset
        e_len = seq_lens[e_row] - q_lens[e_row] + offset + 1
    if len(dec) and device.type == "cpu":
        tables = meta.block_tables.numpy()
        all_tokens = len(e_tok) == qsl[-1] and len(dec) == len(qsl) - 1 and bool((q_lens == 1).all())
        plan.cpu_decodes = _CpuDecodes(
            token_idx=torch.from_numpy(e_tok),
            block_tables=np.ascontiguousarray(tables if all_tokens else tables[e_row], dtype=np.int32),
            seq_lens=np.ascontiguousarray(e_len, dtype=np.int32),
            all_tokens=bool(all_tokens),
        )
    if len(dec) and not every_token:
        nblocks = -(-e_len // meta.block_size)
        order = np.argsort(-nblocks, kind="stable")
        nblocks = nblocks[order]
        for start, end in _group_bounds(nblocks):
            sel = order[start:end]
            nb = int(nblocks[start])
            rows = meta.block_tables.index_select(0, torch.from_numpy(e_row[sel]).to(device))
            plan.decode_groups.append(
                _DecodeGroup(
                    token_idx=torch.from_numpy(e_tok[sel]).to(device),
                    blocks=rows[:, :nb].reshape(-1).long(),
                    seq_lens=torch.from_numpy(e_len[sel]).to(device),
                    num_blocks=nb,
                )
            )
    for b in np.nonzero((~as_decodes) & (q_lens > 0))[0].tolist():
        plan.prefills.append((b, int(qsl[b]), int(qsl[b + 1])))
    meta.cache["torch_ref_plan"] = (key, plan)
    return plan


def _window_mask(q_pos: Tensor, k_pos: Tensor, sliding_window: int | None) -> Tensor:
    """True where a query at q_pos may attend to a key at k_pos (causal, optionally windowed)."""
    rel = q_pos[..., :, None] - k_pos[..., None, :]
    mask = rel >= 0
    if sliding_window is not None:
        mask &= rel < sliding_window
    return mask


class TorchAttentionBackend:
    """Reference backend: gather through the block table, then scaled-dot-product attention."""

    name = "torch"

    def __init__(self, *, use_cpu_kernels: bool | None = None, batch_invariant: bool = False) -> None:
        # None: on unless the environment sets PAGEDRS_CPU_KERNELS=0.
        if use_cpu_kernels is None:
            use_cpu_kernels = os.environ.get("PAGEDRS_CPU_KERNELS", "1") != "0"
        # An extension built before the kernel existed lacks it: fall back to torch.
        self.use_cpu_kernels = use_cpu_kernels and hasattr(_core, "paged_decode_attention")
        if batch_invariant and not self.use_cpu_kernels:
            raise ValueError(
                "batch_invariant needs the CPU attention kernel, which PAGEDRS_CPU_KERNELS=0 turns off"
            )
        self.batch_invariant = batch_invariant
        self._buffers: dict[tuple[torch.device, torch.dtype, tuple[int, ...]], tuple[Tensor, Tensor]] = {}

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        kv_cache: Tensor,
        meta: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None,
        logits_soft_cap: float | None = None,
        sinks: Tensor | None = None,
    ) -> Tensor:
        """As `AttentionBackend.forward`; `sinks` [H]: a learned logit per head in every softmax's
        denominator (HF's eager gpt-oss attention)."""
        write_kv_cache(k, v, kv_cache, meta.slot_mapping)
        kernel = self._cpu_kernel_applies(q, kv_cache, logits_soft_cap, sinks is not None)
        if self.batch_invariant and not kernel:
            raise ValueError(
                f"batch_invariant needs float32 queries and a contiguous float32 KV cache on a CPU, and a "
                f"layer the CPU kernel takes, got {q.dtype} on {q.device}, a {kv_cache.dtype} cache and "
                f"logits_soft_cap={logits_soft_cap}"
            )
        plan = step_plan(meta, every_token=self.batch_invariant)
        out = torch.empty_like(q)
        if plan.cpu_decodes is not None and kernel:
            self._decode_cpu(
                q, kv_cache, plan.cpu_decodes, out, scale, sliding_window, logits_soft_cap, sinks
            )
        else:
            for group in plan.decode_groups:
                out[group.token_idx] = self._decode(
                    q, kv_cache, group, scale, sliding_window, logits_soft_cap, sinks
                )
        for b, start, end in plan.prefills:
            seq_len = meta.seq_lens_cpu[b]
            q_len = end - start
            if q_len == seq_len:
                # Nothing cached before this chunk: its own k/v are the whole context (as the cache holds
                # them: an fp8 cache's rounding is the same however the prompt was chunked).
                kb, vb = k[start:end], v[start:end]
                if kv_cache.dtype in FP8_MAX:
                    kb, vb = to_cache_dtype(kb, kv_cache.dtype), to_cache_dtype(vb, kv_cache.dtype)
            else:
                kb, vb = gather_kv(kv_cache, meta.block_tables[b], seq_len)
            limits = meta.key_limits[start:end] if meta.key_limits is not None else None
            out[start:end] = self._prefill(
                q[start:end], kb, vb, seq_len, scale, sliding_window, logits_soft_cap, sinks, limits
            )
        return out

    def _cpu_kernel_applies(
        self, q: Tensor, kv_cache: Tensor, logits_soft_cap: float | None, sinks: bool = False
    ) -> bool:
        return (
            self.use_cpu_kernels
            and kernel_takes(
                "cpu_decode", head_size=q.shape[-1], logits_soft_cap=logits_soft_cap, sinks=sinks
            )
            and q.device.type == "cpu"
            and q.dtype == torch.float32
            and kv_cache.dtype == torch.float32
            and kv_cache.is_contiguous()
        )

    @staticmethod
    def _decode_cpu(
        q: Tensor,
        kv_cache: Tensor,
        dec: _CpuDecodes,
        out: Tensor,
        scale: float,
        sliding_window: int | None,
        logits_soft_cap: float | None = None,
        sinks: Tensor | None = None,
    ) -> None:
        """All decodes in one call of the Rust kernel, reading K/V in place through the block tables."""
        if dec.all_tokens:
            qd = q.contiguous()
            od = out if out.is_contiguous() else torch.empty_like(qd)
        else:
            qd = q.index_select(0, dec.token_idx)
            od = torch.empty_like(qd)
        _core.paged_decode_attention(
            qd.numpy(),
            kv_cache.numpy(),
            dec.block_tables,
            dec.seq_lens,
            od.numpy(),
            scale,
            sliding_window,
            cpu_kernel_threads(),
            logits_soft_cap,
            sinks=None if sinks is None else sinks.detach().to(torch.float32).contiguous().numpy(),
        )
        if od is not out:
            out[dec.token_idx] = od

    @staticmethod
    def _prefill(
        q: Tensor,
        k: Tensor,
        v: Tensor,
        seq_len: int,
        scale: float,
        sliding_window: int | None,
        logits_soft_cap: float | None = None,
        sinks: Tensor | None = None,
        key_limits: Tensor | None = None,
    ) -> Tensor:
        """One request: q [Q,H,D] at positions seq_len-Q.., k/v [L,KVH,D] at positions 0..L-1.
        `key_limits` [Q]: each query's exclusive key limit (a bidirectional image's end) instead of its
        position + 1; the sliding window still bounds the keys behind it."""
        q_len = q.shape[0]
        k = k.to(q.dtype)
        v = v.to(q.dtype)
        gqa = q.shape[1] != k.shape[1]
        qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        if key_limits is not None:
            k_pos = torch.arange(seq_len, device=q.device)
            q_pos = k_pos[seq_len - q_len :]
            mask = k_pos[None, :] < key_limits[:, None]
            if sliding_window is not None:
                mask &= (q_pos[:, None] - k_pos[None, :]) < sliding_window
            if logits_soft_cap is not None or sinks is not None:
                o = soft_capped_attention(qh, kh, vh, mask, scale, logits_soft_cap, sinks)
            else:
                o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=gqa)
        elif logits_soft_cap is not None or sinks is not None:
            k_pos = torch.arange(seq_len, device=q.device)
            mask = _window_mask(k_pos[seq_len - q_len :], k_pos, sliding_window)
            o = soft_capped_attention(qh, kh, vh, mask, scale, logits_soft_cap, sinks)
        elif q_len == seq_len and (sliding_window is None or sliding_window >= seq_len):
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            k_pos = torch.arange(seq_len, device=q.device)
            mask = _window_mask(k_pos[seq_len - q_len :], k_pos, sliding_window)
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=gqa)
        return o.transpose(0, 1)

    def _scratch(self, kv_cache: Tensor, num_blocks: int) -> tuple[Tensor, Tensor]:
        """Two reusable [num_blocks, block_size, KVH, D] buffers for the decode gather (fresh large
        allocations cost page faults on every layer of every step)."""
        shape = tuple(kv_cache.shape[2:])
        key = (kv_cache.device, kv_cache.dtype, shape)
        bufs = self._buffers.get(key)
        if bufs is None or bufs[0].shape[0] < num_blocks:
            n = max(num_blocks, 2 * bufs[0].shape[0] if bufs is not None else 0)
            bufs = (
                torch.empty((n, *shape), dtype=kv_cache.dtype, device=kv_cache.device),
                torch.empty((n, *shape), dtype=kv_cache.dtype, device=kv_cache.device),
            )
            self._buffers[key] = bufs
        return bufs[0][:num_blocks], bufs[1][:num_blocks]

    def _decode(
        self,
        q: Tensor,
        kv_cache: Tensor,
        group: _DecodeGroup,
        scale: float,
        sliding_window: int | None,
        logits_soft_cap: float | None = None,
        sinks: Tensor | None = None,
    ) -> Tensor:
        """A group of single-token queries at once: padded gather [Bd, L] through the block tables + a length (and
        window) mask; per KV head one batched matmul, so K/V are never expanded or transposed in memory."""
        _, _, block_size, kvh, d = kv_cache.shape
        nb = group.num_blocks
        bd = group.token_idx.shape[0]
        kbuf, vbuf = self._scratch(kv_cache, bd * nb)
        cache = as_bytes(kv_cache)  # fp8: gather the bytes
        torch.index_select(cache[0], 0, group.blocks, out=as_bytes(kbuf))
        torch.index_select(cache[1], 0, group.blocks, out=as_bytes(vbuf))
        k = kbuf.view(bd, nb * block_size, kvh, d)
        v = vbuf.view(bd, nb * block_size, kvh, d)
        dtype = kv_cache.dtype
        if dtype in FP8_MAX:  # an fp8 cache is read back into the queries' dtype
            dtype = q.dtype
            k, v = k.to(dtype), v.to(dtype)
        qd = q.index_select(0, group.token_idx).to(dtype)  # [Bd, H, D]
        g = qd.shape[1] // kvh
        mask = group.mask(sliding_window, block_size, dtype)  # [Bd, 1, L]
        out = torch.empty(bd, kvh, g, d, dtype=dtype, device=q.device)
        for h in range(kvh):
            # [Bd, G, D] @ [Bd, D, L] (a strided view of the gather) -> scores [Bd, G, L]
            if logits_soft_cap is None:
                scores = torch.baddbmm(
                    mask, qd[:, h * g : (h + 1) * g], k[:, :, h].transpose(1, 2), alpha=scale
                )
            else:  # cap the scaled scores, then mask (HF's eager Gemma 2 attention)
                scores = torch.bmm(qd[:, h * g : (h + 1) * g], k[:, :, h].transpose(1, 2)) * scale
                scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap + mask
            head_sinks = None if sinks is None else sinks[h * g : (h + 1) * g]
            probs = sink_softmax(scores, head_sinks, head_dim=-2).to(dtype)
            torch.bmm(probs, v[:, :, h], out=out[:, h])
        return out.view(bd, kvh * g, d).to(q.dtype)
