"""A naive dense causal attention (float64, explicit loops): the reference the paged attention tests
(test_torch_ref_attention.py, test_fp8_kv_cache.py) compare against."""

from __future__ import annotations

import torch


def naive_attention(q, k, v, q_start: int, scale: float, window: int | None, soft_cap: float | None = None):
    """q [Q,H,D] at positions q_start.., k/v [L,KVH,D] at 0..L-1 -> [Q,H,D], float64, explicit loops;
    `soft_cap`: scores capped as cap * tanh(s / cap) (Gemma 2)."""
    h, kvh = q.shape[1], k.shape[1]
    g = h // kvh
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i in range(q.shape[0]):
        p = q_start + i
        lo = 0 if window is None else max(0, p - window + 1)
        for head in range(h):
            kk = k[lo : p + 1, head // g].double()
            vv = v[lo : p + 1, head // g].double()
            s = (kk @ q[i, head].double()) * scale
            if soft_cap is not None:
                s = torch.tanh(s / soft_cap) * soft_cap
            out[i, head] = torch.softmax(s, 0) @ vv
    return out
