"""The CPU decode step's ops of Qwen3.5's hybrid layers (`models.cpu_decode`): the gated attention's q|gate,
k and v projections on the quantized matmuls and its output gate, and the linear-attention mixer.

Each step computes what its op's `run` computes on the module path, call for call (the same quantized matmul
kernel, the same torch ops on views of the same arrays), so the replay stays bit-identical to the modules.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

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
    """The mixer called as on the module path (its decode rows take the Rust delta-rule step on CPU)."""
    m = op.module

    def run(s: Any) -> None:
        s.x = m(torch.from_numpy(s.x), s.ctx).numpy()

    return run
