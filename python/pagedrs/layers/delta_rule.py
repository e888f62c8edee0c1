"""The gated delta rule and the causal depthwise conv1d of Gated DeltaNet layers, in torch (float32), as HF
transformers' torch fallbacks compute them (`torch_chunk_gated_delta_rule`, `torch_recurrent_gated_delta_rule`,
`causal_conv1d_fn` / `causal_conv1d_update`).

Per value head the state S [k_dim, v_dim] evolves token by token: S = S * exp(g); S += k (beta (v - S^T k))^T;
the output is S^T q, with q and k L2-normalised and q scaled by k_dim^-0.5. The chunked form computes the same
in chunks of 64 tokens (a triangular solve within a chunk, one state update per chunk) for prefill; the
recurrent form steps one token at a time for decode.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["causal_conv1d", "chunk_gated_delta_rule", "recurrent_gated_delta_rule"]

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
    (out [B, L, Hv, Dv], final state), token by token."""
    dtype = q.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    b, h, n, dk = k.shape
    s = (
        torch.zeros(b, h, dk, v.shape[-1], dtype=torch.float32, device=v.device)
        if state is None
        else state.float()
    )
    out = torch.zeros_like(v)
    for i in range(n):
        s = s * g[:, :, i].exp()[..., None, None]
        kt = k[:, :, i]
        delta = (v[:, :, i] - (s * kt[..., None]).sum(-2)) * beta[:, :, i, None]
        s = s + kt[..., None] * delta[..., None, :]
        out[:, :, i] = (s * q[:, :, i, :, None]).sum(-2)
    return out.transpose(1, 2).contiguous().to(dtype), s


def chunk_gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor | None
) -> tuple[Tensor, Tensor]:
    """As `recurrent_gated_delta_rule`, in chunks of `CHUNK` tokens (the WY form of the delta rule)."""
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
    out = torch.zeros_like(u)
    q = q * cum.exp()[..., None]
    k = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]
    for i in range(c):
        v_new = u[:, :, i] - w[:, :, i] @ s
        out[:, :, i] = q[:, :, i] @ s + intra[:, :, i] @ v_new
        s = s * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    out = out.reshape(b, h, -1, dv)[:, :, :n]
    return out.transpose(1, 2).contiguous().to(dtype), s
