"""The fused experts step of a mixture-of-experts layer (vLLM's `fused_moe`, llama.cpp's `mul_mat_id`):
the step's (token, expert) pairs sorted by expert once, then each expert's weights multiplied against all
of its rows in one call, instead of a pass over every token for every expert.

Weights are stacked (`expert_weights.ExpertWeights`): `gate_up.weight` [E, 2 * I, H] (each expert's gate
rows then its up rows, HF's `gate_up_proj` layout) and `down.weight` [E, H, I]. Under tensor parallelism
each rank holds a slice of every expert's intermediate dimension, so a rank's output is a partial sum that
the block all-reduces once.

Checkpoints ship the experts as per-expert tensors (`experts.N.w1/w3/w2` for Mixtral, `experts.N.gate_proj/
up_proj/down_proj` for Qwen) or stacked (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I],
as transformers >= 5 holds them); `expert_tensor_name` maps either onto the stacked parameters.

How the weights are held and the step runs is the layer's experts method (`method`, vLLM's
`FusedMoEMethodBase`): the Rust CPU kernels (float32 or GGUF blocks), the CUDA kernels of cuda/moe_ops.cu
(dense, Q8_0 or FP8), or a torch loop over the active experts. It is chosen once the weights are in
(`process_weights_after_loading`, from the prepare walk) and when the layer kernels are switched
(`use_cuda_kernels`); `forward` calls it, nothing else.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pagedrs.distributed.group import TPGroup
from pagedrs.layers.moe.expert_weights import ExpertWeights, expert_tensor_name
from pagedrs.layers.moe.method import ExpertsMethod, after_load_method, choose_method
from pagedrs.layers.moe.torch_step import SILU, ExpertActivation, fused_experts_torch

__all__ = ["ExpertActivation", "ExpertWeights", "FusedExperts", "expert_tensor_name", "fused_experts_torch"]


class FusedExperts(torch.nn.Module):
    """E gated MLPs, stacked; `forward(x, topk_weights, topk_ids)` is this rank's partial sum, run by the
    layer's experts `method`. `bias`: each projection has a bias per expert (`gate_up_bias` [E, gate then
    up], `down_bias` [E, H]; gpt-oss), `activation` SiLU-gated unless set (both taken by every method)."""

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
        # the CUDA kernels switched on or off with the layer kernels (kernel_switch); None: not switched
        self.cuda_kernels: bool | None = None
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
        # the dense parameters above are every method's until load says otherwise (vLLM's unquantized
        # method creates the same): the method for them, re-chosen after load
        self.method: ExpertsMethod = choose_method(self)

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

    def process_weights_after_loading(self) -> bool:
        """The quantized pieces loading held given their method's form (`method.after_load_method`), and
        the forward chosen for the weights as held; whether there were any (a dense load keeps its
        method). Run once by the prepare walk (`pagedrs.models.prepare`, `ExpertsAfterLoad`)."""
        if not (self.gate_up.pending or self.down.pending):
            return False
        after_load_method(self).after_load(self)
        self.method = choose_method(self)
        return True

    def use_cuda_kernels(self, enabled: bool) -> None:
        """The layer kernels switched on or off (`kernel_switch.LayerKernels`): the CUDA kernels where they
        take the weights as held, else the method for them without."""
        self.cuda_kernels = enabled
        if not (self.gate_up.pending or self.down.pending):
            self.method = choose_method(self)

    def use_method(self, cls: type[ExpertsMethod]) -> None:
        """Run the experts through `cls` (tests and benches compare methods); ValueError saying why when it
        cannot run them as they are held."""
        reason = "the weights are not prepared yet" if self.gate_up.pending or self.down.pending else None
        reason = reason or cls.unfit(self)
        if reason:
            raise ValueError(f"experts method {cls.name!r} cannot run this layer: {reason}")
        self.method = cls()

    def forward(self, x: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
        if self.gate_up.pending or self.down.pending:
            raise RuntimeError(
                "the experts hold quantized pieces not yet in their method's form: prepare the model "
                "(pagedrs.models.prepare, as load_model does) or call process_weights_after_loading()"
            )
        return self.method.apply(self, x, topk_weights, topk_ids)
