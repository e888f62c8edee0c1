"""The fused experts step of a mixture-of-experts layer (vLLM's `fused_moe`, llama.cpp's `mul_mat_id`):
the step's (token, expert) pairs sorted by expert once, then each expert's weights multiplied against all
of its rows in one call, instead of a pass over every token for every expert.

Weights are stacked: `gate_up.weight` [E, 2 * I, H] (each expert's gate rows then its up rows, HF's
`gate_up_proj` layout) and `down.weight` [E, H, I]. Under tensor parallelism each rank holds a slice of
every expert's intermediate dimension (gate and up rows, down columns: vLLM's TP for MoE), so a rank's
output is a partial sum that the block all-reduces once.

Checkpoints ship the experts as per-expert tensors (`experts.N.w1/w3/w2` for Mixtral, `experts.N.gate_proj/
up_proj/down_proj` for Qwen) or stacked (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I],
as transformers >= 5 holds them); `expert_tensor_name` maps either onto the stacked parameters.

On a CPU with float32 activations the step is one Rust call (`_core.moe_experts_f32`, or
`_core.moe_experts_quant` for GGUF-quantized experts); on a CUDA device the grouped GEMM kernels of
cuda/moe_ops.cu (`cuda.cuda_fused_experts`), with the experts dense, GGUF Q8_0 or FP8 (kept quantized,
`kernel_form`); elsewhere a torch loop over the active experts.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from pagedrs.distributed.group import TPGroup
from pagedrs.layers.linear import Loaded
from pagedrs.layers.moe import kernel_form
from pagedrs.layers.moe.kernel_form import dequantized as kernel_dequantized
from pagedrs.layers.moe.kernel_form import keeps_for_kernel, stack_for_kernel
from pagedrs.layers.moe.routing import sort_by_expert
from pagedrs.layers.moe.stacked_quant import StackedQuantWeight
from pagedrs.quantization.gguf_blocks import GGUFWeight

if TYPE_CHECKING:
    from pagedrs.kernels.moe_ops import ExpertMatrix

__all__ = ["ExpertActivation", "ExpertWeights", "FusedExperts", "expert_tensor_name", "fused_experts_torch"]


@dataclass(frozen=True, slots=True)
class ExpertActivation:
    """What an expert applies between its gate/up and down projections.

    swiglu_limit None: silu(gate) * up (Mixtral, Qwen). Otherwise gpt-oss's clamped SwiGLU (HF's
    GptOssExperts._apply_gate): gate clamped to at most `swiglu_limit`, up to +-`swiglu_limit`, then
    (up + 1) * gate * sigmoid(`swiglu_alpha` * gate)."""

    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702

    def __call__(self, gate: Tensor, up: Tensor) -> Tensor:
        if self.swiglu_limit is None:
            return F.silu(gate) * up
        gate = gate.clamp(max=self.swiglu_limit)
        up = up.clamp(min=-self.swiglu_limit, max=self.swiglu_limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.swiglu_alpha))


SILU = ExpertActivation()

# per-expert checkpoint tensors: (expert id, piece) of `gate_up` (gate 0, up 1) or `down`
_PER_EXPERT = re.compile(r"\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_PIECES = {"w1": ("gate_up", 0), "gate_proj": ("gate_up", 0), "w3": ("gate_up", 1), "up_proj": ("gate_up", 1)}
_STACKED = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")


def expert_tensor_name(name: str) -> tuple[str, object] | None:
    """(parameter name, shard id) of an expert tensor of a checkpoint, None for any other tensor.
    Per-expert tensors are shard (expert, piece); a stacked one is the whole parameter (shard None)."""
    m = _PER_EXPERT.search(name)
    if m:
        param, piece = _PIECES.get(m.group(2), ("down", 0))
        return f"{name[: m.start()]}.experts.{param}.weight", (int(m.group(1)), piece)
    m = _STACKED.search(name)
    if m:
        param = "gate_up" if m.group(1) == "gate_up_proj" else "down"
        return f"{name[: m.start()]}.experts.{param}.weight", None
    return None


class ExpertWeights(torch.nn.Module):
    """One linear layer per expert, stacked: `weight` [E, out, in]. `split` "column": the output rows of
    each piece (`output_sizes`: gate and up) are split over the tensor-parallel ranks; "row": the input
    columns are. Shard ids are (expert, piece); shard None is the whole stacked tensor [E, out, in].
    GGUF-quantized pieces of a type the CPU kernels take are kept quantized (`qweight`)."""

    def __init__(
        self,
        num_experts: int,
        output_sizes: Sequence[int],
        input_size: int,
        *,
        split: str,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        if split not in ("column", "row"):
            raise ValueError(f"split must be 'column' or 'row', got {split!r}")
        self.num_experts, self.split, self.tp = num_experts, split, tp
        self.output_sizes, self.input_size = list(output_sizes), input_size
        parts = tp.size if split == "column" else 1
        for s in self.output_sizes:
            if s % parts:
                raise ValueError(
                    f"expert output size {s} is not divisible by the tensor-parallel size {parts}"
                )
        if split == "row" and input_size % tp.size:
            raise ValueError(
                f"expert input size {input_size} is not divisible by the tensor-parallel size {tp.size}"
            )
        self.rows = sum(self.output_sizes) // parts
        self.cols = input_size // (tp.size if split == "row" else 1)
        self.weight = torch.nn.Parameter(
            torch.empty(num_experts, self.rows, self.cols, dtype=dtype, device=device), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]  # our attribute
        self.expert_shards: tuple[tuple[int, int], ...] = tuple(
            (e, p) for e in range(num_experts) for p in range(len(self.output_sizes))
        )
        self.shard_ids: tuple[object, ...] = self.expert_shards  # what the loader checks is covered
        self.qweight: StackedQuantWeight | None = None
        self._qpieces: dict[tuple[int, int], GGUFWeight] = {}
        # quantized for the CUDA kernel (GGUF Q8_0 on a CUDA device, FP8): `kernel_form`
        self.kernel_weight: ExpertMatrix | None = None
        self._kpieces: dict[tuple[int, int], object] = {}
        self._dense_pieces = 0  # pieces loaded dense (a weight mixing them with kernel pieces is all dense)

    def _piece_rows(self, piece: int) -> tuple[int, int, int]:
        """(offset in this rank's rows, rows this rank holds, first full row it holds) of one piece."""
        parts = self.tp.size if self.split == "column" else 1
        n = self.output_sizes[piece] // parts
        offset = sum(self.output_sizes[:piece]) // parts
        return offset, n, (self.tp.position * n if self.split == "column" else 0)

    def weight_loader(self, param: Tensor, loaded: Loaded, shard_id: object = None) -> None:
        if shard_id is None:
            want = (self.num_experts, sum(self.output_sizes), self.input_size)
            if tuple(loaded.shape) != want:
                raise ValueError(f"shape mismatch: expected {want}, got {tuple(loaded.shape)}")
            full = loaded.materialize() if hasattr(loaded, "materialize") else loaded
            for e in range(self.num_experts):
                start = 0
                for p, size in enumerate(self.output_sizes):
                    self.weight_loader(param, full[e].narrow(0, start, size), (e, p))
                    start += size
            return
        if not (isinstance(shard_id, tuple) and shard_id in self.shard_ids):
            raise ValueError(f"unknown expert shard {shard_id!r}")
        e, p = shard_id
        piece_shape = (self.output_sizes[p], self.input_size)
        if tuple(loaded.shape) != piece_shape:
            raise ValueError(
                f"shape mismatch (expert {e}): expected {piece_shape}, got {tuple(loaded.shape)}"
            )
        offset, n, first = self._piece_rows(p)
        piece = loaded.narrow(0, first, n)
        if self.split == "row":
            piece = piece.narrow(1, self.tp.position * self.cols, self.cols)
        if keeps_for_kernel(piece, param):
            self._kpieces[(e, p)] = piece
        elif isinstance(piece, GGUFWeight) and piece.has_kernel and param.device.type == "cpu":
            self._qpieces[(e, p)] = piece
            if len(self._qpieces) == len(self.shard_ids):
                self._take_quantized(param)
            return
        else:
            read = getattr(piece, "materialize", None)
            param.data[e, offset : offset + n].copy_(read() if read is not None else cast(Tensor, piece))
            self._dense_pieces += 1
        if self._kpieces and len(self._kpieces) + self._dense_pieces >= len(self.shard_ids):
            self._take_kernel_form(param)
        elif self._dense_pieces >= len(self.shard_ids):  # all dense: a later load starts afresh
            self._dense_pieces = 0

    def _take_quantized(self, param: Tensor) -> None:
        """Every piece arrived quantized: stack them per expert (pieces in order) if they share one type,
        else dequantize them into the dense weight."""
        pieces = [self._qpieces[sid] for sid in self.expert_shards]
        self._qpieces = {}
        if len({p.ggml_type for p in pieces}) == 1 and param.dtype == torch.float32:
            per = len(self.output_sizes)
            data = [
                np.concatenate([p.data for p in pieces[e * per : (e + 1) * per]])
                for e in range(self.num_experts)
            ]
            self.qweight = StackedQuantWeight(pieces[0].ggml_type, np.stack(data), self.cols)
            param.data = torch.empty(0, self.rows, self.cols, dtype=param.dtype)
            return
        for (e, k), p in zip(self.expert_shards, pieces, strict=True):
            offset, n, _ = self._piece_rows(k)
            param.data[e, offset : offset + n].copy_(p.materialize())

    def _take_kernel_form(self, param: Tensor) -> None:
        """Every piece arrived: if all in a form the CUDA kernel takes, stack them in its layout
        (`kernel_form`); else (some pieces dense, or forms the kernel cannot stack together) dequantize the
        kept ones into the dense weight."""
        shards = [sid for sid in self.expert_shards if sid in self._kpieces]
        pieces = [self._kpieces[sid] for sid in shards]
        self._kpieces, dense, self._dense_pieces = {}, self._dense_pieces, 0
        m = None if dense else stack_for_kernel(pieces, len(self.output_sizes), self.cols, param.device)
        if m is not None:
            self.kernel_weight = m
            param.data = torch.empty(0, self.rows, self.cols, dtype=param.dtype, device=param.device)
            return
        for (e, k), p in zip(shards, pieces, strict=True):
            offset, n, _ = self._piece_rows(k)
            param.data[e, offset : offset + n].copy_(cast(Loaded, p).materialize())  # type: ignore[union-attr]

    def dense(self) -> Tensor:
        """The weights [E, out, in] (float32 dequantized when kept GGUF-quantized for the CPU; the layer's
        dtype when kept for the CUDA kernel)."""
        if self.kernel_weight is not None:
            return kernel_dequantized(self.kernel_weight).to(self.weight.dtype)
        return self.qweight.dequantized() if self.qweight is not None else self.weight


def fused_experts_torch(
    x: Tensor,
    w_gate_up: Tensor,
    w_down: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    *,
    activation: ExpertActivation = SILU,
    b_gate_up: Tensor | None = None,
    b_down: Tensor | None = None,
) -> Tensor:
    """sum over a token's k experts of weight * down(act(gate(x), up(x))): [T, H]. The pairs sorted by
    expert once, each active expert's rows in one matmul; the k products summed in top-k order (as HF's
    grouped experts forward). `b_gate_up` [E, 2I] / `b_down` [E, H]: the experts' biases (gpt-oss)."""
    num_tokens, k = topk_ids.shape
    order, counts = sort_by_expert(topk_ids, w_gate_up.shape[0])
    xs = x[order // k]
    ys = torch.empty(num_tokens * k, w_down.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n:
            bias = None if b_gate_up is None else b_gate_up[e]
            gate, up = F.linear(xs[start : start + n], w_gate_up[e], bias).chunk(2, dim=-1)
            bias = None if b_down is None else b_down[e]
            ys[start : start + n] = F.linear(activation(gate, up), w_down[e], bias)
            start += n
    pairs = torch.empty_like(ys)
    pairs[order] = ys * topk_weights.reshape(-1)[order, None].to(ys.dtype)
    return pairs.view(num_tokens, k, -1).sum(dim=1)


class FusedExperts(torch.nn.Module):
    """E gated MLPs, stacked; `forward(x, topk_weights, topk_ids)` is this rank's partial sum. `bias`: each
    projection has a bias per expert (`gate_up_bias` [E, gate then up], `down_bias` [E, H]; gpt-oss),
    `activation` SiLU-gated unless set (both taken by the Rust kernels as by the torch step)."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device | str,
        bias: bool = False,
        activation: ExpertActivation = SILU,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.activation, self.tp = activation, tp
        self.gate_up = ExpertWeights(
            num_experts,
            [intermediate_size] * 2,
            hidden_size,
            split="column",
            tp=tp,
            dtype=dtype,
            device=device,
        )
        self.down = ExpertWeights(
            num_experts, [hidden_size], intermediate_size, split="row", tp=tp, dtype=dtype, device=device
        )
        self.use_kernels = True  # the Rust kernels where they apply (tests and benches turn them off)
        self.cuda_kernels = (
            False  # cuda/moe_ops.cu on CUDA devices: set with the layer kernels (kernel_switch)
        )
        self.gate_up_bias: torch.nn.Parameter | None = None
        self.down_bias: torch.nn.Parameter | None = None
        if bias:
            rows = self.gate_up.rows
            self.gate_up_bias = torch.nn.Parameter(
                torch.zeros(num_experts, rows, dtype=dtype, device=device), requires_grad=False
            )
            self.gate_up_bias.weight_loader = self._gate_up_bias_loader  # type: ignore[attr-defined]
            self.down_bias = torch.nn.Parameter(
                torch.zeros(num_experts, hidden_size, dtype=dtype, device=device), requires_grad=False
            )

    def _gate_up_bias_loader(self, param: Tensor, loaded: Tensor) -> None:
        """[E, 2I] (gate then up) -> this rank's slice of each piece."""
        loaded = loaded.materialize() if hasattr(loaded, "materialize") else loaded
        want = (self.num_experts, sum(self.gate_up.output_sizes))
        if tuple(loaded.shape) != want:
            raise ValueError(f"shape mismatch: expected {want}, got {tuple(loaded.shape)}")
        start = 0
        for p, size in enumerate(self.gate_up.output_sizes):
            offset, n, first = self.gate_up._piece_rows(p)
            param.data[:, offset : offset + n].copy_(loaded[:, start + first : start + first + n])
            start += size

    def forward(self, x: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
        from pagedrs.layers.moe.cpu import cpu_fused_experts

        # under tensor parallelism the down bias is added by one rank only (the block sums the ranks)
        b_down = self.down_bias if self.tp.position == 0 else None
        if self.use_kernels and self.cuda_kernels and kernel_form.kernel_device(x):
            from pagedrs.layers.moe.cuda import cuda_fused_experts

            out = cuda_fused_experts(
                x,
                self.gate_up,
                self.down,
                topk_weights,
                topk_ids,
                activation=self.activation,
                gate_up_bias=self.gate_up_bias,
                down_bias=b_down,
            )
            if out is not None:
                return out
        if self.use_kernels and self.gate_up.kernel_weight is None and self.down.kernel_weight is None:
            act = self.activation
            swiglu = None if act.swiglu_limit is None else (act.swiglu_alpha, act.swiglu_limit)
            out = cpu_fused_experts(
                x,
                self.gate_up,
                self.down,
                topk_weights,
                topk_ids,
                gate_up_bias=self.gate_up_bias,
                down_bias=b_down,
                swiglu=swiglu,
            )
            if out is not None:
                return out
        return fused_experts_torch(
            x,
            self.gate_up.dense(),
            self.down.dense(),
            topk_weights,
            topk_ids,
            activation=self.activation,
            b_gate_up=self.gate_up_bias,
            b_down=b_down,
        )
