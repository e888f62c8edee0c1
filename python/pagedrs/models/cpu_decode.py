"""The Llama family's decode step on a CPU with the weights kept quantized: every op of every layer one
Rust call on numpy views, no torch module in between.

A batch-1 decode step of the default model runs 30 layers of about ten ops each; through the torch modules
each op also pays a module call, its dispatch checks and tensor wrapping, which together cost about as
much as the matmuls themselves (cProfile of `LLMEngine.step` at one row, 1 thread). llama.cpp avoids this
with a graph built once and replayed; this is the same idea for the one case it matters most in: a step of
decodes only (one token a request, or a speculative verification's few), float32 activations, GGUF
weights in their block layout, one rank. A linear module's forward hooks (LoRA's deltas) run after its
matmul, on torch views of the same arrays, as the module would run them.

The arithmetic is the module path's, op for op and call for call (the same Rust kernels in the same
order: RMSNorm with the residual add fused in, the quantized matmuls, neox rotary in place, the K/V
store, the paged decode-attention kernel, SiLU-and-mul), so the hidden states are bit-identical to it
(tests/models/test_cpu_decode.py). Per-head q/k RMSNorm (Qwen3) is the same Rust norm over each head;
q/k/v and o biases and attention sinks (gpt-oss: the decode kernel folds each head's sink into its
softmax, as the attention module's decodes do) are taken as the modules take them. Sliding-window layers
read and write their own KV pool where the runner gives them one (`runner.kv_groups`), as the attention
module does. A mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss: `SparseMoeBlock`) runs
inside the step as its module would (`cpu_decode_moe`). Any other step, or a model outside that case,
takes the modules.
`PAGEDRS_CPU_DECODE=0` turns the fast path off.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor

from pagedrs import _core
from pagedrs.layers.activation import SiluAndMul
from pagedrs.layers.attention import AttentionMetadata, ForwardContext
from pagedrs.layers.attention.torch_ref import TorchAttentionBackend, cpu_kernel_threads, step_plan
from pagedrs.layers.device_form import DeviceForm, PrepareOptions
from pagedrs.layers.moe import SparseMoeBlock
from pagedrs.layers.quantized import QuantizedWeight
from pagedrs.models.cpu_decode_moe import moe_forward, moe_why_not

if TYPE_CHECKING:
    from pagedrs.models.llama import LlamaDecoderLayer, LlamaMLP, LlamaModel

__all__ = ["CpuDecode", "CpuDecodeStep", "enable_cpu_decode"]

F32 = npt.NDArray[np.float32]


@dataclass(frozen=True, slots=True)
class _Layer:
    """One decoder layer's weights as the Rust ops take them."""

    input_norm: F32
    post_norm: F32
    eps: float
    qkv: QuantizedWeight
    qkv_bias: F32 | None
    o_proj: QuantizedWeight
    o_bias: F32 | None
    gate_up: QuantizedWeight | None  # the dense MLP's (None with `moe`)
    down: QuantizedWeight | None
    moe: SparseMoeBlock | None
    q_norm: F32 | None  # per-head q/k RMSNorm weights (Qwen3)
    k_norm: F32 | None
    qk_eps: float
    q_size: int
    kv_size: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    sliding_window: int | None
    sinks: F32 | None  # a logit per query head in every softmax (gpt-oss)
    layer_idx: int
    # the qkv, o, gate_up and down modules (their forward hooks: LoRA; the MoE block for the last two)
    modules: tuple[torch.nn.Module, torch.nn.Module, torch.nn.Module, torch.nn.Module]


@dataclass(frozen=True, slots=True)
class _KvTables:
    """Where a layer's K/V of the step are written (a slot per token) and read (per decode: block table
    row, context length) in one KV pool."""

    slots: npt.NDArray[np.int64]
    block_tables: npt.NDArray[np.int32]
    seq_lens: npt.NDArray[np.int32]


def _kv_tables(meta: AttentionMetadata, t: int) -> _KvTables | None:
    """The step's tables in `meta`'s pool, or None unless its `t` tokens are all decodes for the CPU
    kernel (as the attention backend's `step_plan` splits the step)."""
    plan = step_plan(meta)
    dec = plan.cpu_decodes
    if plan.prefills or dec is None or len(dec.seq_lens) != t:
        return None
    return _KvTables(meta.slot_mapping.numpy(), dec.block_tables, dec.seq_lens)


def _decoder_layers(model: LlamaModel) -> list[LlamaDecoderLayer]:
    return [cast("LlamaDecoderLayer", layer) for layer in model.layers]  # ModuleList items are typed Module


def _why_not(model: LlamaModel) -> str | None:
    """Why the model cannot take the fast path, or None when it can."""
    rope = model.rotary_emb
    if not (rope.cpu_fused and rope.is_neox_style and rope.long_cos_sin_cache is None):
        return "rotary embedding is not the fused neox one"
    if rope.rope_type == "dynamic":
        return "dynamic rope rescales per step"
    if rope.cos_sin_cache.device.type != "cpu" or rope.cos_sin_cache.dtype != torch.float32:
        return "not float32 on the CPU"
    from pagedrs.models.llama import LlamaMLP

    for layer in _decoder_layers(model):
        attn, mlp = layer.self_attn, layer.mlp
        if attn.attn.logits_soft_cap is not None:
            return "attention soft-capping is not in the fused step"
        sinks = attn.attn.sinks
        if sinks is not None and sinks.dtype != torch.float32:
            return "attention sinks are not float32"
        if isinstance(mlp, SparseMoeBlock):
            why = moe_why_not(mlp)
            if why is not None:
                return why
            mlps: tuple[LlamaMLP, ...] = ()
        elif isinstance(mlp, LlamaMLP):
            mlps = (mlp,)
        else:
            return "a layer's MLP is neither the dense gated one nor a SparseMoeBlock"
        linears = (attn.qkv_proj, attn.o_proj, *(p for m in mlps for p in (m.gate_up_proj, m.down_proj)))
        if any(not isinstance(lin.qweight, QuantizedWeight) or lin.tp_size != 1 for lin in linears):
            return "a linear layer is not quantized on one rank"
        if any(lin.bias is not None for lin in linears[2:]):
            return "a bias other than q/k/v's and o's"
        norms = [n for n in (attn.q_norm, attn.k_norm) if n is not None]
        if not all(n.cpu_fused for n in norms):
            return "the q/k norm is not the fused RMSNorm"
        if any(not (isinstance(m.act_fn, SiluAndMul) and m.act_fn.cpu_fused) for m in mlps):
            return "the MLP activation is not the fused SiLU-and-mul"
        if not (layer.input_layernorm.cpu_fused and layer.post_attention_layernorm.cpu_fused):
            return "a norm is not the fused RMSNorm"
    if not model.norm.cpu_fused:
        return "the final norm is not the fused RMSNorm"
    return None


def _layer(layer: LlamaDecoderLayer) -> _Layer:
    attn = layer.self_attn
    mlp = layer.mlp  # a dense MLP or a SparseMoeBlock: checked by _why_not
    qkv = attn.qkv_proj
    assert isinstance(qkv.qweight, QuantizedWeight) and isinstance(attn.o_proj.qweight, QuantizedWeight)
    moe = mlp if isinstance(mlp, SparseMoeBlock) else None
    gate_up: QuantizedWeight | None = None
    down: QuantizedWeight | None = None
    mods: tuple[torch.nn.Module, torch.nn.Module] = (mlp, mlp)
    if moe is None:
        dense = cast("LlamaMLP", mlp)
        gu, dn = dense.gate_up_proj.qweight, dense.down_proj.qweight
        assert isinstance(gu, QuantizedWeight) and isinstance(dn, QuantizedWeight)
        gate_up, down, mods = gu, dn, (dense.gate_up_proj, dense.down_proj)
    a = attn.attn
    qn, kn = attn.q_norm, attn.k_norm
    return _Layer(
        input_norm=layer.input_layernorm.weight.detach().numpy(),
        post_norm=layer.post_attention_layernorm.weight.detach().numpy(),
        eps=float(layer.input_layernorm.eps),
        qkv=qkv.qweight,
        qkv_bias=None if qkv.bias is None else qkv.bias.detach().numpy(),
        o_proj=attn.o_proj.qweight,
        o_bias=None if attn.o_proj.bias is None else attn.o_proj.bias.detach().numpy(),
        gate_up=gate_up,
        down=down,
        moe=moe,
        q_norm=None if qn is None else qn.weight.detach().numpy(),
        k_norm=None if kn is None else kn.weight.detach().numpy(),
        qk_eps=0.0 if qn is None else float(qn.eps),
        q_size=qkv.q_size,
        kv_size=qkv.kv_size,
        num_heads=a.num_heads,
        num_kv_heads=a.num_kv_heads,
        head_size=a.head_size,
        scale=float(a.scale),
        sliding_window=a.sliding_window,
        sinks=None if a.sinks is None else a.sinks.detach().contiguous().numpy(),
        layer_idx=a.layer_idx,
        modules=(qkv, attn.o_proj, mods[0], mods[1]),
    )


class CpuDecodeStep:
    """The decode-only forward of one LlamaModel through the Rust ops (see the module docstring)."""

    def __init__(self, model: LlamaModel) -> None:
        why = _why_not(model)
        if why is not None:
            raise ValueError(f"the CPU decode step does not apply: {why}")
        self.model = model
        decoder_layers = _decoder_layers(model)
        self.layers = [_layer(layer) for layer in decoder_layers]
        self.final_norm = model.norm.weight.detach().numpy()
        self.final_eps = float(model.norm.eps)
        rope = model.rotary_emb
        self.cos_sin = rope.cos_sin_cache.numpy()
        self.rope_head_size = rope.head_size
        self.rotary_dim = rope.rotary_dim
        self._linears = [
            m
            for layer in decoder_layers
            for block in (layer.self_attn, layer.mlp)
            if not isinstance(block, SparseMoeBlock)
            for m in block.children()
        ]
        self._moe_modules = [
            m
            for layer in decoder_layers
            if isinstance(layer.mlp, SparseMoeBlock)
            for m in layer.mlp.modules()
        ]

    def _hooked(self) -> bool:
        """A hook this path cannot run as the module would: pre-hooks, or forward hooks taking kwargs; any
        hook inside a mixture-of-experts block (its step runs without the modules)."""
        return any(m._forward_pre_hooks or m._forward_hooks_with_kwargs for m in self._linears) or any(
            m._forward_pre_hooks or m._forward_hooks for m in self._moe_modules
        )

    @staticmethod
    def _linear(module: torch.nn.Module, weight: QuantizedWeight, x: F32, bias: F32 | None = None) -> F32:
        """The module's output for rows `x`: the quantized matmul, its bias, then its forward hooks (LoRA
        adds its deltas in place), as `module(x)` would give it."""
        out = weight.matmul_rows(x)
        if bias is not None:
            out += bias
        if module._forward_hooks:
            xt, ot = torch.from_numpy(x), torch.from_numpy(out)
            for hook in list(module._forward_hooks.values()):
                res = hook(module, (xt,), ot)
                if res is not None and res is not ot:
                    ot.copy_(res)
        return out

    def forward(self, input_ids: Tensor, positions: Tensor, ctx: ForwardContext) -> Tensor | None:
        """Hidden states [T, hidden] after the final norm, or None when this step is not a decode-only
        step the fast path takes (the caller then runs the modules)."""
        meta, backend = ctx.attn_metadata, ctx.backend
        if meta is None or not isinstance(backend, TorchAttentionBackend) or not backend.use_cpu_kernels:
            return None
        t = int(input_ids.shape[0])
        full = _kv_tables(meta, t)
        # the sliding-window layers' own KV pools (`runner.kv_groups`), where the runner gives them some
        found = {w: _kv_tables(g, t) for w, g in meta.groups.items()}
        groups = {w: g for w, g in found.items() if g is not None}
        if t == 0 or full is None or len(groups) != len(found):
            return None
        caches = [c.numpy() for c in ctx.kv_caches]
        if any(c.dtype != np.float32 or not c.flags.c_contiguous for c in caches):
            return None
        if positions.dtype != torch.int64 or input_ids.device.type != "cpu" or self._hooked():
            return None
        pos = positions.numpy()
        layers = self.layers if ctx.exit_layer is None else self.layers[: ctx.exit_layer]
        if not layers:
            return None
        residual = self.model.embed_tokens(input_ids).numpy()
        hidden = np.empty_like(residual)
        for i, w in enumerate(layers):
            if i == 0:
                _core.cpu_rms_norm(residual, w.input_norm, w.eps, hidden)
            else:
                _core.cpu_fused_add_rms_norm(hidden, residual, w.input_norm, w.eps)
            kv = groups.get(w.sliding_window, full) if w.sliding_window is not None else full
            hidden = self._attention(w, hidden, pos, caches[w.layer_idx], kv)
            _core.cpu_fused_add_rms_norm(hidden, residual, w.post_norm, w.eps)
            if w.moe is not None:
                hidden = moe_forward(w.moe, hidden)
                continue
            assert w.gate_up is not None and w.down is not None
            gate_up = self._linear(w.modules[2], w.gate_up, hidden)
            act = np.empty((t, gate_up.shape[1] // 2), dtype=np.float32)
            _core.cpu_silu_and_mul(gate_up, act)
            hidden = self._linear(w.modules[3], w.down, act)
        _core.cpu_fused_add_rms_norm(hidden, residual, self.final_norm, self.final_eps)
        return torch.from_numpy(hidden)

    def _attention(
        self,
        w: _Layer,
        hidden: F32,
        pos: npt.NDArray[np.int64],
        cache: F32,
        kv: _KvTables,
    ) -> F32:
        t = hidden.shape[0]
        qkv = self._linear(w.modules[0], w.qkv, hidden, w.qkv_bias)
        q = qkv[:, : w.q_size]
        k = qkv[:, w.q_size : w.q_size + w.kv_size]
        v = qkv[:, w.q_size + w.kv_size :]
        if w.q_norm is not None and w.k_norm is not None:
            q = _per_head_norm(q, w.q_norm, w.qk_eps, w.head_size)
            k = _per_head_norm(k, w.k_norm, w.qk_eps, w.head_size)
        _core.cpu_rope_neox(pos, q, k, self.cos_sin, self.rope_head_size, self.rotary_dim)
        flat = cache.reshape(2, -1, w.num_kv_heads, w.head_size)
        flat[0][kv.slots] = k.reshape(t, w.num_kv_heads, w.head_size)
        flat[1][kv.slots] = v.reshape(t, w.num_kv_heads, w.head_size)
        qd = np.ascontiguousarray(q).reshape(t, w.num_heads, w.head_size)
        out = np.empty_like(qd)
        _core.paged_decode_attention(
            qd,
            cache,
            kv.block_tables,
            kv.seq_lens,
            out,
            w.scale,
            w.sliding_window,
            cpu_kernel_threads(),
            sinks=w.sinks,
        )
        return self._linear(w.modules[1], w.o_proj, out.reshape(t, w.num_heads * w.head_size), w.o_bias)


def _per_head_norm(x: F32, weight: F32, eps: float, head_size: int) -> F32:
    """RMSNorm over each head of rows x [T, heads * head_size]: a new contiguous array, as the attention
    module's per-head q/k norm (the same Rust norm over the same contiguous copy)."""
    rows = np.ascontiguousarray(x).reshape(-1, head_size)
    out = np.empty_like(rows)
    _core.cpu_rms_norm(rows, weight, eps, out)
    return out.reshape(x.shape[0], -1)


def enable_cpu_decode(model: torch.nn.Module) -> bool:
    """Give a quantized CPU model of the Llama family its fast decode step (`LlamaModel.cpu_decode`);
    False (and the modules for every step) for other models, or with PAGEDRS_CPU_DECODE=0."""
    from pagedrs.models.llama import LlamaModel

    inner = getattr(model, "model", None)
    if os.environ.get("PAGEDRS_CPU_DECODE", "1") == "0" or not isinstance(inner, LlamaModel):
        return False
    try:
        inner.cpu_decode = CpuDecodeStep(inner)
    except ValueError:  # outside the case it covers (the message says why)
        return False
    return True


class CpuDecode(DeviceForm):
    """The device form: a quantized CPU model of the Llama family takes the fast decode step (after the
    fused CPU ops, which it checks for)."""

    name = "cpu_decode"

    @staticmethod
    def wanted(opts: PrepareOptions) -> bool:
        return opts.cpu_quantized

    def finish(self, model: torch.nn.Module) -> int:
        return int(enable_cpu_decode(model))
