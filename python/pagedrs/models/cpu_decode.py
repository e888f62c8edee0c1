"""The decode step on a CPU with the weights kept quantized: the model's layer description
(`models.layer_desc`) replayed on the Rust ops, one call an op on numpy views, no torch module in between.

A batch-1 decode step of the default model runs 30 layers of about ten ops each; through the torch modules
each op also pays a module call, its dispatch checks and tensor wrapping, which together cost about as
much as the matmuls themselves (cProfile of `LLMEngine.step` at one row, 1 thread). llama.cpp avoids this
with a graph built once and replayed; this is the same idea for the one case it matters most in: a step of
decodes only (one token a request, or a speculative verification's few), float32 activations, quantized
weights, one rank. Every op of the description is compiled once into a step over the replay's arrays
(weights, shapes and parameters read from its module then): the Rust kernel the module itself would call
on these rows (RMSNorm with the residual add fused in, the quantized matmuls, neox rotary in place, the
K/V store and the paged decode-attention kernel with the layer's scale, window, soft cap and sinks,
SiLU-and-mul), or, for an op the Rust ops do not cover (Gemma's (1 + w) norms, GeLU-and-mul, a rotary
embedding other than the cached neox one, M-RoPE, a mixture-of-experts block, Gemma 4's q/k/v unit and
per-layer input), the op's own `run` on torch views of the same arrays, with the forward's saved tensors
(`ModelDesc.saved`). A layer sharing another's KV (Gemma 4) reads and writes that layer's cache slice.
Either way an op computes what its module computes, call for call, so the hidden states are bit-identical
to the module path's (tests/models/test_cpu_decode*.py); a family variant is a different description, not
a second forward.

A linear module with hooks (LoRA's deltas) is called as the module, hooks and all. Sliding-window layers
read and write their own KV pool where the runner gives them one (`runner.kv_groups`), as the attention
module does. Any other step, or a model outside that case, takes the modules. `PAGEDRS_CPU_DECODE=0`
turns the fast path off.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor

from pagedrs import _core
from pagedrs.layers.activation import SiluAndMul
from pagedrs.layers.attention import AttentionMetadata, ForwardContext, token_seq_lens
from pagedrs.layers.attention.torch_ref import TorchAttentionBackend, cpu_kernel_threads, step_plan
from pagedrs.layers.device_form import DeviceForm, PrepareOptions
from pagedrs.layers.mrope import MRotaryEmbedding
from pagedrs.layers.norm import RMSNorm
from pagedrs.layers.quantized import QuantizedWeight
from pagedrs.models import cpu_decode_hybrid as hybrid
from pagedrs.models.layer_desc import (
    Act,
    AddResidual,
    Attend,
    Block,
    DescribedModel,
    GatedQKVProj,
    HeadNorm,
    Linear,
    LinearAttention,
    ModelDesc,
    Norm,
    Op,
    OutputGate,
    ProjectQKV,
    QKVProj,
    Residual,
    Rope,
    SavedBlock,
    TorchState,
)

__all__ = ["CpuDecode", "CpuDecodeStep", "enable_cpu_decode"]

F32 = npt.NDArray[np.float32]


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


class _Replay:
    """One step's state: the rows the ops carry (`x`, `residual`, q/k/v: numpy arrays, every `x` a fresh
    C-contiguous one) and what the attention ops read."""

    __slots__ = (
        "caches",
        "ctx",
        "full",
        "gate",
        "groups",
        "k",
        "pos",
        "positions",
        "q",
        "residual",
        "saved",
        "seq_lens",
        "threads",
        "v",
        "x",
    )

    def __init__(
        self,
        x: F32,
        positions: Tensor,
        ctx: ForwardContext,
        caches: list[F32],
        full: _KvTables,
        groups: dict[int, _KvTables],
    ) -> None:
        self.x, self.positions, self.ctx, self.caches = x, positions, ctx, caches
        self.full, self.groups = full, groups  # the sliding-window layers' pools, by window
        self.pos = positions.numpy()
        self.threads = cpu_kernel_threads()
        self.residual: F32 | None = None
        self.q: F32 | None = None
        self.k: F32 | None = None
        self.v: F32 | None = None
        self.gate: F32 | None = None
        self.seq_lens: Tensor | None = None
        self.saved: dict[str, Tensor] = {}  # as `TorchState.saved`: the ops' own torch tensors


Step = Callable[[_Replay], None]


def _torch(a: F32 | None) -> Tensor | None:
    return None if a is None else torch.from_numpy(a)


def _numpy(t: Tensor | None) -> F32 | None:
    return None if t is None else t.numpy()


def _on_module(op: Op) -> Step:
    """The op's own `run` (its module, called as the module path calls it) on torch views of the arrays."""

    def run(s: _Replay) -> None:
        ts = TorchState(s.positions, s.ctx, s.seq_lens, torch.from_numpy(s.x), _torch(s.residual))
        ts.q, ts.k, ts.v, ts.gate = _torch(s.q), _torch(s.k), _torch(s.v), _torch(s.gate)
        ts.saved = s.saved
        op.run(ts)
        s.x, s.residual = ts.x.numpy(), _numpy(ts.residual)
        s.q, s.k, s.v, s.gate = _numpy(ts.q), _numpy(ts.k), _numpy(ts.v), _numpy(ts.gate)

    return run


def _f32_cpu(t: Tensor) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu"


def _rust_rms(m: torch.nn.Module) -> tuple[F32, float] | None:
    """(weight, eps) of an RMSNorm on the Rust op (as the module runs float32 CPU rows), else None."""
    if isinstance(m, RMSNorm) and m.cpu_fused and _f32_cpu(m.weight):
        return m.weight.detach().numpy(), float(m.eps)
    return None


def _rms(x: F32, w: F32, eps: float) -> F32:
    out = np.empty_like(x)
    _core.cpu_rms_norm(x, w, eps, out)
    return out


def _norm(op: Norm) -> Step:
    rust = _rust_rms(op.module)
    if rust is None:
        return _on_module(op)
    w, eps = rust
    if op.residual is Residual.FUSED:

        def fused(s: _Replay) -> None:
            if s.residual is None:
                s.residual, s.x = s.x, _rms(s.x, w, eps)
            else:
                _core.cpu_fused_add_rms_norm(s.x, s.residual, w, eps)

        return fused
    save = op.residual is Residual.SAVE

    def plain(s: _Replay) -> None:
        if save:
            s.residual = s.x
        s.x = _rms(s.x, w, eps)

    return plain


def _add_residual(op: AddResidual) -> Step:
    def run(s: _Replay) -> None:
        assert s.residual is not None
        s.x = s.residual + s.x

    return run


def _quantized(m: torch.nn.Module) -> tuple[QuantizedWeight, F32 | None] | None:
    """A linear module's quantized weight and bias, or None when its weight is not quantized on one rank."""
    w = getattr(m, "qweight", None)
    if not isinstance(w, QuantizedWeight) or getattr(m, "tp_size", 1) != 1:
        return None
    b = getattr(m, "bias", None)
    return w, None if b is None else b.detach().numpy()


def _call(m: torch.nn.Module, x: F32) -> F32:
    """The module called on rows x (a layer with hooks, LoRA's: they run as on the module path)."""
    return m(torch.from_numpy(x)).numpy()


# A linear step is the quantized matmul and its bias, as the module computes them, inline (a batch-1 step
# makes over a hundred); a layer with hooks is called as its module.


def _linear(op: Linear) -> Step:
    q = _quantized(op.module)
    if q is None:
        return _on_module(op)
    m, (w, bias) = op.module, q

    def run(s: _Replay) -> None:
        if m._forward_hooks or m._forward_pre_hooks:
            s.x = _call(m, s.x)
            return
        out = w.matmul_rows(s.x)
        if bias is not None:
            out += bias
        s.x = out

    return run


def _qkv(op: QKVProj) -> Step:
    q = _quantized(op.module)
    if q is None:
        return _on_module(op)
    m, (w, bias) = op.module, q
    q_end = int(m.q_size)
    k_end = q_end + int(m.kv_size)

    def run(s: _Replay) -> None:
        if m._forward_hooks or m._forward_pre_hooks:
            qkv = _call(m, s.x)
        else:
            qkv = w.matmul_rows(s.x)
            if bias is not None:
                qkv += bias
        s.q, s.k, s.v = qkv[:, :q_end], qkv[:, q_end:k_end], qkv[:, k_end:]

    return run


def _per_head_norm(x: F32, weight: F32, eps: float, head_size: int) -> F32:
    """RMSNorm over each head of rows x [T, heads * head_size]: a new contiguous array, as the module
    path's per-head norm (the same Rust norm over the same contiguous copy)."""
    rows = np.ascontiguousarray(x).reshape(-1, head_size)
    return _rms(rows, weight, eps).reshape(x.shape[0], -1)


def _head_norm(op: HeadNorm) -> Step:
    qn, kn = _rust_rms(op.q_norm), _rust_rms(op.k_norm)
    if qn is None or kn is None:
        return _on_module(op)
    (qw, qe), (kw, ke), hs = qn, kn, op.head_size

    def run(s: _Replay) -> None:
        assert s.q is not None and s.k is not None
        s.q, s.k = _per_head_norm(s.q, qw, qe, hs), _per_head_norm(s.k, kw, ke, hs)

    return run


def _rope(op: Rope) -> Step:
    m = op.module
    cached_neox = m.is_neox_style and m.long_cos_sin_cache is None and m.rope_type != "dynamic"
    if isinstance(m, MRotaryEmbedding):  # [3, T] positions: each pair's angle from its axis, as the module
        return _on_module(op)
    if not (m.cpu_fused and cached_neox and _f32_cpu(m.cos_sin_cache)):
        return _on_module(op)
    cos_sin, head_size, rotary_dim = m.cos_sin_cache.numpy(), m.head_size, m.rotary_dim

    def run(s: _Replay) -> None:
        assert s.q is not None and s.k is not None
        _core.cpu_rope_neox(s.pos, s.q, s.k, cos_sin, head_size, rotary_dim)

    return run


def _attend(op: Attend) -> Step:
    """The K/V store and the paged decode-attention kernel, as the torch backend runs a decode step."""
    a = op.module
    # a layer sharing another's KV reads and writes that layer's cache slice (given that layer's k/v)
    h, kvh, hs, layer = a.num_heads, a.num_kv_heads, a.head_size, a.kv_layer
    scale, window, cap = float(a.scale), a.sliding_window, a.logits_soft_cap
    sinks = None if a.sinks is None else a.sinks.detach().to(torch.float32).contiguous().numpy()

    def run(s: _Replay) -> None:
        assert s.q is not None and s.k is not None and s.v is not None
        t = s.q.shape[0]
        kv = s.groups.get(window, s.full) if window is not None else s.full
        cache = s.caches[layer]
        flat = cache.reshape(2, -1, kvh, hs)
        flat[0][kv.slots] = s.k.reshape(t, kvh, hs)
        flat[1][kv.slots] = s.v.reshape(t, kvh, hs)
        qd = np.ascontiguousarray(s.q).reshape(t, h, hs)
        out = np.empty_like(qd)
        _core.paged_decode_attention(
            qd, cache, kv.block_tables, kv.seq_lens, out, scale, window, s.threads, cap, sinks=sinks
        )
        s.x = out.reshape(t, h * hs)

    return run


def _act(op: Act) -> Step:
    if not (isinstance(op.module, SiluAndMul) and op.module.cpu_fused):
        return _on_module(op)

    def run(s: _Replay) -> None:
        out = np.empty((s.x.shape[0], s.x.shape[1] // 2), dtype=np.float32)
        _core.cpu_silu_and_mul(s.x, out)
        s.x = out

    return run


def _block(op: Block) -> Step:
    m = op.module

    def run(s: _Replay) -> None:
        s.x = m(torch.from_numpy(s.x)).numpy()

    return run


def _compile(op: Op) -> Step:
    """The op as one step of the replay (its Rust call where the module would make one)."""
    match op:
        case Norm():
            return _norm(op)
        case AddResidual():
            return _add_residual(op)
        case QKVProj():
            return _qkv(op)
        case HeadNorm():
            return _head_norm(op)
        case Rope():
            return _rope(op)
        case Attend():
            return _attend(op)
        case Linear():
            return _linear(op)
        case Act():
            return _act(op)
        case Block():
            return _block(op)
        case ProjectQKV() | SavedBlock():  # modules reading the forward's saved tensors: called as they are
            return _on_module(op)

        case GatedQKVProj():
            return hybrid.gated_qkv_step(op, _on_module(op))
        case OutputGate():
            return hybrid.output_gate_step(op)
        case LinearAttention():
            return hybrid.linear_attention_step(op)


def _split(unit: object) -> bool:
    """Whether a module (or the module of a bound method) holds a linear layer split over ranks."""
    owner = getattr(unit, "__self__", unit)
    modules = owner.modules() if isinstance(owner, torch.nn.Module) else ()
    return any(getattr(m, "tp_size", 1) != 1 for m in modules)


def _why_not(desc: ModelDesc) -> str | None:
    """Why the description cannot be replayed on the quantized CPU path, or None when it can."""
    for layer in desc.layers:
        for op in layer:
            if isinstance(op, (Linear, QKVProj)):
                if getattr(op.module, "tp_size", 1) != 1:
                    return "a linear layer is split over tensor-parallel ranks"
                if not isinstance(getattr(op.module, "qweight", None), QuantizedWeight):
                    return "a linear layer is not quantized"
            if isinstance(op, Block) and getattr(getattr(op.module, "tp", None), "size", 1) != 1:
                return "a block is split over tensor-parallel ranks"
            if isinstance(op, (ProjectQKV, SavedBlock)) and _split(op.module):
                return "a projection is split over tensor-parallel ranks"
    return None


class CpuDecodeStep:
    """The decode-only forward of a described model replayed on the Rust ops (see the module docstring)."""

    def __init__(self, model: DescribedModel) -> None:
        desc = model.desc
        why = _why_not(desc)
        if why is not None:
            raise ValueError(f"the CPU decode step does not apply: {why}")
        self.model = model
        self.desc = desc
        self.layers: list[list[Step]] = [[_compile(op) for op in layer] for layer in desc.layers]
        self.final = _compile(desc.final)

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
        if positions.dtype != torch.int64 or not positions.is_contiguous() or input_ids.device.type != "cpu":
            return None
        layers = self.layers if ctx.exit_layer is None else self.layers[: ctx.exit_layer]
        if not layers:
            return None
        x = self.desc.embed(input_ids)
        s = _Replay(x.numpy(), positions, ctx, caches, full, groups)
        if self.desc.saved is not None:
            s.saved = self.desc.saved(input_ids, x)
        if self.desc.long_rope:
            s.seq_lens = token_seq_lens(meta)
        for steps in layers:
            for step in steps:
                step(s)
        self.final(s)
        return torch.from_numpy(s.x)


def enable_cpu_decode(model: torch.nn.Module) -> bool:
    """Give a quantized CPU model with a layer description its fast decode step (`cpu_decode` on its
    decoder stack); False (and the modules for every step) for other models, or with PAGEDRS_CPU_DECODE=0."""
    inner = getattr(model, "model", None)
    if os.environ.get("PAGEDRS_CPU_DECODE", "1") == "0" or not isinstance(inner, DescribedModel):
        return False
    try:
        inner.cpu_decode = CpuDecodeStep(inner)
    except ValueError:  # outside the case it covers (the message says why)
        return False
    return True


class CpuDecode(DeviceForm):
    """The device form: a quantized CPU model with a layer description takes the fast decode step (after
    the fused CPU ops, which its steps read)."""

    name = "cpu_decode"

    @staticmethod
    def wanted(opts: PrepareOptions) -> bool:
        return opts.cpu_quantized

    def finish(self, model: torch.nn.Module) -> int:
        return int(enable_cpu_decode(model))
