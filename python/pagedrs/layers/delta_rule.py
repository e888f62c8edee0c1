"""The gated delta rule and the causal depthwise conv1d of Gated DeltaNet layers, in torch (float32), as HF
transformers' torch fallbacks compute them (`torch_chunk_gated_delta_rule`, `torch_recurrent_gated_delta_rule`,
`causal_conv1d_fn` / `causal_conv1d_update`).

Per value head the state S [k_dim, v_dim] evolves token by token: S = S * exp(g); S += k (beta (v - S^T k))^T;
the output is S^T q, with q and k L2-normalised and q scaled by k_dim^-0.5. The chunked form computes the same
in chunks of 64 tokens (a triangular solve within a chunk, one state update per chunk) for prefill; the
recurrent form steps one token at a time for decode. On the quantized CPU path a decode step (the conv update
and one step of the rule, in place on the state pools) is one Rust call (`cpu_gated_delta_decode`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from pagedrs import _core

__all__ = [
    "causal_conv1d",
    "causal_conv1d_update",
    "chunk_gated_delta_rule",
    "chunk_gated_delta_rule_states",
    "cpu_gated_delta_decode",
    "recurrent_gated_delta_rule",
]

CHUNK = 64


def causal_conv1d(x: Tensor, weight: Tensor, state: Tensor | None) -> Tensor:
    """x [L, C] through a causal depthwise conv1d (weight [C, K], no bias) then SiLU -> [L, C]. `state`
    [C, K - 1]: the inputs before x (None: zeros); updated in place to the last K - 1 inputs."""
    n, c = x.shape
    k = weight.shape[1]
    prev = torch.zeros(c, k - 1, dtype=x.dtype, device=x.device) if state is None else state.to(x.dtype)
    xs = torch.cat([prev, x.t()], dim=-1)  # [C, K - 1 + L]
    if state is not None:
        state.copy_(xs[:, -(k - 1) :])
    out = F.conv1d(xs[None], weight[:, None, :].to(x.dtype), groups=c)[0]  # [C, L]
    return F.silu(out.t())


def causal_conv1d_update(x: Tensor, weight: Tensor, state: Tensor) -> Tensor:
    """One token per sequence: x [B, C] after each sequence's window `state` [B, C, K - 1] through the conv1d
    (weight [C, K]) then SiLU -> [B, C]; `state` is updated in place to the last K - 1 inputs."""
    window = torch.cat([state.to(x.dtype), x[..., None]], dim=-1)  # [B, C, K]
    state.copy_(window[..., 1:])
    return F.silu((window * weight.to(x.dtype)).sum(-1))


def _l2norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def _prepare(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """[B, L, H, D] inputs -> [B, Hv, L, D] float32, q/k repeated to the value heads, normalised, q scaled."""
    hk, hv = k.shape[2], v.shape[2]
    if hk != hv:
        q = q.repeat_interleave(hv // hk, dim=2)
        k = k.repeat_interleave(hv // hk, dim=2)
    q, k, v, beta, g = (x.transpose(1, 2).to(torch.float32).contiguous() for x in (q, k, v, beta, g))
    q, k = _l2norm(q), _l2norm(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def recurrent_gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor | None
) -> tuple[Tensor, Tensor]:
    """q/k [B, L, Hk, Dk], v [B, L, Hv, Dv], g/beta [B, L, Hv]; state [B, Hv, Dk, Dv] (None: zeros) ->
    (out [B, L, Hv, Dv], final state), token by token, all B sequences at once (a decode step's rows)."""
    dtype = q.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    b, h, n, dk = k.shape
    s = (
        torch.zeros(b, h, dk, v.shape[-1], dtype=torch.float32, device=v.device)
        if state is None
        else state.float()
    )
    out = torch.empty_like(v)
    decay = g.exp()
    for i in range(n):
        s = s * decay[:, :, i, None, None]
        kt = k[:, :, i, None, :]  # [B, H, 1, Dk]
        delta = (v[:, :, i, None] - kt @ s) * beta[:, :, i, None, None]  # [B, H, 1, Dv]
        s = s + kt.transpose(-1, -2) @ delta
        out[:, :, i] = (q[:, :, i, None, :] @ s)[:, :, 0]
    return out.transpose(1, 2).contiguous().to(dtype), s


def chunk_gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor | None
) -> tuple[Tensor, Tensor]:
    """As `recurrent_gated_delta_rule`, in chunks of `CHUNK` tokens (the WY form of the delta rule)."""
    out, s, _ = chunk_gated_delta_rule_states(q, k, v, g, beta, state, ())
    return out, s


def chunk_gated_delta_rule_states(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor | None, capture: Sequence[int]
) -> tuple[Tensor, Tensor, list[Tensor]]:
    """As `chunk_gated_delta_rule`, also returning the state right after each token index in `capture`
    (ascending), taken inside the chunk that holds it: the chunk's start state decayed to that token plus the
    decayed updates of the chunk's tokens up to it (one product per captured token, no re-chunking)."""
    dtype = q.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    b, h, n, dk = k.shape
    dv = v.shape[-1]
    pad = (CHUNK - n % CHUNK) % CHUNK
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    c = (n + pad) // CHUNK
    v_beta = (v * beta[..., None]).reshape(b, h, c, CHUNK, dv)
    k_beta = (k * beta[..., None]).reshape(b, h, c, CHUNK, dk)
    q, k = q.reshape(b, h, c, CHUNK, dk), k.reshape(b, h, c, CHUNK, dk)
    cum = g.reshape(b, h, c, CHUNK).cumsum(-1)
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * decay
    intra = (q @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    s = torch.zeros(b, h, dk, dv, dtype=torch.float32, device=v.device) if state is None else state.float()
    out = torch.empty_like(u)
    q = q * cum.exp()[..., None]
    k_end = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]
    wanted: dict[int, list[int]] = {}
    for t in capture:
        wanted.setdefault(t // CHUNK, []).append(t % CHUNK)
    states: list[Tensor] = []
    for i in range(c):
        v_new = u[:, :, i] - w[:, :, i] @ s
        out[:, :, i] = q[:, :, i] @ s + intra[:, :, i] @ v_new
        for j in wanted.get(i, []):
            to_j = (cum[:, :, i, j, None] - cum[:, :, i, : j + 1]).exp()[..., None]  # [B, H, j + 1, 1]
            upd = (k[:, :, i, : j + 1] * to_j).transpose(-1, -2) @ v_new[:, :, : j + 1]
            states.append(s * cum[:, :, i, j].exp()[..., None, None] + upd)
        s = s * chunk_decay[:, :, i] + k_end[:, :, i].transpose(-1, -2) @ v_new
    out = out.reshape(b, h, -1, dv)[:, :, :n]
    return out.transpose(1, 2).contiguous().to(dtype), s, states


def cpu_gated_delta_decode(
    qkv: Tensor,
    a: Tensor,
    b: Tensor,
    conv_weight: Tensor,
    a_log: Tensor,
    dt_bias: Tensor,
    conv: Tensor,
    ssm: Tensor,
    slots: Tensor,
    num_k_heads: int,
) -> Tensor:
    """One token per row on the Rust kernel: `causal_conv1d_update` then `recurrent_gated_delta_rule` with the
    gates g = -exp(a_log) * softplus(a + dt_bias), beta = sigmoid(b), each row's state at its slot (int64
    `slots` [B]) of the pools `conv` [S, C, K - 1] and `ssm` [S, Hv, Dk, Dv], updated in place. qkv [B, C]
    (the projection's [q | k | v]), a/b [B, Hv], conv_weight [C, K]; float32 CPU tensors -> [B, Hv * Dv]."""
    n, hv, dv = qkv.shape[0], ssm.shape[1], ssm.shape[3]
    out = np.empty((n, hv * dv), dtype=np.float32)

    def arr(t: Tensor) -> np.ndarray:
        return t.detach().contiguous().numpy()

    _core.cpu_gated_delta_decode(
        arr(qkv),
        arr(a),
        arr(b),
        arr(slots),
        arr(conv_weight),
        arr(a_log),
        arr(dt_bias),
        conv.detach().numpy(),
        ssm.detach().numpy(),
        out,
        num_k_heads,
    )
    return torch.from_numpy(out)
