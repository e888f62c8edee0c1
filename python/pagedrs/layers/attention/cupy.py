"""CUDA attention backend: the kernels of `cuda/` (through pagedrs.kernels) behind the AttentionBackend
protocol. Chosen by "auto" on CUDA when CuPy imports; the torch backend (torch_ref.py) defines the
semantics it is tested against.

Per layer and step: `reshape_and_cache` writes the new tokens' K/V into their slots, then one
`paged_attention` call runs the decode kernel (requests of up to DECODE_MAX_QUERY query tokens: decode
steps and speculative verifications, causal per query, split-K over long contexts) and, when some request
has more query tokens, the varlen prefill kernel. The launches depend only on host integers of the
metadata (max_query_len, max_seq_len, and the longest query the decode kernel takes: max_query_len itself
unless the step holds a longer chunk), so a decode step can be captured in a CUDA graph
(runner/cuda_graphs.py).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from pagedrs.config import FP8_MAX
from pagedrs.kernels import paged_attention, reshape_and_cache, supports
from pagedrs.kernels.attention_ops import DECODE_MAX_QUERY, PrefillImpl
from pagedrs.layers.attention import AttentionMetadata
from pagedrs.layers.attention.support import kernel_takes

__all__ = ["CupyAttentionBackend", "decode_query_len"]


class CupyAttentionBackend:
    """Paged attention with the pagedrs CUDA kernels (fp16, bf16, fp32; head sizes in
    pagedrs.kernels.HEAD_SIZES, soft-capped logits at SOFT_CAP_HEAD_SIZES; the cache in the model's dtype
    or fp8). `prefill_impl` forces the
    tensor-core prefill kernel ("mma", or one tile: "mma64" / "mma128") or the scalar one."""

    name = "cupy"

    def __init__(
        self, device: torch.device | str | None = None, *, prefill_impl: PrefillImpl = "auto"
    ) -> None:
        self.device = torch.device(device) if device is not None else None
        self.prefill_impl: PrefillImpl = prefill_impl

    @staticmethod
    def supports(head_size: int, dtype: torch.dtype) -> bool:
        return supports(head_size, dtype)

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
    ) -> Tensor:
        """q [T,H,D], k/v [T,KVH,D], kv_cache [2, num_blocks, block_size, KVH, D] -> [T,H,D]."""
        if not kernel_takes("cupy", head_size=q.shape[-1], logits_soft_cap=logits_soft_cap):
            raise ValueError(
                f"the CUDA attention kernels do not take head_size={q.shape[-1]} with "
                f"logits_soft_cap={logits_soft_cap} (the Attention module routes such layers to 'torch')"
            )
        if kv_cache.shape[2] != meta.block_size:
            raise ValueError(
                f"kv cache block size {kv_cache.shape[2]} != metadata block_size {meta.block_size}"
            )
        # The activations take the cache's dtype, unless it is fp8 (converted as K/V are written).
        dtype = q.dtype if kv_cache.dtype in FP8_MAX else kv_cache.dtype
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        return paged_attention(
            out,
            q,
            key_cache,
            value_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            scale=scale,
            sliding_window=sliding_window,
            max_query_len=meta.max_query_len,
            max_seq_len=meta.max_seq_len,
            max_decode_query_len=decode_query_len(meta),
            prefill_impl=self.prefill_impl,
            logits_soft_cap=logits_soft_cap,
        )


def decode_query_len(meta: AttentionMetadata) -> int:
    """The longest query of at most DECODE_MAX_QUERY tokens in the step (0: none), which bounds the decode
    kernel's grid and picks its instance (1: the one-token one, as a decode step beside prefill chunks):
    max_query_len when no request is longer (no host work), else found once per step from the host copy of
    query_start_loc and kept in meta.cache for the other layers."""
    if meta.max_query_len <= DECODE_MAX_QUERY:
        return meta.max_query_len
    cached = meta.cache.get("cupy_decode_query_len")
    if not isinstance(cached, int):
        q_lens = np.diff(np.asarray(meta.query_start_loc_cpu))
        short = q_lens[(q_lens >= 1) & (q_lens <= DECODE_MAX_QUERY)]
        cached = int(short.max()) if short.size else 0
        meta.cache["cupy_decode_query_len"] = cached
    return cached
