"""The experts method of a mixture-of-experts layer (vLLM's `FusedMoEMethodBase`): one object per layer
that owns the weights' form after load (`after_load`) and the forward (`apply`), chosen at prepare time,
never per call.

    method          weights it takes                                  forward
    TorchExperts    any form (a quantized one dequantized per call)    torch loop: the oracle, any device
    CpuExperts      dense float32 on a CPU                             Rust kernel up to F32_KERNEL_MAX_ROWS
                                                                       rows, torch's GEMMs above (measured)
    GgufCpuExperts  GGUF blocks on a CPU (beside a dense float32 one)  Rust kernel (`cpu_fused_experts`)
    CudaExperts     Q8_0 / FP8 kernel form or dense f16/bf16/f32,      cuda/moe_ops.cu
                    on a CUDA device                                   (`cuda_fused_experts`)

Two moments choose, both in the prepare walk (`pagedrs.models.prepare`):
- after load (`after_load_method`): the pieces the checkpoint handed over and the device say which method
  repacks them: Q8_0 / FP8 pieces on a CUDA device CudaExperts (its kernel form), GGUF blocks a CPU kernel
  takes on a float32 CPU layer GgufCpuExperts (stacked blocks), anything else the dense methods (the pieces
  dequantized into the weight);
- the forward (`choose_method`), from the form after load left, the device and the layer kernels switch
  (`FusedExperts.cuda_kernels`, set with the attention backend by `kernel_switch.LayerKernels`): the CUDA
  kernels where switched on, or where the weights are kept for them and the switch was not turned off;
  else the CPU kernels' method for the form; else torch.

A method asked for by name (`FusedExperts.use_method`) that cannot run the layer is refused there with
its reason (`unfit`), never skipped at run time.
"""

from __future__ import annotations

from typing import ClassVar, Protocol

import torch
from torch import Tensor

from pagedrs.distributed.group import TPGroup
from pagedrs.layers.moe import kernel_form
from pagedrs.layers.moe.cpu import F32_KERNEL_MAX_ROWS, cpu_fused_experts
from pagedrs.layers.moe.expert_weights import ExpertWeights
from pagedrs.layers.moe.torch_step import ExpertActivation, fused_experts_torch

__all__ = [
    "CpuExperts",
    "CudaExperts",
    "ExpertsLayer",
    "ExpertsMethod",
    "GgufCpuExperts",
    "TorchExperts",
    "after_load_method",
    "choose_method",
]

_CUDA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class ExpertsLayer(Protocol):
    """What a method reads of its layer (`experts.FusedExperts`)."""

    @property
    def gate_up(self) -> ExpertWeights: ...

    @property
    def down(self) -> ExpertWeights: ...

    @property
    def gate_up_bias(self) -> Tensor | None: ...

    @property
    def down_bias(self) -> Tensor | None: ...

    @property
    def activation(self) -> ExpertActivation: ...

    @property
    def tp(self) -> TPGroup: ...

    @property
    def cuda_kernels(self) -> bool | None:
        """The layer kernels switch: on, off, or not switched (None)."""


def _weights(layer: ExpertsLayer) -> tuple[tuple[str, ExpertWeights], ...]:
    return (("gate_up", layer.gate_up), ("down", layer.down))


def _biases(layer: ExpertsLayer) -> tuple[Tensor | None, Tensor | None]:
    """(gate_up bias, down bias) as this rank adds them: under tensor parallelism the down bias is added by
    one rank only (the block sums the ranks)."""
    return layer.gate_up_bias, layer.down_bias if layer.tp.position == 0 else None


def _not_float32_cpu(name: str, t: Tensor) -> str | None:
    if t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous():
        return f"the Rust experts kernel takes contiguous float32 on a CPU, {name} is {t.dtype} on {t.device}"
    return None


def _bias_unfit(layer: ExpertsLayer) -> str | None:
    for name, b in (("gate_up_bias", layer.gate_up_bias), ("down_bias", layer.down_bias)):
        reason = None if b is None else _not_float32_cpu(name, b)
        if reason:
            return reason
    return None


class ExpertsMethod:
    """One way to hold and run a layer's experts. A subclass names itself, says why it cannot run a
    layer (`unfit`), repacks the loaded pieces into its form (`after_load`) and runs the step (`apply`)."""

    name: ClassVar[str]
    cpu_kernel: ClassVar[bool] = False  # the step is the Rust CPU kernel (the CPU decode step replays it)

    @classmethod
    def unfit(cls, layer: ExpertsLayer) -> str | None:
        """Why this method cannot run `layer` as its weights are held, or None when it can."""
        return None

    @classmethod
    def after_load(cls, layer: ExpertsLayer) -> None:
        """The quantized pieces loading held (`ExpertWeights.pending`) in this method's form; the dense
        methods dequantize them into the weights."""
        for _, w in _weights(layer):
            w.take_dense()

    def apply(self, layer: ExpertsLayer, x: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
        """This rank's partial sum of the step: x [T, H] -> [T, H]."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class TorchExperts(ExpertsMethod):
    """The torch loop over the active experts (`fused_experts_torch`) on the weights as floats: any form,
    any device. A weight kept quantized is dequantized each call (the CUDA kernel form where the layer
    kernels are switched off, as the torch attention backend wants every op in torch)."""

    name = "torch"

    def apply(self, layer: ExpertsLayer, x: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
        b_gate_up, b_down = _biases(layer)
        return fused_experts_torch(
            x,
            layer.gate_up.dense(),
            layer.down.dense(),
            topk_weights,
            topk_ids,
            activation=layer.activation,
            b_gate_up=b_gate_up,
            b_down=b_down,
        )


_TORCH = TorchExperts()


def _cpu_kernel(layer: ExpertsLayer, x: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
    act = layer.activation
    b_gate_up, b_down = _biases(layer)
    return cpu_fused_experts(
        x,
        layer.gate_up,
        layer.down,
        topk_weights,
        topk_ids,
        gate_up_bias=b_gate_up,
        down_bias=b_down,
        swiglu=None if act.swiglu_limit is None else (act.swiglu_alpha, act.swiglu_limit),
    )


class CpuExperts(ExpertsMethod):
    """Dense float32 experts on a CPU: the Rust kernel (`_core.moe_experts`) for a step of up to
    `F32_KERNEL_MAX_ROWS` rows, torch's per-expert GEMMs above (where they were measured faster)."""

    name = "cpu"
    cpu_kernel = True

    @classmethod
    def unfit(cls, layer: ExpertsLayer) -> str | None:
        for name, w in _weights(layer):
            if w.qweight is not None or w.kernel_weight is not None:
                return f"{name} is kept quantized, not dense"
            reason = _not_float32_cpu(name, w.weight)
            if reason:
                return reason
        return _bias_unfit(layer)

    def apply(self, layer: ExpertsLayer, x: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
        if x.shape[0] > F32_KERNEL_MAX_ROWS:
            return _TORCH.apply(layer, x, topk_weights, topk_ids)
        return _cpu_kernel(layer, x, topk_weights, topk_ids)


class GgufCpuExperts(ExpertsMethod):
    """Experts kept as GGUF blocks (any type a CPU kernel takes, MXFP4 included), stacked per projection
    and multiplied by the Rust kernel at every row count; a projection loaded dense is its float32
    operand."""

    name = "gguf_cpu"
    cpu_kernel = True

    @classmethod
    def unfit(cls, layer: ExpertsLayer) -> str | None:
        if all(w.qweight is None for _, w in _weights(layer)):
            return "no projection is kept as GGUF blocks (they load dense off a float32 CPU layer)"
        for name, w in _weights(layer):
            if w.kernel_weight is not None:
                return f"{name} is kept for the CUDA kernels"
            reason = None if w.qweight is not None else _not_float32_cpu(name, w.weight)
            if reason:
                return reason
        return _bias_unfit(layer)

    @classmethod
    def after_load(cls, layer: ExpertsLayer) -> None:
        for _, w in _weights(layer):
            if not w.take_gguf():
                w.take_dense()

    def apply(self, layer: ExpertsLayer, x: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
        return _cpu_kernel(layer, x, topk_weights, topk_ids)


class CudaExperts(ExpertsMethod):
    """The grouped GEMM kernels of cuda/moe_ops.cu (vLLM's `fused_moe`) on a CUDA device, the experts
    dense in the layer's dtype or kept in the kernels' form (GGUF Q8_0 blocks, FP8 e4m3 with per-row or
    block scales: `kernel_form`)."""

    name = "cuda"

    @classmethod
    def unfit(cls, layer: ExpertsLayer) -> str | None:
        w0 = layer.gate_up.weight
        if not kernel_form.kernel_device(w0):
            return f"the CUDA fused experts kernels run on a CUDA device, the experts are on {w0.device}"
        for name, w in _weights(layer):
            if w.qweight is not None:
                return f"{name} is kept as GGUF blocks for the CPU kernels"
            if w.kernel_weight is None and w.weight.dtype not in _CUDA_DTYPES:
                return f"the CUDA experts kernels take float16/bfloat16/float32, {name} is {w.weight.dtype}"
        return None

    @classmethod
    def after_load(cls, layer: ExpertsLayer) -> None:
        for _, w in _weights(layer):
            if not w.take_kernel():
                w.take_dense()

    def apply(self, layer: ExpertsLayer, x: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
        from pagedrs.layers.moe.cuda import cuda_fused_experts

        b_gate_up, b_down = _biases(layer)
        return cuda_fused_experts(
            x,
            layer.gate_up,
            layer.down,
            topk_weights,
            topk_ids,
            activation=layer.activation,
            gate_up_bias=b_gate_up,
            down_bias=b_down,
        )


def after_load_method(layer: ExpertsLayer) -> type[ExpertsMethod]:
    """The method whose form the loaded pieces take: the CUDA kernels' where some projection arrived in
    it on a CUDA device, the GGUF CPU kernels' where some arrived as GGUF blocks they take on a float32
    CPU layer, else dense."""
    weights = [w for _, w in _weights(layer)]
    if any(w.kernel_stackable() for w in weights):
        return CudaExperts
    if any(w.gguf_stackable() for w in weights):
        return GgufCpuExperts
    return TorchExperts


def choose_method(layer: ExpertsLayer) -> ExpertsMethod:
    """The forward for the layer's weights as held (see the module docstring)."""
    kernels = layer.cuda_kernels
    kept_for_kernel = any(w.kernel_weight is not None for _, w in _weights(layer))
    cuda = kernels or (kernels is None and kept_for_kernel)
    candidates: tuple[type[ExpertsMethod], ...] = (
        (CudaExperts, GgufCpuExperts, CpuExperts) if cuda else (GgufCpuExperts, CpuExperts)
    )
    for cls in candidates:
        if cls.unfit(layer) is None:
            return cls()
    return TorchExperts()
