"""One description of a decoder layer, consumed by every backend (llama.cpp's graph builder per
architecture, as data): the ops of a layer in order, each naming the module that holds its weights and
parameters, built once from a model's modules (`DescribedModel.describe`).

The torch module path runs the description: each op calls its module (`run`), the modules pick their
kernels per device (torch, the CUDA layer kernels, the Rust CPU ops), so a family's forward is its
description. The CPU decode step (`models.cpu_decode`) replays the same ops on the Rust kernels, one call
an op, as a captured graph would, and any op it has no kernel for through that op's own `run`; a variant of
a known layer is a different description and needs no second forward.

The ops read and write one state: the hidden rows `x`, the residual stream `residual`, and q/k/v inside
the attention block:

- `Norm` (RMSNorm, or Gemma's (1 + w) norm) with its residual rule: `FUSED` adds the residual in first and
  keeps the sum as the residual (Llama's pre-norms; the first layer's input becomes the residual), `SAVE`
  makes its input the residual (Gemma's pre-norms), `NONE` leaves it (Gemma's post-norms).
- `AddResidual`: x = residual + x (after Gemma's sandwich post-norms).
- `QKVProj` (the fused q/k/v projection, with its bias), `HeadNorm` (per-head q/k norm: Qwen3, Gemma 3),
  `Rope` (neox or GPT-J, partial; a NoPE layer has none), `Attend` (paged attention with the module's scale,
  sliding window, logit soft cap and sinks), then `Linear` (o proj).
- The MLP: `Linear` (gate|up), `Act` (SiLU or GeLU-tanh gate-and-mul), `Linear` (down); or `Block`, a
  module called as one op (a mixture-of-experts block, through its own forward).
- `ProjectQKV`: q/k/v from a module that computes them as one unit from the normed rows and the forward's
  saved tensors (Gemma 4: separate projections, per-head norms, RoPE, a shared-KV layer taking the k/v an
  earlier layer saved). `SavedBlock`: a module called on x and the saved tensors (Gemma 4's per-layer
  input mixed into the layer's output).
- Gated attention (Qwen3.5's full-attention layers): `GatedQKVProj` (separate q|gate, k and v projections;
  the per-head output gate kept in `gate`), then the attention ops, then `OutputGate` (x * sigmoid(gate))
  before the o proj.
- `LinearAttention`: a linear-attention mixer (Qwen3.5's Gated DeltaNet) on x, with its recurrent state in
  the step's state slots (`ctx.attn_metadata.recurrent`).

The model: `embed` (its embedding, with Gemma's sqrt(hidden) scale), `saved` (the tensors a forward
computes once from the ids and the embeddings for its layers' ops, Gemma 4's per-layer inputs), the layers,
the final norm. The final
logit soft cap (Gemma 2) is the LM head's (`compute_logits`), after either path.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from pagedrs.layers.attention import Attention, ForwardContext, token_seq_lens
from pagedrs.layers.linear import QKVParallelLinear
from pagedrs.layers.rotary import RotaryEmbedding

__all__ = [
    "Act",
    "AddResidual",
    "Attend",
    "Block",
    "DecodeFastPath",
    "DescribedModel",
    "GatedQKVProj",
    "HeadNorm",
    "Linear",
    "LinearAttention",
    "ModelDesc",
    "Norm",
    "Op",
    "OutputGate",
    "QKVProj",
    "ProjectQKV",
    "Residual",
    "Rope",
    "SavedBlock",
    "TorchState",
    "run_ops",
]


class Residual(enum.Enum):
    """What a norm does with the residual stream."""

    FUSED = "fused"  # residual += x (or residual = x when there is none yet), then x = norm(residual)
    SAVE = "save"  # residual = x, then x = norm(x)
    NONE = "none"  # x = norm(x)


class TorchState:
    """The rows one forward carries through the ops, on the module path (torch tensors)."""

    __slots__ = ("ctx", "gate", "k", "positions", "q", "residual", "saved", "seq_lens", "v", "x")

    def __init__(
        self,
        positions: Tensor,
        ctx: ForwardContext,
        seq_lens: Tensor | None,
        x: Tensor,
        residual: Tensor | None = None,
    ) -> None:
        self.positions, self.ctx, self.seq_lens = positions, ctx, seq_lens
        self.x, self.residual = x, residual
        self.q: Tensor | None = None
        self.k: Tensor | None = None
        self.v: Tensor | None = None
        # tensors of this forward that later ops read (`ModelDesc.saved`, a shared-KV layer's k/v)
        self.saved: dict[str, Tensor] = {}
        self.gate: Tensor | None = None  # a gated attention's output gate [T, heads * head_size]


def _tensor(t: Tensor | None) -> Tensor:
    assert t is not None, "an attention op before QKVProj in a description"
    return t


@dataclass(frozen=True, slots=True)
class Norm:
    module: torch.nn.Module  # RMSNorm or GemmaRMSNorm (weight, eps)
    residual: Residual

    def run(self, s: TorchState) -> None:
        if self.residual is Residual.FUSED and s.residual is not None:
            s.x, s.residual = self.module(s.x, s.residual)
            return
        if self.residual is not Residual.NONE:
            s.residual = s.x
        s.x = self.module(s.x)


@dataclass(frozen=True, slots=True)
class AddResidual:
    def run(self, s: TorchState) -> None:
        s.x = _tensor(s.residual) + s.x


@dataclass(frozen=True, slots=True)
class QKVProj:
    module: QKVParallelLinear  # q_size, kv_size, bias

    def run(self, s: TorchState) -> None:
        s.q, s.k, s.v = self.module.split_qkv(self.module(s.x))


@dataclass(frozen=True, slots=True)
class HeadNorm:
    """The norms over each head of q and of k, [T, heads * head_size] -> contiguous [T, heads * head_size]."""

    q_norm: torch.nn.Module
    k_norm: torch.nn.Module
    head_size: int

    def run(self, s: TorchState) -> None:
        q, k = _tensor(s.q), _tensor(s.k)
        s.q = self.q_norm(q.reshape(-1, self.head_size)).view(q.shape[0], -1)
        s.k = self.k_norm(k.reshape(-1, self.head_size)).view(k.shape[0], -1)


@dataclass(frozen=True, slots=True)
class Rope:
    module: RotaryEmbedding  # style, rotary_dim, scaling, cos/sin cache

    def run(self, s: TorchState) -> None:
        s.q, s.k = self.module(s.positions, _tensor(s.q), _tensor(s.k), s.seq_lens)


@dataclass(frozen=True, slots=True)
class Attend:
    module: Attention  # heads, head size, scale, sliding window, logit soft cap, sinks, layer index

    def run(self, s: TorchState) -> None:
        s.x = self.module(_tensor(s.q), _tensor(s.k), _tensor(s.v), s.ctx)


@dataclass(frozen=True, slots=True)
class Linear:
    module: torch.nn.Module  # a linear layer (its weight format, bias and tensor-parallel split inside)

    def run(self, s: TorchState) -> None:
        s.x = self.module(s.x)


@dataclass(frozen=True, slots=True)
class Act:
    module: torch.nn.Module  # SiluAndMul or GeluAndMul: [T, 2d] -> [T, d]

    def run(self, s: TorchState) -> None:
        s.x = self.module(s.x)


@dataclass(frozen=True, slots=True)
class Block:
    module: torch.nn.Module  # called as one op on x (a mixture-of-experts block)

    def run(self, s: TorchState) -> None:
        s.x = self.module(s.x)


class QKVModule(Protocol):
    def qkv(
        self, positions: Tensor, x: Tensor, saved: dict[str, Tensor]
    ) -> tuple[Tensor, Tensor, Tensor]: ...


@dataclass(frozen=True, slots=True)
class ProjectQKV:
    """q, k, v (RoPE applied) of the normed rows from a module that computes them as one unit."""

    module: QKVModule

    def run(self, s: TorchState) -> None:
        s.q, s.k, s.v = self.module.qkv(s.positions, s.x, s.saved)


class SavedModule(Protocol):
    def __call__(self, x: Tensor, saved: dict[str, Tensor]) -> Tensor: ...


@dataclass(frozen=True, slots=True)
class SavedBlock:
    """x = module(x, saved): a module reading the forward's saved tensors (Gemma 4's per-layer input)."""

    module: SavedModule

    def run(self, s: TorchState) -> None:
        s.x = self.module(s.x, s.saved)


@dataclass(frozen=True, slots=True)
class GatedQKVProj:
    """q with its output gate (one projection giving [q | gate] per head), k and v (one projection each):
    q, k, v and gate, each a contiguous [T, heads * head_size]."""

    q_proj: torch.nn.Module
    k_proj: torch.nn.Module
    v_proj: torch.nn.Module
    head_size: int

    def run(self, s: TorchState) -> None:
        t, hs = s.x.shape[0], self.head_size
        qg = self.q_proj(s.x).view(t, -1, 2 * hs)
        s.q, s.gate = qg[..., :hs].reshape(t, -1), qg[..., hs:].reshape(t, -1)
        s.k, s.v = self.k_proj(s.x), self.v_proj(s.x)


@dataclass(frozen=True, slots=True)
class OutputGate:
    """x * sigmoid(gate): the attention output gated per channel (after `GatedQKVProj`)."""

    def run(self, s: TorchState) -> None:
        s.x = s.x * torch.sigmoid(_tensor(s.gate))


@dataclass(frozen=True, slots=True)
class LinearAttention:
    """A linear-attention mixer (Gated DeltaNet: projections, causal conv1d, gated delta rule, gated norm,
    out proj) on x, its recurrent state in the step's state slots."""

    module: torch.nn.Module  # called as module(x, ctx)

    def run(self, s: TorchState) -> None:
        s.x = self.module(s.x, s.ctx)


Op = (
    Norm
    | AddResidual
    | QKVProj
    | HeadNorm
    | Rope
    | Attend
    | Linear
    | Act
    | Block
    | GatedQKVProj
    | OutputGate
    | LinearAttention
    | ProjectQKV
    | SavedBlock
)


def run_ops(ops: tuple[Op, ...], s: TorchState) -> None:
    for op in ops:
        op.run(s)


@dataclass(frozen=True, slots=True)
class ModelDesc:
    embed: Callable[[Tensor], Tensor]  # input ids [T] -> rows [T, hidden]
    layers: tuple[tuple[Op, ...], ...]
    final: Norm
    long_rope: bool  # a layer's rotary embedding picks its factors per request (longrope: `seq_lens`)
    # (input ids [T], embedded rows [T, hidden]) -> the tensors the layers' ops read (`TorchState.saved`)
    saved: Callable[[Tensor, Tensor], dict[str, Tensor]] | None = None

    @classmethod
    def of(
        cls,
        embed: Callable[[Tensor], Tensor],
        layers: list[tuple[Op, ...]],
        final: Norm,
        saved: Callable[[Tensor, Tensor], dict[str, Tensor]] | None = None,
    ) -> ModelDesc:
        long_rope = any(
            isinstance(op, Rope) and op.module.long_cos_sin_cache is not None for ops in layers for op in ops
        )
        return cls(embed, tuple(layers), final, long_rope, saved)


class DecodeFastPath(Protocol):
    """A decode step that replaces the modules where it applies (pagedrs.models.cpu_decode.CpuDecodeStep):
    the hidden states after the final norm, or None to run the modules."""

    def forward(self, input_ids: Tensor, positions: Tensor, ctx: ForwardContext) -> Tensor | None: ...


class DescribedModel(torch.nn.Module):
    """A decoder stack whose forward runs its description (`describe`, built once, on first use)."""

    def __init__(self) -> None:
        super().__init__()
        # Decode-only steps of a quantized CPU model replayed on the Rust ops (set when the model is
        # prepared for its device: pagedrs.models.cpu_decode.enable_cpu_decode).
        self.cpu_decode: DecodeFastPath | None = None
        self._desc: ModelDesc | None = None

    def describe(self) -> ModelDesc:
        raise NotImplementedError

    @property
    def desc(self) -> ModelDesc:
        if self._desc is None:
            self._desc = self.describe()
        return self._desc

    def forward(
        self, input_ids: Tensor, positions: Tensor, ctx: ForwardContext, inputs_embeds: Tensor | None = None
    ) -> Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden] after the final norm. `inputs_embeds`: the
        embeddings to run instead of `embed(input_ids)` (a multimodal step's, images scattered in)."""
        if self.cpu_decode is not None and inputs_embeds is None:
            fast = self.cpu_decode.forward(input_ids, positions, ctx)
            if fast is not None:
                return fast
        desc = self.desc
        seq_lens = None
        if ctx.attn_metadata is not None and desc.long_rope:
            seq_lens = token_seq_lens(ctx.attn_metadata)
        x = desc.embed(input_ids) if inputs_embeds is None else inputs_embeds
        s = TorchState(positions, ctx, seq_lens, x)
        if desc.saved is not None:
            s.saved = desc.saved(input_ids, x)
        for layer in desc.layers if ctx.exit_layer is None else desc.layers[: ctx.exit_layer]:
            run_ops(layer, s)
        desc.final.run(s)
        return s.x
