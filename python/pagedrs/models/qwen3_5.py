"""Qwen3.5 / Qwen3.6 text (HF's Qwen3_5ForCausalLM, and the text part of Qwen3_5ForConditionalGeneration):
Gated DeltaNet linear-attention layers interleaved with gated full-attention layers (`config.layer_types`).

- Linear attention (HF's Qwen3_5GatedDeltaNet): q/k/v from one projection through a causal depthwise conv1d
  (SiLU) whose last `kernel - 1` inputs are the conv state, then the gated delta rule per value head
  (`pagedrs.layers.delta_rule`) with its recurrent state, then a gated RMSNorm (norm, then * silu(z)) and
  the output projection.
- Full attention (HF's Qwen3_5Attention): q carries an output gate (q_proj gives q and gate per head), per-head
  q/k RMSNorm, partial RoPE (`partial_rotary_factor`), paged attention, output * sigmoid(gate).
- RMSNorms are zero-centred (x * (1 + weight)), except the gated norm (x * weight).

The recurrent state (conv window and delta-rule state of every linear-attention layer) lives in a state slot per
sequence (`pagedrs.runner.recurrent`); the step's metadata says each row's slot and whether it starts at
position 0 (a zeroed state). Only the full-attention layers have paged KV: `num_layers` counts those, and
their `Attention.layer_idx` is their index among them. A layer is its description (`describe`:
pagedrs.models.layer_desc), which the forward runs and the CPU decode step replays; with the layer kernels on (CUDA), decode rows of the linear-attention layers take cuda/delta_rule.cu; under tensor parallelism each rank holds its share of the heads of every layer and of the state.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import PretrainedConfig

from pagedrs.distributed.group import TPGroup
from pagedrs.kernels.delta_rule_ops import MAX_KEY_HEAD_DIM, gated_delta_decode
from pagedrs.layers.attention import Attention, ForwardContext, RecurrentRows
from pagedrs.layers.delta_rule import (
    causal_conv1d,
    causal_conv1d_update,
    chunk_gated_delta_rule_states,
    cpu_gated_delta_decode,
    recurrent_gated_delta_rule,
)
from pagedrs.layers.linear import (
    ColumnParallelLinear,
    Loaded,
    ParallelLMHead,
    ReplicatedLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from pagedrs.layers.linear_form import copy_checked, no_shard
from pagedrs.layers.norm import GatedRMSNorm, ZeroCenteredRMSNorm
from pagedrs.layers.rotary import get_rope
from pagedrs.models.interface import CausalLM
from pagedrs.models.layer_desc import (
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
    Residual,
    Rope,
    TorchState,
    run_ops,
)
from pagedrs.models.utils import load_weights_into
from pagedrs.multimodal import MultiModalBatch

__all__ = ["Qwen3_5ForCausalLM", "RecurrentShape", "linear_layers", "text_weights"]

# Checkpoint prefixes of the ConditionalGeneration form: the text part, and what pagedrs does not run.
_TEXT_PREFIX = "model.language_model."
_NOT_TEXT = ("model.visual.", "mtp.")


def linear_layers(config: PretrainedConfig) -> list[int]:
    """The decoder layers that are linear attention (the others are full attention)."""
    return [i for i, t in enumerate(config.layer_types) if t == "linear_attention"]


class RecurrentShape:
    """The per-sequence state of a model's linear-attention layers on one of `tp_size` ranks (each holds its
    share of the heads): each layer's conv window [conv_dim, kernel - 1] and delta-rule state [value heads, key
    head dim, value head dim], float32."""

    def __init__(self, config: PretrainedConfig, tp_size: int = 1) -> None:
        self.num_layers = len(linear_layers(config))
        key_dim = config.linear_key_head_dim * config.linear_num_key_heads // tp_size
        num_v = config.linear_num_value_heads // tp_size
        value_dim = config.linear_value_head_dim * num_v
        self.conv = (key_dim * 2 + value_dim, config.linear_conv_kernel_dim - 1)
        self.ssm = (num_v, config.linear_key_head_dim, config.linear_value_head_dim)

    @property
    def bytes_per_slot(self) -> int:
        conv = self.conv[0] * self.conv[1]
        ssm = self.ssm[0] * self.ssm[1] * self.ssm[2]
        return self.num_layers * (conv + ssm) * 4


class _ConvWeight(torch.nn.Module):
    """The depthwise conv1d's weight [channels, 1, kernel] under HF's name (`conv1d.weight`)."""

    def __init__(self, channels: int, kernel: int, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(
            torch.zeros(channels, 1, kernel, dtype=dtype, device=device), requires_grad=False
        )


def _split_loader(sizes: list[int], tp: TPGroup) -> Any:
    """Loads this rank's share of each of the pieces (`sizes` rows each, stacked along dim 0) of a tensor."""

    def load(param: Tensor, loaded: Loaded, shard_id: object = None) -> None:
        no_shard(shard_id, "a head-split parameter")
        if loaded.shape[0] != sum(sizes):
            raise ValueError(f"shape mismatch: expected dim 0 of {sum(sizes)}, got {tuple(loaded.shape)}")
        src = dst = 0
        for n in sizes:
            local = n // tp.size
            copy_checked(param.narrow(0, dst, local), loaded.narrow(0, src + tp.position * local, local))
            src, dst = src + n, dst + local

    return load


def _split_param(shape: tuple[int, ...], pieces: list[int], tp: TPGroup, fill: float, **kw: Any) -> Any:
    """A parameter holding this rank's share of `pieces` (rows of the full tensor) along dim 0."""
    p = torch.nn.Parameter(torch.full(shape, fill, **kw), requires_grad=False)
    p.weight_loader = _split_loader(pieces, tp)  # type: ignore[attr-defined]
    return p


class GatedDeltaNet(torch.nn.Module):
    # Set on the quantized CPU path (`layers.cpu_fused`): decode rows take the Rust kernel.
    cpu_fused = False
    cpu_fusable = True

    def __init__(
        self, config: PretrainedConfig, index: int, *, tp: TPGroup, dtype: torch.dtype, device: torch.device
    ) -> None:
        """`index`: the layer's place among the linear-attention layers (its row of the state tensors). Under
        tensor parallelism each rank holds its share of the key and value heads (and of the conv channels)."""
        super().__init__()
        hidden = config.hidden_size
        self.index = index
        self.num_v_heads = config.linear_num_value_heads // tp.size
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        full_key = self.head_k_dim * config.linear_num_key_heads
        full_value = self.head_v_dim * config.linear_num_value_heads
        self.key_dim, self.value_dim = full_key // tp.size, full_value // tp.size
        self.num_k_heads = self.key_dim // self.head_k_dim  # this rank's key heads
        conv_dim = self.key_dim * 2 + self.value_dim
        kw: dict[str, Any] = {"dtype": dtype, "device": device}
        pieces = [full_key, full_key, full_value]
        self.in_proj_qkv = ReplicatedLinear(hidden, conv_dim, **kw)
        self.in_proj_qkv.weight.weight_loader = _split_loader(pieces, tp)  # type: ignore[attr-defined]
        self.in_proj_z = ColumnParallelLinear(hidden, full_value, tp=tp, **kw)
        self.in_proj_b = ColumnParallelLinear(hidden, config.linear_num_value_heads, tp=tp, **kw)
        self.in_proj_a = ColumnParallelLinear(hidden, config.linear_num_value_heads, tp=tp, **kw)
        self.conv1d = _ConvWeight(conv_dim, config.linear_conv_kernel_dim, **kw)
        self.conv1d.weight.weight_loader = _split_loader(pieces, tp)  # type: ignore[attr-defined]
        nv = [config.linear_num_value_heads]
        self.dt_bias = _split_param((self.num_v_heads,), nv, tp, 1.0, **kw)
        self.A_log = _split_param((self.num_v_heads,), nv, tp, 0.0, **kw)
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps, **kw)
        self.out_proj = RowParallelLinear(full_value, hidden, tp=tp, **kw)
        self.cuda_kernels = False  # decode steps on cuda/delta_rule.cu (`use_cuda_kernels`)

    def use_cuda_kernels(self, enabled: bool) -> None:
        """Switched with the layer kernels (`kernel_switch.LayerKernels`): decode rows take the fused CUDA
        decode step (`kernels.delta_rule_ops`) where it fits the layer."""
        params = (self.conv1d.weight, self.dt_bias, self.A_log)
        self.cuda_kernels = (
            enabled and self.head_k_dim <= MAX_KEY_HEAD_DIM and len({p.dtype for p in params}) == 1
        )

    def _gates(self, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
        """The tokens' (g, beta) [T, value heads]: the log decay and the write strength."""
        return -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias), b.sigmoid()

    def _heads(self, mixed: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The conv's output [B, L, conv_dim] -> q, k [B, L, key heads, Dk], v [B, L, value heads, Dv]."""
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        bl = mixed.shape[:2]
        return (
            q.reshape(*bl, -1, self.head_k_dim),
            k.reshape(*bl, -1, self.head_k_dim),
            v.reshape(*bl, -1, self.head_v_dim),
        )

    def _row(
        self, qkv: Tensor, a: Tensor, b: Tensor, conv: Tensor | None, ssm: Tensor | None, capture: list[int]
    ) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
        """One sequence's tokens [L, ...] from its state (None: zero; updated in place) by the chunked rule ->
        ([L, value_dim], the (conv window, state) right after each token index in `capture`)."""
        n, channels = qkv.shape
        kk = self.conv1d.weight.shape[-1] - 1
        if (
            capture
        ):  # the conv's inputs with the kk before the row: the window after token i is [i + 1, i + kk]
            prev = torch.zeros(channels, kk, dtype=qkv.dtype, device=qkv.device) if conv is None else conv
            inputs = torch.cat([prev.to(qkv.dtype), qkv.t()], dim=-1)
            windows = [inputs[:, i + 1 : i + 1 + kk].float() for i in capture]
        mixed = causal_conv1d(qkv, self.conv1d.weight[:, 0], conv)
        q, k, v = self._heads(mixed[None])
        g, beta = self._gates(a, b)
        init = None if ssm is None else ssm[None]
        out, state, states = chunk_gated_delta_rule_states(q, k, v, g[None], beta[None], init, capture)
        if ssm is not None:
            ssm.copy_(state[0])
        if not capture:
            windows = []
        return out[0].reshape(n, self.value_dim), [(w, s[0]) for w, s in zip(windows, states, strict=True)]

    def _decode(self, qkv: Tensor, a: Tensor, b: Tensor, conv: Tensor, ssm: Tensor, idx: Tensor) -> Tensor:
        """One token of each of B sequences [B, ...], all at once, from their slots `idx` of the layer's `conv`
        and `ssm` (gathered, stepped, scattered back; in place on the fused CUDA step, and on the quantized CPU
        path one Rust call) -> [B, value_dim]."""
        w, nk = self.conv1d.weight[:, 0], self.num_k_heads
        if self.cuda_kernels and qkv.dtype == self.dt_bias.dtype:
            slots = idx.to(torch.int32)
            return gated_delta_decode(qkv, a, b, w, self.dt_bias, self.A_log, conv, ssm, slots, nk)
        if self.cpu_fused and conv.device.type == "cpu" and qkv.dtype == conv.dtype == torch.float32:
            return cpu_gated_delta_decode(qkv, a, b, w, self.A_log, self.dt_bias, conv, ssm, idx, nk)
        window, state = conv.index_select(0, idx), ssm.index_select(0, idx)
        mixed = causal_conv1d_update(qkv, w, window)
        q, k, v = self._heads(mixed[:, None])
        g, beta = self._gates(a, b)
        out, state = recurrent_gated_delta_rule(q, k, v, g[:, None], beta[:, None], state)
        conv.index_copy_(0, idx, window)
        ssm.index_copy_(0, idx, state)
        return out.reshape(-1, self.value_dim)

    def _rows(self, qkv: Tensor, a: Tensor, b: Tensor, rec: RecurrentRows, qsl: Any) -> Tensor:
        """A step's rows from their state slots: the one-token rows (decodes) in one batched update, each longer
        row by the chunked rule, taking the states its snapshots name (block boundaries) inside the chunks."""
        conv, ssm = rec.conv[self.index], rec.ssm[self.index]
        starts = np.asarray(qsl, dtype=np.int64)
        lens = np.diff(starts)
        core = qkv.new_empty(qkv.shape[0], self.value_dim)
        single = np.flatnonzero(lens == 1)
        if single.size:
            tok = torch.from_numpy(starts[single]).to(qkv.device)
            idx = torch.tensor([rec.slots[r] for r in single.tolist()], device=conv.device)
            core[tok] = self._decode(qkv[tok], a[tok], b[tok], conv, ssm, idx)
        for r in np.flatnonzero(lens != 1).tolist():
            lo, hi, slot, snaps = int(starts[r]), int(starts[r + 1]), rec.slots[r], rec.snapshots[r]
            out, states = self._row(
                qkv[lo:hi], a[lo:hi], b[lo:hi], conv[slot], ssm[slot], [i for i, _ in snaps]
            )
            core[lo:hi] = out
            for (_, snap), (window, state) in zip(snaps, states, strict=True):
                conv[snap], ssm[snap] = window, state
        for r in single.tolist():  # a decode that completes a block: its state after the step
            for _, snap in rec.snapshots[r]:
                conv[snap], ssm[snap] = conv[rec.slots[r]], ssm[rec.slots[r]]
        return core

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        qkv, z = self.in_proj_qkv(x), self.in_proj_z(x)
        a, b = self.in_proj_a(x), self.in_proj_b(x)
        meta = ctx.attn_metadata
        if meta is None:  # no cache (profiling): the whole input is one sequence from a zero state
            core = self._row(qkv, a, b, None, None, [])[0]
        else:
            rec = meta.recurrent
            if rec is None:
                raise ValueError("a linear-attention layer's step needs its state slots (`runner.recurrent`)")
            core = self._rows(qkv, a, b, rec, meta.query_start_loc_cpu)
        t = x.shape[0]
        core = self.norm(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(core.reshape(t, self.value_dim))


class GatedAttention(torch.nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        index: int,
        rotary: Any,
        *,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """`index`: the layer's place among the full-attention layers (its KV cache). Under tensor parallelism
        each rank holds its share of the query heads (each with its gate) and of the KV heads."""
        super().__init__()
        hidden = config.hidden_size
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        if kv_heads % tp.size:
            raise ValueError(f"{kv_heads} KV heads cannot be split over {tp.size} tensor-parallel ranks")
        self.num_heads, self.num_kv_heads = heads // tp.size, kv_heads // tp.size
        self.head_size = int(getattr(config, "head_dim", None) or hidden // heads)
        bias = bool(getattr(config, "attention_bias", False))
        kw: dict[str, Any] = {"dtype": dtype, "device": device}
        hs = self.head_size
        self.q_proj = ColumnParallelLinear(hidden, heads * hs * 2, bias, tp=tp, **kw)
        self.k_proj = ColumnParallelLinear(hidden, kv_heads * hs, bias, tp=tp, **kw)
        self.v_proj = ColumnParallelLinear(hidden, kv_heads * hs, bias, tp=tp, **kw)
        self.o_proj = RowParallelLinear(heads * hs, hidden, bias, tp=tp, **kw)
        self.q_norm = ZeroCenteredRMSNorm(hs, config.rms_norm_eps, **kw)
        self.k_norm = ZeroCenteredRMSNorm(hs, config.rms_norm_eps, **kw)
        self.rotary_emb = rotary  # shared; registered on the model
        self.attn = Attention(self.num_heads, hs, self.num_kv_heads, index, scale=hs**-0.5)

    def describe(self) -> tuple[Op, ...]:
        """q|gate, k, v projections, zero-centred per-head q/k norm, partial rotary, attention, output gate,
        o proj."""
        return (
            GatedQKVProj(self.q_proj, self.k_proj, self.v_proj, self.head_size),
            HeadNorm(self.q_norm, self.k_norm, self.head_size),
            Rope(self.rotary_emb),
            Attend(self.attn),
            OutputGate(),
            Linear(self.o_proj),
        )


class Qwen3_5MLP(torch.nn.Module):
    def __init__(
        self, config: PretrainedConfig, *, tp: TPGroup, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        kw: dict[str, Any] = {"tp": tp, "dtype": dtype, "device": device}
        self.gate_proj = ColumnParallelLinear(hidden, inter, **kw)
        self.up_proj = ColumnParallelLinear(hidden, inter, **kw)
        self.down_proj = RowParallelLinear(inter, hidden, **kw)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen3_5DecoderLayer(torch.nn.Module):
    def __init__(self, config: PretrainedConfig, mixer: torch.nn.Module, mlp: torch.nn.Module) -> None:
        super().__init__()
        if isinstance(mixer, GatedDeltaNet):
            self.linear_attn = mixer
        else:
            self.self_attn = mixer
        self.mlp = mlp
        w = next(mlp.parameters())
        kw: dict[str, Any] = {"dtype": w.dtype, "device": w.device}
        self.input_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps, **kw)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps, **kw)

    def describe(self) -> tuple[Op, ...]:
        """Pre-norm (its input kept as the residual), the mixer (linear or gated full attention), the residual
        added; pre-norm, the MLP (dense or MoE, one op), the residual added."""
        mixer = getattr(self, "linear_attn", None)
        if mixer is not None:
            mixer_ops: tuple[Op, ...] = (LinearAttention(mixer),)
        else:
            mixer_ops = cast(GatedAttention, self.self_attn).describe()
        return (
            Norm(self.input_layernorm, Residual.SAVE),
            *mixer_ops,
            AddResidual(),
            Norm(self.post_attention_layernorm, Residual.SAVE),
            Block(self.mlp),
            AddResidual(),
        )

    def forward(self, positions: Tensor, x: Tensor, ctx: ForwardContext) -> Tensor:
        s = TorchState(positions, ctx, None, x)
        run_ops(self.describe(), s)
        return s.x


class Qwen3_5Model(DescribedModel):
    def __init__(
        self,
        config: PretrainedConfig,
        make_mlp: Any,
        *,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        kw: dict[str, Any] = {"dtype": dtype, "device": device}
        head_size = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        self.rotary_emb = get_rope(config, head_size, device=device)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp=tp, **kw)
        layers: list[torch.nn.Module] = []
        num_linear = num_full = 0
        for i, kind in enumerate(config.layer_types):
            mixer: torch.nn.Module
            if kind == "linear_attention":
                mixer, num_linear = GatedDeltaNet(config, num_linear, tp=tp, **kw), num_linear + 1
            else:
                mixer = GatedAttention(config, num_full, self.rotary_emb, tp=tp, **kw)
                num_full += 1
            layers.append(Qwen3_5DecoderLayer(config, mixer, make_mlp(i)))
        self.layers = torch.nn.ModuleList(layers)
        self.norm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps, **kw)

    def describe(self) -> ModelDesc:
        layers = [cast(Qwen3_5DecoderLayer, layer).describe() for layer in self.layers]
        return ModelDesc.of(self.embed_tokens, layers, Norm(self.norm, Residual.NONE))


def text_weights(weights: Iterable[tuple[str, Loaded]]) -> Iterator[tuple[str, Loaded]]:
    """The text model's tensors, under the CausalLM names (a ConditionalGeneration checkpoint's
    `model.language_model.` prefix dropped; its vision tower and multi-token-prediction head skipped)."""
    for name, tensor in weights:
        if name.startswith(_NOT_TEXT):
            continue
        if name.startswith(_TEXT_PREFIX):
            name = "model." + name[len(_TEXT_PREFIX) :]
        yield name, tensor


class Qwen3_5ForCausalLM(CausalLM):
    """HF's Qwen3_5ForCausalLM on the paged KV cache (full-attention layers) and per-sequence recurrent state
    (linear-attention layers)."""

    has_recurrent_state = True

    def __init__(
        self,
        config: PretrainedConfig,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__()
        device = torch.device(device)
        tp = tp or TPGroup()
        self.config = config
        self.dtype = dtype
        self.model = Qwen3_5Model(
            config, self.make_mlp(config, tp, dtype, device), tp=tp, dtype=dtype, device=device
        )
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(
            config.vocab_size, config.hidden_size, tp=tp, dtype=dtype, device=device
        )
        if self.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)
        full = [m for m in self.modules() if isinstance(m, Attention)]
        if not full:
            raise ValueError(f"{type(self).__name__} needs at least one full-attention layer")
        self.num_layers = len(full)
        self.num_kv_heads = full[0].num_kv_heads
        self.head_size = full[0].head_size
        self.sliding_window: int | None = None
        self.max_position = int(getattr(config, "max_position_embeddings", 2048))
        self.recurrent_shape = RecurrentShape(config, tp.size)

    def make_mlp(
        self, config: PretrainedConfig, tp: TPGroup, dtype: torch.dtype, device: torch.device
    ) -> Any:
        """Builds layer i's MLP (dense here; the MoE variant overrides it)."""
        return lambda i: Qwen3_5MLP(config, tp=tp, dtype=dtype, device=device)

    def forward(
        self, input_ids: Tensor, positions: Tensor, ctx: ForwardContext, mm: MultiModalBatch | None = None
    ) -> Tensor:
        """`mm`: unused (this family takes no images)."""
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: Tensor) -> Tensor | None:
        return self.lm_head.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, Loaded]]) -> None:
        skip: tuple[str, ...] = ("rotary_emb.inv_freq",)
        if self.tie_word_embeddings:
            skip = (*skip, "lm_head.weight")
        load_weights_into(self, text_weights(weights), skip=skip)
