"""Activations, including the gated form used by Llama-style MLPs (act(gate) * up on a fused input)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from pagedrs.layers.kernel_switch import KernelLayer
from pagedrs.layers.norm import cpu_rows

__all__ = ["SiluAndMul", "GeluAndMul", "GeluTanh", "ReLU", "get_act_fn", "get_act_and_mul_fn"]


class SiluAndMul(KernelLayer):
    """x [..., 2*d] = [gate | up] -> silu(gate) * up [..., d]."""

    # Set on the quantized CPU path (loader): float32 CPU rows take one Rust call.
    cpu_fused: bool = False

    def forward(self, x: Tensor) -> Tensor:
        if self.fits(x):
            from pagedrs.kernels import layer_ops

            return layer_ops.act_and_mul(x, "silu")
        d = x.shape[-1] // 2
        if self.cpu_fused and cpu_rows(x):
            from pagedrs import _core

            out = torch.empty(x.shape[0], d, dtype=x.dtype)
            _core.cpu_silu_and_mul(x.numpy(), out.numpy())
            return out
        return F.silu(x[..., :d]) * x[..., d:]


class GeluAndMul(KernelLayer):
    """x [..., 2*d] = [gate | up] -> gelu(gate) * up, exact or tanh approximation."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
        self.approximate = approximate

    def forward(self, x: Tensor) -> Tensor:
        if self.fits(x):
            from pagedrs.kernels import layer_ops

            return layer_ops.act_and_mul(x, "gelu_tanh" if self.approximate == "tanh" else "gelu")
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d], approximate=self.approximate) * x[..., d:]


class GeluTanh(torch.nn.Module):
    """GELU with the tanh approximation (GPT-2's "gelu_new")."""

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(x, approximate="tanh")


class ReLU(torch.nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return F.relu(x)


_ACTS: dict[str, type[torch.nn.Module]] = {
    "gelu_new": GeluTanh,
    "gelu_pytorch_tanh": GeluTanh,
    "gelu_fast": GeluTanh,
    "relu": ReLU,
    "silu": torch.nn.SiLU,
    "swish": torch.nn.SiLU,
    "gelu": torch.nn.GELU,
}


def get_act_fn(name: str) -> torch.nn.Module:
    """The activation an HF config names (`hidden_act`, `activation_function`)."""
    try:
        return _ACTS[name]()
    except KeyError:
        raise ValueError(f"unsupported activation {name!r}; supported: {', '.join(sorted(_ACTS))}") from None


def get_act_and_mul_fn(name: str) -> torch.nn.Module:
    """The gated activation for a fused [gate | up] input."""
    if name in ("silu", "swish"):
        return SiluAndMul()
    if name in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
        return GeluAndMul("tanh")
    if name == "gelu":
        return GeluAndMul("none")
    raise ValueError(f"unsupported gated activation {name!r}; supported: silu, gelu, gelu_pytorch_tanh")
