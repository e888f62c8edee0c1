"""Attention over the paged KV cache: step metadata, the per-forward context, the backend protocol and the
`Attention` module every model uses.

KV cache layout (one tensor per layer): ``[2, num_blocks, block_size, num_kv_heads, head_size]``,
index 0 = K, 1 = V. Token slot ``s`` lives at block ``s // block_size``, offset ``s % block_size``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "Attention",
    "AttentionBackend",
    "AttentionMetadata",
    "ForwardContext",
    "RecurrentRows",
    "causal_attention",
    "get_attention_backend",
    "sink_softmax",
    "soft_capped_attention",
    "token_seq_lens",
]


@dataclass
class RecurrentRows:
    """One step's view of the state: each batch row's slot, and whether it starts from a zeroed state."""

    conv: Tensor  # [linear layers, slots, conv_dim, kernel - 1]
    ssm: Tensor  # [linear layers, slots, value heads, key head dim, value head dim]
    slots: list[int]
    # per row: (index of a token in the row, snapshot slot) to copy the state to once that token is computed
    snapshots: list[list[tuple[int, int]]]


@dataclass
class AttentionMetadata:
    """Where the tokens of one flattened varlen batch go and what they attend to.

    Request ``b`` owns tokens ``query_start_loc[b]:query_start_loc[b+1]``; its context after this step is
    ``seq_lens[b]`` tokens, so its query ``i`` sits at position ``seq_lens[b] - q_len + i``.
    """

    slot_mapping: Tensor  # [T] int64 on device
    query_start_loc: Tensor  # [B+1] int32 on device
    seq_lens: Tensor  # [B] int32 on device
    block_tables: Tensor  # [B, M] int32 on device, padded (seq_lens bounds the reads)
    query_start_loc_cpu: Sequence[int] | np.ndarray  # host copies (the plan's numpy arrays, or lists)
    seq_lens_cpu: Sequence[int] | np.ndarray
    max_query_len: int
    max_seq_len: int
    block_size: int
    # No ordering guarantee between decodes and prefills: backends must not assume decodes come first.
    num_decode_tokens: int = 0
    # Per-backend scratch (index tensors built once per step and shared by every layer).
    cache: dict[str, object] = field(default_factory=dict, repr=False, compare=False)
    # The sliding-window layers' KV-cache groups (pools of their own), by window: the layers whose window is
    # a key read and write through that metadata's slot mapping and block tables instead (`runner.kv_groups`).
    groups: dict[int, AttentionMetadata] = field(default_factory=dict, repr=False, compare=False)
    group_window: int | None = None
    # The linear-attention layers' recurrent state of this step (`runner.recurrent` fills it).
    recurrent: RecurrentRows | None = field(default=None, repr=False, compare=False)
    # [T] int64 on device, or None: each query's exclusive key-position limit where it is not position + 1
    # (a model's bidirectional image tokens see their whole image: `CausalLM.mm_bidirectional`).
    key_limits: Tensor | None = field(default=None, repr=False, compare=False)
    key_limit_reqs: Sequence[int] = field(
        default=(), repr=False, compare=False
    )  # the rows key_limits changes

    def for_window(self, window: int | None) -> AttentionMetadata:
        """The metadata of the layers with this sliding window: their group's, else this one."""
        return self.groups.get(window, self) if window is not None and self.groups else self

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc_cpu[-1])


@runtime_checkable
class AttentionBackend(Protocol):
    name: str

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
        """q [T,H,D], k/v [T,KVH,D]: write k/v at meta.slot_mapping, then paged causal attention
        (scores capped as ``cap * tanh(s / cap)`` when `logits_soft_cap` is set, as Gemma 2). A layer with
        attention sinks passes ``sinks=`` [H] as well, only to a backend whose kernels take them
        (`support.kernel_takes`; the torch reference does).

        Returns [T,H,D]."""
        ...


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata | None  # None: no KV cache (profiling) -> plain causal attention
    kv_caches: list[Tensor]  # per layer [2, num_blocks, block_size, num_kv_heads, head_size]
    backend: AttentionBackend | None = None
    # Run only the first `exit_layer` decoder layers, then the final norm (self-drafting by early exit).
    exit_layer: int | None = None


def get_attention_backend(
    name: str, device: torch.device | str, *, batch_invariant: bool = False
) -> AttentionBackend:
    """Re-exported from `selector` (imported lazily to keep this module dependency-free)."""
    from pagedrs.layers.attention.selector import get_attention_backend as _get

    return _get(name, device, batch_invariant=batch_invariant)


def token_seq_lens(meta: AttentionMetadata) -> Tensor:
    """Per token, the context length of its request after this step ([T], int64, on device)."""
    cached = meta.cache.get("token_seq_lens")
    if cached is None:
        q_lens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]
        cached = torch.repeat_interleave(meta.seq_lens.long(), q_lens.long(), output_size=meta.num_tokens)
        meta.cache["token_seq_lens"] = cached
    assert isinstance(cached, Tensor)
    return cached


def soft_capped_attention(
    qh: Tensor,
    kh: Tensor,
    vh: Tensor,
    mask: Tensor,
    scale: float,
    cap: float | None,
    sinks: Tensor | None = None,
) -> Tensor:
    """qh [H,Q,D], kh/vh [KVH,L,D], mask [Q,L] bool (True: attend) -> [H,Q,D], with the scores capped as
    HF's eager Gemma 2 attention does: ``cap * tanh(q.k * scale / cap)``, masked, softmax in float32.
    `sinks` [H]: a learned logit per head joins each softmax's denominator and is dropped from its
    numerator (HF's eager gpt-oss attention)."""
    g = qh.shape[0] // kh.shape[0]
    if g > 1:
        kh, vh = kh.repeat_interleave(g, dim=0), vh.repeat_interleave(g, dim=0)
    scores = torch.matmul(qh, kh.transpose(1, 2)) * scale
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(sink_softmax(scores, sinks).to(qh.dtype), vh)


def sink_softmax(scores: Tensor, sinks: Tensor | None, head_dim: int = -3) -> Tensor:
    """softmax over the last dim in float32; with `sinks` (one logit per head, the heads at `head_dim` of
    `scores`) the sink joins the denominator and is dropped after, as HF's eager gpt-oss attention."""
    if sinks is None:
        return torch.softmax(scores, dim=-1, dtype=torch.float32)
    shape = [1] * scores.dim()
    shape[head_dim] = -1
    sink = sinks.to(scores.dtype).view(shape).expand(*scores.shape[:-1], 1)
    combined = torch.cat([scores, sink], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    return torch.softmax(combined, dim=-1, dtype=torch.float32)[..., :-1]


def causal_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float,
    sliding_window: int | None,
    logits_soft_cap: float | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Plain causal attention of one sequence with no cache: q [T,H,D], k/v [T,KVH,D] -> [T,H,D]."""
    t = q.shape[0]
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    gqa = q.shape[1] != k.shape[1]
    if logits_soft_cap is not None or sinks is not None:
        i = torch.arange(t, device=q.device)
        rel = i[:, None] - i[None, :]
        mask = (rel >= 0) & (rel < (sliding_window or t + 1))
        return soft_capped_attention(qh, kh, vh, mask, scale, logits_soft_cap, sinks).transpose(0, 1)
    if sliding_window is None or sliding_window >= t:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        i = torch.arange(t, device=q.device)
        rel = i[:, None] - i[None, :]
        mask = (rel >= 0) & (rel < sliding_window)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out.transpose(0, 1)


class Attention(torch.nn.Module):
    """Multi-head / grouped-query attention of one layer over its slice of the paged KV cache.

    With tensor parallelism each rank builds this with its own share of the heads; the cache holds only
    those KV heads, so the block tables are identical on every rank.

    `scale` multiplies q.k (head_size**-0.5, or Gemma's query_pre_attn_scalar**-0.5); `logits_soft_cap`
    caps the scaled scores as Gemma 2 does; `sinks` (True) gives the layer a learned logit per head
    (`self.sinks` [num_heads], loaded by the model) that joins every softmax's denominator, as gpt-oss.
    `kv_layer` (default `layer_idx`): the layer whose cache slice it reads and writes; a layer sharing
    another's KV (Gemma 4's last layers) names that layer and is given that layer's k/v, so its write
    stores the values already there.
    A layer the step's backend has no kernel for (see `support.kernel_takes`) runs on the torch
    reference backend instead.
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        num_kv_heads: int,
        layer_idx: int,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        sinks: bool = False,
        kv_layer: int | None = None,
    ) -> None:
        super().__init__()
        if logits_soft_cap is not None and logits_soft_cap <= 0:
            raise ValueError(f"logits_soft_cap must be positive, got {logits_soft_cap}")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.layer_idx = layer_idx
        self.kv_layer = layer_idx if kv_layer is None else kv_layer
        self.scale = scale
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.sinks: torch.nn.Parameter | None = None
        if sinks:
            self.sinks = torch.nn.Parameter(torch.zeros(num_heads, dtype=torch.float32), requires_grad=False)
        # (the step's backend, the backend this layer runs on): resolved once per backend object
        self._route: tuple[AttentionBackend, AttentionBackend] | None = None

    def _backend_for(self, backend: AttentionBackend) -> AttentionBackend:
        route = self._route
        if route is None or route[0] is not backend:
            from pagedrs.layers.attention.selector import route_layer

            route = (
                backend,
                route_layer(backend, self.head_size, self.logits_soft_cap, sinks=self.sinks is not None),
            )
            self._route = route
        return route[1]

    def forward(self, q: Tensor, k: Tensor, v: Tensor, ctx: ForwardContext) -> Tensor:
        """q [T, H*D], k/v [T, KVH*D] -> [T, H*D]."""
        t = q.shape[0]
        q3 = q.view(t, self.num_heads, self.head_size)
        k3 = k.view(t, self.num_kv_heads, self.head_size)
        v3 = v.view(t, self.num_kv_heads, self.head_size)
        meta = ctx.attn_metadata
        if meta is None:
            out = causal_attention(
                q3,
                k3,
                v3,
                scale=self.scale,
                sliding_window=self.sliding_window,
                logits_soft_cap=self.logits_soft_cap,
                sinks=self.sinks,
            )
        else:
            if ctx.backend is None:
                raise ValueError("ForwardContext.backend is required when attn_metadata is given")
            # only a backend that takes sinks gets the keyword (route_layer routes the others' layers away)
            extra = {} if self.sinks is None else {"sinks": self.sinks}
            meta = meta.for_window(self.sliding_window)
            out = self._backend_for(ctx.backend).forward(
                q3,
                k3,
                v3,
                ctx.kv_caches[self.kv_layer],
                meta,
                scale=self.scale,
                sliding_window=self.sliding_window,
                logits_soft_cap=self.logits_soft_cap,
                **extra,
            )
        return out.reshape(t, self.num_heads * self.head_size)

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, head_size={self.head_size}, "
            f"sliding_window={self.sliding_window}, scale={self.scale:.4g}, "
            f"logits_soft_cap={self.logits_soft_cap}, sinks={self.sinks is not None}"
        )
