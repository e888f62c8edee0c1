"""The CPU decode step's ops of Qwen3.5's hybrid layers (`models.cpu_decode`): the gated attention's q|gate,
k and v projections on the quantized matmuls and its output gate, and the linear-attention mixer (its
projections on the quantized matmuls and its recurrent step on the Rust delta-rule kernel).

Each step computes what its op's `run` computes on the module path, call for call (the same quantized matmul
kernel, the same torch ops on views of the same arrays), so the replay stays bit-identical to the modules.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from pagedrs import _core
from pagedrs.layers.quantized import QuantizedWeight
from pagedrs.models.layer_desc import GatedQKVProj, LinearAttention, OutputGate

__all__ = ["gated_qkv_step", "linear_attention_step", "output_gate_step", "quantized_plain"]

Step = Callable[[Any], None]  # a step over the replay's state (`cpu_decode._Replay`)


def quantized_plain(m: torch.nn.Module) -> QuantizedWeight | None:
    """A linear module's quantized weight when it has no bias and one rank's whole weight, else None."""
    w = getattr(m, "qweight", None)
    if not isinstance(w, QuantizedWeight) or getattr(m, "tp_size", 1) != 1:
        return None
    return None if getattr(m, "bias", None) is not None else w


def _matmul(m: torch.nn.Module, w: QuantizedWeight, x: np.ndarray) -> np.ndarray:
    """The module's output on rows x: its quantized matmul, or the module itself where it has hooks."""
    if m._forward_hooks or m._forward_pre_hooks:
        return np.asarray(m(torch.from_numpy(x)).numpy())
    return np.asarray(w.matmul_rows(x))


def gated_qkv_step(op: GatedQKVProj, fallback: Step) -> Step:
    """q|gate, k, v on the quantized matmuls (the op's module calls where a projection is not quantized)."""
    ws = [quantized_plain(m) for m in (op.q_proj, op.k_proj, op.v_proj)]
    if any(w is None for w in ws):
        return fallback
    qw, kw, vw = (w for w in ws if w is not None)
    hs = op.head_size

    def run(s: Any) -> None:
        t = s.x.shape[0]
        qg = _matmul(op.q_proj, qw, s.x).reshape(t, -1, 2 * hs)
        s.q = np.ascontiguousarray(qg[..., :hs]).reshape(t, -1)
        s.gate = np.ascontiguousarray(qg[..., hs:]).reshape(t, -1)
        s.k, s.v = _matmul(op.k_proj, kw, s.x), _matmul(op.v_proj, vw, s.x)

    return run


def output_gate_step(op: OutputGate) -> Step:
    def run(s: Any) -> None:
        assert s.gate is not None
        s.x = (torch.from_numpy(s.x) * torch.sigmoid(torch.from_numpy(s.gate))).numpy()

    return run


def linear_attention_step(op: LinearAttention) -> Step:
    """A Gated DeltaNet layer's decode rows as its module computes them on the quantized CPU path: the input
    projections on the quantized matmuls, the conv1d and delta-rule step on the Rust kernel in place on the
    rows' state slots (then the state copied to the snapshot slots of a row that completes a block), the gated
    norm (its module), the out projection. The module itself where a projection is not quantized, the layer
    does not take the kernel, it has hooks, or a row has several tokens (a speculative verification's)."""
    m: Any = op.module

    def module(s: Any) -> None:
        s.x = m(torch.from_numpy(s.x), s.ctx).numpy()

    projs = (m.in_proj_qkv, m.in_proj_z, m.in_proj_a, m.in_proj_b, m.out_proj)
    ws = [quantized_plain(p) for p in projs]
    if not getattr(m, "cpu_fused", False) or any(w is None for w in ws):
        return module
    qkv_w, z_w, a_w, b_w, out_w = (w for w in ws if w is not None)
    conv_w = m.conv1d.weight.detach()[:, 0].contiguous().numpy()
    a_log, dt_bias = m.A_log.detach().numpy(), m.dt_bias.detach().numpy()
    num_k, hv_dim, value_dim = m.num_k_heads, m.head_v_dim, m.value_dim

    def run(s: Any) -> None:
        rec = s.ctx.attn_metadata.recurrent
        x, t = s.x, s.x.shape[0]
        if (
            m._forward_hooks or m._forward_pre_hooks or len(rec.slots) != t
        ):  # hooks, or a row of several tokens
            module(s)
            return
        qkv, z = _matmul(m.in_proj_qkv, qkv_w, x), _matmul(m.in_proj_z, z_w, x)
        a, b = _matmul(m.in_proj_a, a_w, x), _matmul(m.in_proj_b, b_w, x)
        conv, ssm = rec.conv[m.index], rec.ssm[m.index]
        core = np.empty((t, value_dim), dtype=np.float32)
        slots = np.asarray(rec.slots, dtype=np.int64)
        _core.cpu_gated_delta_decode(
            qkv, a, b, slots, conv_w, a_log, dt_bias, conv.numpy(), ssm.numpy(), core, num_k
        )
        for slot, snaps in zip(rec.slots, rec.snapshots, strict=True):
            for _, snap in snaps:  # a decode that completes a block: its state after the step
                conv[snap], ssm[snap] = conv[slot], ssm[slot]
        gated = m.norm(torch.from_numpy(core).reshape(-1, hv_dim), torch.from_numpy(z).reshape(-1, hv_dim))
        s.x = _matmul(m.out_proj, out_w, np.ascontiguousarray(gated.reshape(t, value_dim).numpy()))

    return run
