"""Normalization layers (weights replicated on every tensor-parallel rank)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from pagedrs.layers.kernel_switch import KernelLayer

__all__ = ["GatedRMSNorm", "GemmaRMSNorm", "LayerNorm", "RMSNorm", "ZeroCenteredRMSNorm"]


def cpu_rows(*tensors: Tensor) -> bool:
    """Every tensor float32, on the CPU, C-contiguous, and the first one 2-D (what the Rust ops take)."""
    return tensors[0].dim() == 2 and all(
        t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() for t in tensors
    )


class RMSNorm(KernelLayer):
    """x * rsqrt(mean(x^2) + eps) * weight, computed in float32 like HF's LlamaRMSNorm.

    `forward(x, residual)` first adds the residual and returns (normed, new residual). With kernels on
    (KernelLayer), one fused launch does both, in place: x becomes the normed rows, residual the sum."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(
            torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False
        )

    def _norm(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)

    # Set on the quantized CPU path (loader): float32 CPU rows take one Rust call (in place with a residual).
    cpu_fused: bool = False

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        if self.fits(x, self.weight[None], *(() if residual is None else (residual,))) and (
            residual is None or residual.shape == x.shape
        ):
            from pagedrs.kernels import layer_ops

            if residual is None:
                return layer_ops.rms_norm(x, self.weight, self.eps)
            layer_ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
            return x, residual
        if self.cpu_fused and cpu_rows(x, self.weight, *(() if residual is None else (residual,))):
            from pagedrs import _core

            if residual is None:
                out = torch.empty_like(x)
                _core.cpu_rms_norm(x.numpy(), self.weight.numpy(), self.eps, out.numpy())
                return out
            if residual.shape == x.shape:
                _core.cpu_fused_add_rms_norm(x.numpy(), residual.numpy(), self.weight.numpy(), self.eps)
                return x, residual
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class GemmaRMSNorm(torch.nn.Module):
    """x * rsqrt(mean(x^2) + eps) * (1 + weight), all in float32 and cast back at the end, as HF's
    Gemma2RMSNorm / Gemma3RMSNorm (the weight is stored as the offset from 1, initialised to zeros)."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(
            torch.zeros(hidden_size, dtype=dtype, device=device), requires_grad=False
        )

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class LayerNorm(torch.nn.Module):
    """torch LayerNorm with weight and (optional) bias as plain parameters named like HF's."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        *,
        bias: bool = True,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.eps = eps
        self.hidden_size = hidden_size
        self.weight = torch.nn.Parameter(
            torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False
        )
        self.bias = (
            torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype, device=device), requires_grad=False)
            if bias
            else None
        )

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, (self.hidden_size,), self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"


class ZeroCenteredRMSNorm(torch.nn.Module):
    """x * rsqrt(mean(x^2) + eps) * (1 + weight), in float32 (HF's Qwen3_5RMSNorm)."""

    def __init__(self, size: int, eps: float, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(size, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).type_as(x)


class GatedRMSNorm(torch.nn.Module):
    """RMSNorm of x (times weight), then times silu(gate) (HF's Qwen3_5RMSNormGated)."""

    def __init__(self, size: int, eps: float, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(size, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * xf.to(dtype)
        return (out * F.silu(gate.float())).to(dtype)
