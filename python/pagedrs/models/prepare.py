"""A loaded model prepared for its device, as vLLM's `process_weights_after_loading`: one walk gives each
layer the device forms its options turn on, in the order of `DEVICE_FORMS`.

Two callers, each for what it knows: the loader, once the weights are in (`after_load`: the quantized
pieces each layer kept, in the form of its method; `quantize_q8_0`, `cpu_quantized`: the weights' form on
a CPU), and the model runner of every rank, for its model and its draft model (`pack_dense`, off where liquid scaling moves the weights between ranks; `integer_matmuls`;
`layer_kernels`, which follow the runner's attention backend and so are set again by each runner that
reuses a model). A form on a model twice is a no-op: each skips the layers it has given its form.

A new form is one file (a `DeviceForm` subclass: when it applies, what it does to a layer) and one line
in `DEVICE_FORMS`.
"""

from __future__ import annotations

import torch

from pagedrs.config import EngineConfig
from pagedrs.layers.cpu_fused import CpuFusedOps
from pagedrs.layers.device_form import DeviceForm, PrepareOptions, apply_forms
from pagedrs.layers.integer_matmuls import IntegerMatmuls
from pagedrs.layers.kernel_switch import LayerKernels
from pagedrs.layers.moe.after_load import ExpertsAfterLoad
from pagedrs.layers.onednn import PackDense
from pagedrs.layers.quantize_at_load import QuantizeQ8_0
from pagedrs.models.cpu_decode import CpuDecode

__all__ = ["DEVICE_FORMS", "PrepareOptions", "prepare_for_device", "runner_options"]

# In the order a layer takes them: the loaded pieces in their method's form first; Q8_0 blocks before the
# CPU ops and the decode step that run on them; oneDNN packing after, for the float32 weights still dense.
DEVICE_FORMS: tuple[type[DeviceForm], ...] = (
    ExpertsAfterLoad,
    QuantizeQ8_0,
    CpuFusedOps,
    CpuDecode,
    PackDense,
    IntegerMatmuls,
    LayerKernels,
)


def prepare_for_device(model: torch.nn.Module, opts: PrepareOptions) -> dict[str, int]:
    """Give `model`'s layers the device forms `opts` turn on, in one walk; {form: layers that took it}."""
    forms = [f for f in (cls.for_options(opts) for cls in DEVICE_FORMS) if f is not None]
    return apply_forms(model, forms) if forms else {}


def runner_options(config: EngineConfig, *, layer_kernels: bool | None = None) -> PrepareOptions:
    """The forms a model runner gives its model (`layer_kernels`: what its attention backend takes) and its
    draft model (None: left as loaded): oneDNN packing, except where liquid scaling moves the dense weights
    between ranks; the integer kernels under batch invariance."""
    moves_weights = len(config.parallel.liquid_gpu_range or ()) > 1
    return PrepareOptions(
        pack_dense=not moves_weights,
        integer_matmuls=config.device.batch_invariant,
        layer_kernels=layer_kernels,
    )
