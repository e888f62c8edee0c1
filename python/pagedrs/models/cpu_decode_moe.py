"""The mixture-of-experts MLP inside the CPU decode step (`cpu_decode.CpuDecodeStep`), op for op as
`SparseMoeBlock.forward` runs it on one rank: the router's matmul (with its bias: gpt-oss), `route` (softmax
then top-k for Mixtral and Qwen, top-k then softmax for gpt-oss), the experts module's own step (on a
CPU the fused experts kernel `cpu_fused_experts`, with gpt-oss's expert biases and clamped SwiGLU as the
module passes them), and the shared expert with its sigmoid gate (Qwen2-MoE)."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F

from pagedrs import _core
from pagedrs.layers.activation import SiluAndMul
from pagedrs.layers.moe import SparseMoeBlock, route
from pagedrs.layers.quantized import QuantizedWeight

__all__ = ["moe_forward", "moe_why_not"]

F32 = npt.NDArray[np.float32]


def moe_why_not(block: SparseMoeBlock) -> str | None:
    """Why an MoE block cannot run inside the fast step, or None when it can."""
    if block.tp.size != 1:
        return "a mixture of experts split over tensor-parallel ranks"
    ex = block.experts
    if not ex.method.cpu_kernel:
        return "the experts are not float32 or quantized for the CPU kernel"
    shared = block.shared_expert
    if shared is not None:
        if not (isinstance(shared.act_fn, SiluAndMul) and shared.act_fn.cpu_fused):
            return "the shared expert's activation is not the fused SiLU-and-mul"
        linears = (shared.gate_up_proj, shared.down_proj)
        if any(not isinstance(lin.qweight, QuantizedWeight) or lin.bias is not None for lin in linears):
            return "the shared expert is not quantized without biases"
    return None


def moe_forward(block: SparseMoeBlock, hidden: F32) -> F32:
    """The block's forward on rows `hidden` (one rank, no hooks: checked by the step), op for op as
    `SparseMoeBlock.forward`: the router's matmul, `route`, the fused experts kernel, the shared expert
    (quantized matmuls, SiLU-and-mul) scaled by its sigmoid gate."""
    x = torch.from_numpy(hidden)
    g = block.gate
    logits = g.qweight.matmul(x, g.bias) if g.qweight is not None else F.linear(x, g.weight, g.bias)
    topk_weights, topk_ids = route(logits, block.routing)
    # the experts module's own step (one rank, no hooks): on a CPU the fused experts kernel
    # (`cpu_fused_experts`) with the biases and activation the module passes it
    out = block.experts(x, topk_weights, topk_ids)
    shared = block.shared_expert
    if shared is None:
        return out.numpy()
    up = shared.gate_up_proj.qweight
    down = shared.down_proj.qweight
    assert isinstance(up, QuantizedWeight) and isinstance(down, QuantizedWeight)  # checked by moe_why_not
    gate_up = up.matmul_rows(hidden)
    a = np.empty((hidden.shape[0], gate_up.shape[1] // 2), dtype=np.float32)
    _core.cpu_silu_and_mul(gate_up, a)
    s = torch.from_numpy(down.matmul_rows(a))
    sg = block.shared_expert_gate
    if sg is not None:
        gl = sg.qweight.matmul(x, sg.bias) if sg.qweight is not None else F.linear(x, sg.weight, sg.bias)
        s = torch.sigmoid(gl) * s
    return (out + s).numpy()
