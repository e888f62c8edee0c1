"""The experts' after-load step as a device form (vLLM's `process_weights_after_loading`): every
mixture-of-experts layer whose loading held quantized pieces gives them its method's form and chooses its
forward (`FusedExperts.process_weights_after_loading`), first in the prepare walk, so the forms after it
(the CPU decode step, the layer kernels) see the experts as they will run."""

from __future__ import annotations

import torch

from pagedrs.layers.device_form import DeviceForm, PrepareOptions
from pagedrs.layers.moe.experts import FusedExperts

__all__ = ["ExpertsAfterLoad"]


class ExpertsAfterLoad(DeviceForm):
    """Each FusedExperts' after-load step; counts the layers whose pieces it repacked."""

    name = "after_load"

    def __init__(self) -> None:
        self.count = 0

    @staticmethod
    def wanted(opts: PrepareOptions) -> bool:
        return opts.after_load

    def visit(self, name: str, module: torch.nn.Module) -> None:
        if isinstance(module, FusedExperts) and module.process_weights_after_loading():
            self.count += 1

    def finish(self, model: torch.nn.Module) -> int:
        return self.count
