"""A per-layer device form: what a loaded model's layers become for the device they run on (weights
repacked, quantized, or switched to another kernel), as vLLM's `process_weights_after_loading` gives each
layer its kernel's weight layout once its weights are in.

A form sees every module of one walk (`visit`, in `named_modules` order: a parent before its children,
each module once) and then the whole model (`finish`, which says how many layers took the form). Several
forms share one walk (`apply_forms`), each module visited by them in their order, so a form that follows
another sees each layer as the earlier form left it. Which forms apply is read from `PrepareOptions`
(`pagedrs.models.prepare` holds the ordered table).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

__all__ = ["DeviceForm", "PrepareOptions", "apply_forms"]


@dataclass(frozen=True, slots=True)
class PrepareOptions:
    """Which device forms a model takes. Every form is off by default: a caller turns on what its model
    needs, and a rank whose weights must stay as loaded (liquid scaling moves them) leaves that form off."""

    after_load: bool = False  # once the weights are in: quantized pieces in their layer method's form
    quantize_q8_0: bool = False  # quantization="q8_0": dense float32 CPU weights to Q8_0 blocks
    cpu_quantized: bool = False  # the quantized CPU path: Rust norm/activation/rotary ops, the decode step
    pack_dense: bool = False  # dense float32 CPU weights packed for oneDNN's matmul
    integer_matmuls: bool = (
        False  # batch invariance: quantized weights on the integer kernels at any row count
    )
    layer_kernels: bool | None = None  # the fused CUDA layer kernels on or off; None leaves them as they are


class DeviceForm:
    """One form. A subclass names itself, says when it applies, and overrides `visit` and/or `finish`."""

    name: ClassVar[str]

    @classmethod
    def for_options(cls, opts: PrepareOptions) -> DeviceForm | None:
        """The form for `opts`, or None when they leave it off."""
        return cls() if cls.wanted(opts) else None

    @staticmethod
    def wanted(opts: PrepareOptions) -> bool:
        raise NotImplementedError

    def visit(self, name: str, module: torch.nn.Module) -> None:
        """See one module of the walk."""

    def finish(self, model: torch.nn.Module) -> int:
        """After the walk: the layers that took the form."""
        return 0


def apply_forms(model: torch.nn.Module, forms: Sequence[DeviceForm]) -> dict[str, int]:
    """One walk over `model` giving each module every form in turn; {form name: layers that took it}."""
    for name, module in model.named_modules():
        for form in forms:
            form.visit(name, module)
    return {form.name: form.finish(model) for form in forms}
