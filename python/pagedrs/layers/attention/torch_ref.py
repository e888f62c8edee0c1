"""Reference paged attention in plain PyTorch (any device). It defines the semantics the CUDA kernels are
tested against.

Per step: K/V of the new tokens are written into their slots; then every request's queries attend to its
own context, read back from the cache through its block table. Single-token queries (decodes) are batched
together through one padded gather and a length mask; longer queries (prefill chunks) are handled one
request at a time, which is a short loop since a step holds few of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from pagedrs.layers.attention import AttentionMetadata

__all__ = ["TorchAttentionBackend", "write_kv_cache", "gather_kv"]


def write_kv_cache(k: Tensor, v: Tensor, kv_cache: Tensor, slot_mapping: Tensor) -> None:
    """Store k/v [T,KVH,D] at their slots of kv_cache [2, num_blocks, block_size, KVH, D]."""
    _, num_blocks, block_size, kvh, d = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, kvh, d)
    flat[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def gather_kv(kv_cache: Tensor, block_table: Tensor, num_positions: int) -> tuple[Tensor, Tensor]:
    """K and V of positions 0..num_positions-1 through a block table.

    block_table [M] gives [num_positions, KVH, D]; block_tables [B, M] gives [B, num_positions, KVH, D]
    (rows shorter than num_positions read padding blocks; the caller masks them)."""
    block_size = kv_cache.shape[2]
    num_blocks = -(-num_positions // block_size)
    blocks = block_table[..., :num_blocks].long()
    k = kv_cache[0][blocks]  # [..., nb, bs, KVH, D]
    v = kv_cache[1][blocks]
    shape = (*blocks.shape[:-1], num_blocks * block_size, *k.shape[-2:])
    return k.reshape(shape)[..., :num_positions, :, :], v.reshape(shape)[..., :num_positions, :, :]


@dataclass
class _StepPlan:
    """How this step's requests split into the batched decode path and the per-request prefill path."""

    decode_token_idx: Tensor | None  # [Bd] flat token index of each decode
    decode_block_tables: Tensor | None  # [Bd, M]
    decode_seq_lens: Tensor | None  # [Bd] int64
    decode_max_len: int
    prefills: list[tuple[int, int, int]]  # (request index, token start, token end)


def _plan(meta: AttentionMetadata) -> _StepPlan:
    # Built once per step and shared by every layer; keyed on the identity of the step's arrays in case a
    # caller refills one metadata object in place.
    key = (id(meta.query_start_loc_cpu), id(meta.seq_lens_cpu), id(meta.block_tables))
    cached = meta.cache.get("torch_ref_plan")
    if isinstance(cached, tuple) and cached[0] == key:
        return cached[1]
    qsl = np.asarray(meta.query_start_loc_cpu, dtype=np.int64)
    seq_lens = np.asarray(meta.seq_lens_cpu, dtype=np.int64)
    q_lens = qsl[1:] - qsl[:-1]
    is_decode = q_lens == 1
    dec = np.nonzero(is_decode)[0]
    device = meta.block_tables.device
    if len(dec):
        dec_t = torch.from_numpy(dec).to(device)
        plan = _StepPlan(
            decode_token_idx=torch.from_numpy(qsl[dec]).to(device),
            decode_block_tables=meta.block_tables.index_select(0, dec_t),
            decode_seq_lens=torch.from_numpy(seq_lens[dec]).to(device),
            decode_max_len=int(seq_lens[dec].max()),
            prefills=[],
        )
    else:
        plan = _StepPlan(None, None, None, 0, [])
    for b in np.nonzero((~is_decode) & (q_lens > 0))[0].tolist():
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
    ) -> Tensor:
        write_kv_cache(k, v, kv_cache, meta.slot_mapping)
        plan = _plan(meta)
        out = torch.empty_like(q)
        if plan.decode_token_idx is not None:
            out[plan.decode_token_idx] = self._decode(q, kv_cache, plan, scale, sliding_window)
        for b, start, end in plan.prefills:
            seq_len = meta.seq_lens_cpu[b]
            q_len = end - start
            if q_len == seq_len:
                # Nothing cached before this chunk: its own k/v are the whole context.
                kb, vb = k[start:end], v[start:end]
            else:
                kb, vb = gather_kv(kv_cache, meta.block_tables[b], seq_len)
            out[start:end] = self._prefill(q[start:end], kb, vb, seq_len, scale, sliding_window)
        return out

    @staticmethod
    def _prefill(
        q: Tensor, k: Tensor, v: Tensor, seq_len: int, scale: float, sliding_window: int | None
    ) -> Tensor:
        """One request: q [Q,H,D] at positions seq_len-Q.., k/v [L,KVH,D] at positions 0..L-1."""
        q_len = q.shape[0]
        k = k.to(q.dtype)
        v = v.to(q.dtype)
        gqa = q.shape[1] != k.shape[1]
        qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        if q_len == seq_len and (sliding_window is None or sliding_window >= seq_len):
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            k_pos = torch.arange(seq_len, device=q.device)
            mask = _window_mask(k_pos[seq_len - q_len :], k_pos, sliding_window)
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=gqa)
        return o.transpose(0, 1)

    @staticmethod
    def _decode(
        q: Tensor, kv_cache: Tensor, plan: _StepPlan, scale: float, sliding_window: int | None
    ) -> Tensor:
        """All single-token queries at once: padded gather [Bd, Lmax] + a length (and window) mask."""
        assert plan.decode_token_idx is not None and plan.decode_block_tables is not None
        assert plan.decode_seq_lens is not None
        max_len = plan.decode_max_len
        kd, vd = gather_kv(kv_cache, plan.decode_block_tables, max_len)  # [Bd, L, KVH, D]
        qd = q[plan.decode_token_idx]  # [Bd, H, D]
        bd, h, d = qd.shape
        kvh = kd.shape[2]
        g = h // kvh
        k_pos = torch.arange(max_len, device=q.device)
        last = (plan.decode_seq_lens - 1)[:, None]  # the query's own position
        valid = k_pos[None, :] <= last
        if sliding_window is not None:
            valid &= k_pos[None, :] > last - sliding_window
        # [Bd, KVH, G, D] @ [Bd, KVH, D, L] -> [Bd, KVH, G, L]: GQA without expanding K/V.
        qg = qd.view(bd, kvh, g, d).float()
        scores = torch.matmul(qg, kd.permute(0, 2, 3, 1).float()) * scale
        scores.masked_fill_(~valid[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o = torch.matmul(probs, vd.permute(0, 2, 1, 3).float())  # [Bd, KVH, G, D]
        return o.reshape(bd, h, d).to(q.dtype)
