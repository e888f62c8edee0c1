"""Gemma 4 (text), as HF's Gemma4ForCausalLM computes it, and the text part of Gemma4ForConditionalGeneration.

Gemma 3's sandwich layer (four norms, GeGLU, embeddings scaled by sqrt(hidden_size), sliding and global
layers by `layer_types`, optional final logit soft cap) with Gemma 4's changes:
- RMSNorm multiplies by its weight (not 1 + w), in float32; q and k get one over each head, v one without a
  weight; attention scale 1.
- Global layers have their own head size (`global_head_dim`) and, with `attention_k_eq_v`, their own KV
  head count (`num_global_key_value_heads`) and no v projection (v is the raw k, normed): HF resolves both
  per layer (`per_layer_config`). Their RoPE is proportional (`rope_parameters` per layer type).
- Per-layer input embeddings (`hidden_size_per_layer_input`): a packed table [vocab, layers * d] plus a
  projection of the embeddings, mixed into each layer's residual after its MLP through a gate.
- The last `num_kv_shared_layers` layers compute no KV: each reads the KV of the last earlier layer of its
  type (HF's `kv_sharing_modes`). Here such a layer's attention reads that layer's cache slice
  (`Attention.kv_layer`) and is handed that layer's k/v of this step; it owns no cache (its
  `kv_cache_shapes` entry has no KV head, so the pool gives it no byte). With `use_double_wide_mlp` their
  MLP is twice as wide.
- Each layer's output is multiplied by a learned scalar (`layer_scalar`).
- The MoE variant (`enable_moe_block`) adds routed experts beside the dense MLP (`gemma4_moe`).

Parameter names are HF's (separate q/k/v projections) except gate/up fused into `gate_up_proj`. A layer is
its description (`describe`: pagedrs.models.layer_desc), which the forward runs and the quantized CPU
decode step replays: the q/k/v unit (`ProjectQKV`: projections, per-head norms, RoPE, the k/v a shared-KV
layer is handed, saved by its owner in the forward's `saved` tensors), paged attention, the o projection,
the sandwich norms, the dense MLP as linear ops (or, with the MoE block, the whole feed-forward as one
`SavedBlock`), and the per-layer input with the layer scalar (`SavedBlock` over the saved per-layer inputs).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, cast

import torch
from torch import Tensor
from transformers import PretrainedConfig

from pagedrs.distributed.group import TPGroup
from pagedrs.layers.activation import get_act_and_mul_fn
from pagedrs.layers.attention import Attention, ForwardContext
from pagedrs.layers.linear import (
    ColumnParallelLinear,
    Loaded,
    MergedColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from pagedrs.layers.rotary import RotaryEmbedding, get_rope
from pagedrs.models.gemma import _RopeView
from pagedrs.models.gemma4_moe import Gemma4Experts, Gemma4Router
from pagedrs.models.interface import CausalLM
from pagedrs.models.layer_desc import (
    Act,
    AddResidual,
    Attend,
    DescribedModel,
    Linear,
    ModelDesc,
    Norm,
    Op,
    ProjectQKV,
    Residual,
    SavedBlock,
    TorchState,
    run_ops,
)
from pagedrs.models.llama import _layer_windows
from pagedrs.models.utils import StackedParam, load_weights_into
from pagedrs.multimodal import MultiModalBatch

__all__ = ["Gemma4ForCausalLM", "Gemma4ForConditionalGeneration", "Gemma4RMSNorm"]

_FULL, _SLIDING = "full_attention", "sliding_attention"
_PER_LAYER = "per_layer"  # the saved per-layer inputs [T, layers, d]


class Gemma4RMSNorm(torch.nn.Module):
    """x * (mean(x^2) + eps)^-0.5 * weight in float32, cast back, as HF's Gemma4RMSNorm (no weight:
    `with_scale=False`)."""

    def __init__(
        self, dim: int, eps: float, *, with_scale: bool = True, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = (
            torch.nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)
            if with_scale
            else None
        )

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        out = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            out = out * self.weight.float()
        return out.type_as(x)


def kv_sharing(config: PretrainedConfig) -> list[int | None]:
    """Per layer, the layer whose KV it reads (None: its own), as HF's `kv_sharing_modes`: the last
    `num_kv_shared_layers` layers each read the last earlier layer of their type."""
    types = list(config.layer_types)
    n, shared = len(types), int(getattr(config, "num_kv_shared_layers", 0) or 0)
    first = n - shared
    if shared and first <= 0:
        raise ValueError(f"num_kv_shared_layers={shared} leaves no layer computing KV of {n}")
    out: list[int | None] = [None] * n
    for i in range(first, n):
        owners = [j for j in range(first) if types[j] == types[i]]
        if not owners:
            raise ValueError(f"layer {i} ({types[i]}) shares KV but no earlier layer of its type computes it")
        out[i] = owners[-1]
    return out


def kv_group(tp: TPGroup, kv_heads: int) -> TPGroup:
    """The split of a layer's KV heads over the ranks: as the query heads' with at least as many KV heads
    as ranks; with fewer, each KV head replicated on tp / kv ranks, rank r holding the one its query heads
    read (no collective: the k/v projections are column layers)."""
    if kv_heads >= tp.size:
        if kv_heads % tp.size:
            raise ValueError(f"{kv_heads} KV heads are not divisible by the tensor-parallel size ({tp.size})")
        return tp
    if tp.size % kv_heads:
        raise ValueError(
            f"the tensor-parallel size ({tp.size}) must be a multiple of the number of KV heads ({kv_heads})"
        )
    return TPGroup(tp.position // (tp.size // kv_heads), kv_heads)


def attn_dims(config: PretrainedConfig, layer: int) -> tuple[int, int]:
    """(head size, KV heads) of one layer: the global layers' own where the config gives them."""
    per_layer = getattr(config, "per_layer_config", None)
    if per_layer is not None:  # transformers resolves global_head_dim / num_global_key_value_heads here
        view = per_layer[layer]
        return int(view.head_dim), int(view.num_key_value_heads)
    head, kv = int(config.head_dim), int(config.num_key_value_heads)
    if config.layer_types[layer] == _FULL:
        head = int(getattr(config, "global_head_dim", None) or head)
        gkv = getattr(config, "num_global_key_value_heads", None)
        if gkv and getattr(config, "attention_k_eq_v", True):
            kv = int(gkv)
    return head, kv


class Gemma4Attention(torch.nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        layer_idx: int,
        rotary_emb: RotaryEmbedding,
        window: int | None,
        kv_owner: int | None,
        *,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        hidden, heads, eps = config.hidden_size, config.num_attention_heads, config.rms_norm_eps
        head, kv_heads = attn_dims(config, layer_idx)
        bias = bool(getattr(config, "attention_bias", False))
        self.layer_type: str = config.layer_types[layer_idx]
        self.head_size, self.kv_owner = head, kv_owner
        # the last layer of its type computing KV before the shared ones: they read its k/v
        sharing = kv_sharing(config)
        self.stores_kv = kv_owner is None and layer_idx in sharing
        kw: dict[str, Any] = dict(dtype=dtype, device=device)
        self.q_proj = ColumnParallelLinear(hidden, heads * head, bias=bias, tp=tp, **kw)
        self.q_norm = Gemma4RMSNorm(head, eps, **kw)
        self.k_proj = self.v_proj = None
        self.k_norm = self.v_norm = None
        kv_tp = kv_group(tp, kv_heads)
        if kv_owner is None:
            self.k_proj = ColumnParallelLinear(hidden, kv_heads * head, bias=bias, tp=kv_tp, **kw)
            k_eq_v = bool(getattr(config, "attention_k_eq_v", False)) and self.layer_type != _SLIDING
            if not k_eq_v:
                self.v_proj = ColumnParallelLinear(hidden, kv_heads * head, bias=bias, tp=kv_tp, **kw)
            self.k_norm = Gemma4RMSNorm(head, eps, **kw)
            self.v_norm = Gemma4RMSNorm(head, eps, with_scale=False, **kw)
        self.o_proj = RowParallelLinear(heads * head, hidden, bias=bias, tp=tp, **kw)
        self.rotary_emb = rotary_emb  # shared by the layers of one type; registered on the model
        self.attn = Attention(
            self.q_proj.output_size_per_partition // head,  # this rank's heads
            head,
            kv_heads // kv_tp.size,
            layer_idx,
            scale=1.0,
            sliding_window=window,
            kv_layer=kv_owner,
        )

    def qkv(self, positions: Tensor, x: Tensor, saved: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v [T, heads * head] of the normed rows x, RoPE applied; a layer sharing KV takes the k/v its
        owner saved in `saved` this forward, the owner saves its own."""
        t, d = x.shape[0], self.head_size
        q = self.q_norm(self.q_proj(x).view(t, -1, d)).view(t, -1)
        key_k, key_v = f"k:{self.layer_type}", f"v:{self.layer_type}"
        if self.k_proj is None:
            k, v = saved[key_k], saved[key_v]
            q, _ = self.rotary_emb(positions, q, q.clone())
        else:
            kr = self.k_proj(x)
            vr = self.v_proj(x) if self.v_proj is not None else kr
            assert self.k_norm is not None and self.v_norm is not None
            k = self.k_norm(kr.view(t, -1, d)).view(t, -1)
            v = self.v_norm(vr.view(t, -1, d)).view(t, -1)
            q, k = self.rotary_emb(positions, q, k)
            if self.stores_kv:
                saved[key_k], saved[key_v] = k, v
        return q, k, v

    def describe(self) -> tuple[Op, ...]:
        return (ProjectQKV(self), Attend(self.attn), Linear(self.o_proj))


class Gemma4MLP(torch.nn.Module):
    """down(act(gate(x)) * up(x)) over `inter` intermediate units (twice the config's on double-wide layers)."""

    def __init__(
        self, config: PretrainedConfig, inter: int, *, tp: TPGroup, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden, [inter, inter], bias=False, tp=tp, dtype=dtype, device=device
        )
        self.down_proj = RowParallelLinear(inter, hidden, bias=False, tp=tp, dtype=dtype, device=device)
        self.act_fn = get_act_and_mul_fn(str(config.hidden_activation or "gelu_pytorch_tanh"))

    def describe(self) -> tuple[Op, ...]:
        return (Linear(self.gate_up_proj), Act(self.act_fn), Linear(self.down_proj))

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Gemma4DecoderLayer(torch.nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        attn: Gemma4Attention,
        *,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        kw: dict[str, Any] = dict(dtype=dtype, device=device)
        self.layer_idx = attn.attn.layer_idx
        self.self_attn = attn
        wide = bool(getattr(config, "use_double_wide_mlp", False)) and attn.kv_owner is not None
        self.mlp = Gemma4MLP(config, config.intermediate_size * (2 if wide else 1), tp=tp, **kw)
        self.input_layernorm = Gemma4RMSNorm(hidden, eps, **kw)
        self.post_attention_layernorm = Gemma4RMSNorm(hidden, eps, **kw)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(hidden, eps, **kw)
        self.post_feedforward_layernorm = Gemma4RMSNorm(hidden, eps, **kw)
        self.layer_scalar = torch.nn.Parameter(torch.ones(1, dtype=dtype, device=device), requires_grad=False)
        self.router: Gemma4Router | None = None
        self.experts: Gemma4Experts | None = None
        if getattr(config, "enable_moe_block", False):
            self.router, self.experts = Gemma4Router(config, **kw), Gemma4Experts(config, **kw)
            self.pre_feedforward_layernorm_2 = Gemma4RMSNorm(hidden, eps, **kw)
            self.post_feedforward_layernorm_1 = Gemma4RMSNorm(hidden, eps, **kw)
            self.post_feedforward_layernorm_2 = Gemma4RMSNorm(hidden, eps, **kw)
        ple = int(getattr(config, "hidden_size_per_layer_input", 0) or 0)
        self.per_layer_input_gate = self.per_layer_projection = self.post_per_layer_input_norm = None
        if ple:
            self.per_layer_act = get_act_and_mul_fn(str(config.hidden_activation or "gelu_pytorch_tanh"))
            self.per_layer_input_gate = ColumnParallelLinear(hidden, ple, bias=False, **kw)
            self.per_layer_projection = RowParallelLinear(ple, hidden, bias=False, **kw)
            self.post_per_layer_input_norm = Gemma4RMSNorm(hidden, eps, **kw)

    def describe(self) -> tuple[Op, ...]:
        """Sandwich norms around the attention and the feed-forward (each pre-norm's input kept as the
        residual, added after the post-norm), then the per-layer input and the layer scalar."""
        ffn: tuple[Op, ...] = (SavedBlock(self.moe_feed_forward),)
        if self.router is None:
            ffn = (
                Norm(self.pre_feedforward_layernorm, Residual.SAVE),
                *self.mlp.describe(),
                Norm(self.post_feedforward_layernorm, Residual.NONE),
                AddResidual(),
            )
        return (
            Norm(self.input_layernorm, Residual.SAVE),
            *self.self_attn.describe(),
            Norm(self.post_attention_layernorm, Residual.NONE),
            AddResidual(),
            *ffn,
            SavedBlock(self.layer_output),
        )

    def moe_feed_forward(self, x: Tensor, saved: dict[str, Tensor]) -> Tensor:
        """x + the post-normed sum of the dense MLP and the routed experts (each post-normed), both read
        from the residual x through their own pre-norms."""
        assert self.router is not None and self.experts is not None
        h = self.mlp(self.pre_feedforward_layernorm(x))
        weights, ids = self.router(x)
        routed = self.experts(self.pre_feedforward_layernorm_2(x), weights, ids)
        h = self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(routed)
        return x + self.post_feedforward_layernorm(h)

    def layer_output(self, x: Tensor, saved: dict[str, Tensor]) -> Tensor:
        """x with this layer's per-layer input mixed in through its gate, times the layer scalar."""
        if self.per_layer_input_gate is not None:
            assert self.per_layer_projection is not None and self.post_per_layer_input_norm is not None
            gate = self.per_layer_input_gate(x)
            # the gated activation takes [gate | up]: up = the layer's per-layer input
            h = self.per_layer_act(torch.cat([gate, saved[_PER_LAYER][:, self.layer_idx]], dim=-1))
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(h))
        return x * self.layer_scalar

    def forward(self, positions: Tensor, x: Tensor, ctx: ForwardContext, saved: dict[str, Tensor]) -> Tensor:
        s = TorchState(positions, ctx, None, x)
        s.saved = saved
        run_ops(self.describe(), s)
        return s.x


def _rope(config: PretrainedConfig, layer_type: str, head: int, device: torch.device) -> RotaryEmbedding:
    params = config.rope_parameters
    view = _RopeView(config, params[layer_type]) if isinstance(params.get(layer_type), dict) else config
    return get_rope(view, head, device=device)


class Gemma4Model(DescribedModel):
    """Under tensor parallelism the attention heads, the MLPs and the embedding tables are split; the
    per-layer input projections and the MoE router and experts are whole on every rank (each computes
    them in full)."""

    def __init__(
        self, config: PretrainedConfig, *, tp: TPGroup, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        hidden, n = config.hidden_size, config.num_hidden_layers
        kw: dict[str, Any] = dict(dtype=dtype, device=device)
        types, windows, owners = list(config.layer_types), _layer_windows(config), kv_sharing(config)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden, tp=tp, **kw)
        # HF: float32 scalars cast to the weights' dtype before the multiply
        self.normalizer: Tensor
        self.register_buffer("normalizer", torch.tensor(hidden**0.5).to(**kw), persistent=False)
        self.ple = int(getattr(config, "hidden_size_per_layer_input", 0) or 0)
        if self.ple:
            vocab_pl = int(getattr(config, "vocab_size_per_layer_input", None) or config.vocab_size)
            self.embed_tokens_per_layer = VocabParallelEmbedding(vocab_pl, n * self.ple, tp=tp, **kw)
            self.ple_normalizer: Tensor
            self.register_buffer("ple_normalizer", torch.tensor(self.ple**0.5).to(**kw), persistent=False)
            self.per_layer_model_projection = ColumnParallelLinear(hidden, n * self.ple, bias=False, **kw)
            self.per_layer_projection_norm = Gemma4RMSNorm(self.ple, config.rms_norm_eps, **kw)
        ropes = {t: _rope(config, t, attn_dims(config, types.index(t))[0], device) for t in set(types)}
        self.rotary_embs = torch.nn.ModuleDict(ropes)
        self.layers = torch.nn.ModuleList(
            Gemma4DecoderLayer(
                config,
                Gemma4Attention(config, i, ropes[types[i]], windows[i], owners[i], tp=tp, **kw),
                tp=tp,
                **kw,
            )
            for i in range(n)
        )
        self.norm = Gemma4RMSNorm(hidden, config.rms_norm_eps, **kw)

    def per_layer_inputs(self, input_ids: Tensor, embeds: Tensor) -> Tensor | None:
        """[T, layers, d]: the token's per-layer embedding and the projected embeddings, mixed as HF's
        get_per_layer_inputs + project_per_layer_inputs."""
        if not self.ple:
            return None
        t = input_ids.shape[0]
        token = (self.embed_tokens_per_layer(input_ids) * self.ple_normalizer).view(t, -1, self.ple)
        proj = self.per_layer_model_projection(embeds) * self.embed_tokens.embedding_dim**-0.5
        proj = self.per_layer_projection_norm(proj.view(t, -1, self.ple))
        return (proj + token) * 2.0**-0.5

    def embed(self, input_ids: Tensor) -> Tensor:
        return self.embed_tokens(input_ids) * self.normalizer

    def saved(self, input_ids: Tensor, embeds: Tensor) -> dict[str, Tensor]:
        pli = self.per_layer_inputs(input_ids, embeds)
        return {} if pli is None else {_PER_LAYER: pli}

    def describe(self) -> ModelDesc:
        layers = [cast(Gemma4DecoderLayer, layer).describe() for layer in self.layers]
        return ModelDesc.of(self.embed, layers, Norm(self.norm, Residual.NONE), self.saved)


class Gemma4ForCausalLM(CausalLM):
    """Gemma 4 text (tensor parallelism: `Gemma4Model`)."""

    stacked_params = (
        StackedParam(".gate_proj.", ".gate_up_proj.", 0),
        StackedParam(".up_proj.", ".gate_up_proj.", 1),
    )
    weight_prefix = ""  # Gemma4ForConditionalGeneration: where the text model's tensors sit

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
        text = self.text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.dtype = dtype
        self.model = Gemma4Model(text, tp=tp, dtype=dtype, device=device)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.lm_head = ParallelLMHead(text.vocab_size, text.hidden_size, tp=tp, dtype=dtype, device=device)
        if self.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)
        cap = getattr(text, "final_logit_softcapping", None)
        self.final_logit_softcapping: float | None = float(cap) if cap else None
        attns = [cast(Gemma4DecoderLayer, layer).self_attn for layer in self.model.layers]
        self.num_layers: int = text.num_hidden_layers
        first = attns[0].attn
        self.num_kv_heads: int = first.num_kv_heads
        self.head_size: int = first.head_size
        # per layer (KV heads, head size); a layer reading another's KV owns no head
        self.kv_cache_shapes: list[tuple[int, int]] | None = [
            (0 if a.kv_owner is not None else a.attn.num_kv_heads, a.attn.head_size) for a in attns
        ]
        windows = [w for w in _layer_windows(text) if w is not None]
        self.sliding_window: int | None = max(windows) if windows else None
        self.max_position: int = int(getattr(text, "max_position_embeddings", 8192))

    def forward(
        self, input_ids: Tensor, positions: Tensor, ctx: ForwardContext, mm: MultiModalBatch | None = None
    ) -> Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden]."""
        return cast(Tensor, self.model(input_ids, positions, ctx))

    def compute_logits(self, hidden: Tensor) -> Tensor | None:
        """[N, hidden] -> [N, vocab] float32, capped as ``cap * tanh(logits / cap)`` when the config sets
        final_logit_softcapping."""
        logits = self.lm_head.compute_logits(hidden)
        cap = self.final_logit_softcapping
        if logits is None or cap is None:
            return logits
        return torch.tanh(logits / cap) * cap

    def _text_weights(self, weights: Iterable[tuple[str, Loaded]]) -> Iterator[tuple[str, Loaded]]:
        """The text model's tensors under HF's causal-LM names; the KV tensors of layers sharing KV (which
        some checkpoints carry, HF ignores them) dropped."""
        prefix = self.weight_prefix
        owners = [cast(Gemma4DecoderLayer, layer).self_attn.kv_owner for layer in self.model.layers]
        unused = tuple(
            f"model.layers.{i}.self_attn.{name}."
            for i, owner in enumerate(owners)
            if owner is not None
            for name in ("k_proj", "v_proj", "k_norm", "v_norm")
        )
        for name, tensor in weights:
            if prefix:
                if name.startswith(prefix):
                    name = "model." + name[len(prefix) :]
                elif name != "lm_head.weight":
                    continue  # the vision and audio towers
            if not name.startswith(unused):
                yield name, tensor

    def load_weights(self, weights: Iterable[tuple[str, Loaded]]) -> None:
        """Load HF-named tensors; every parameter must be covered (ValueError naming what is missing)."""
        skip: tuple[str, ...] = ("rotary_emb.inv_freq",)
        if self.tie_word_embeddings:
            skip = (*skip, "lm_head.weight")
        load_weights_into(self, self._text_weights(weights), self.stacked_params, skip=skip)


class Gemma4ForConditionalGeneration(Gemma4ForCausalLM):
    """The text part of Gemma 4's multimodal checkpoints (`text_config`; tensors under
    `model.language_model.`); the vision and audio towers are not loaded."""

    weight_prefix = "model.language_model."
