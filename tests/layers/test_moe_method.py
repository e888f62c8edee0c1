"""The experts method of a MoE layer (`pagedrs.layers.moe.method`, as vLLM's FusedMoEMethodBase): chosen
once, in the prepare walk, from the form the checkpoint's pieces arrived in, the device and the layer
kernels switch; the forward is the method's own step and never falls through to another; a method that
cannot run a layer is refused when asked for, with the reason."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

import pagedrs.layers.moe.method as method_mod
from pagedrs.distributed.group import TPGroup
from pagedrs.layers.kernel_switch import use_layer_kernels
from pagedrs.layers.moe import (
    CpuExperts,
    CudaExperts,
    FusedExperts,
    GgufCpuExperts,
    TorchExperts,
    fused_experts_torch,
    kernel_form,
    route,
)
from pagedrs.layers.moe.routing import RoutingConfig
from pagedrs.models.prepare import PrepareOptions, prepare_for_device
from pagedrs.quantization.gguf_blocks import GGUFWeight
from pagedrs.quantization.packed_parts import Fp8
from tests.loader.helpers_quant import fp8_block_quantize

E, H, INTER = 3, 32, 32  # experts, hidden, intermediate: whole 32-weight GGUF blocks
Q8_0, Q4_0 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0


def _layer(dtype: torch.dtype = torch.float32) -> FusedExperts:
    return FusedExperts(E, H, INTER, tp=TPGroup(), dtype=dtype, device="cpu")


def _pieces(layer: FusedExperts) -> list[tuple[object, tuple[int, int], torch.Tensor]]:
    """(weight, shard, float piece) for every piece of both projections, seeded."""
    g = torch.Generator().manual_seed(5)
    out = []
    for w in (layer.gate_up, layer.down):
        for shard in w.expert_shards:
            rows = w.output_sizes[shard[1]]
            out.append((w, shard, torch.randn(rows, w.input_size, generator=g) * 0.2))
    return out


def _gguf(piece: torch.Tensor, qtype: gguf.GGMLQuantizationType) -> GGUFWeight:
    data = gguf.quants.quantize(piece.numpy(), qtype)
    return GGUFWeight(int(qtype), tuple(piece.shape), data)


def _fp8(piece: torch.Tensor) -> Fp8:
    q, s = fp8_block_quantize(piece, (piece.shape[0], piece.shape[1]))
    return Fp8(q, s.reshape(-1).expand(piece.shape[0]).contiguous())


def _load(layer: FusedExperts, make) -> None:  # type: ignore[no-untyped-def]
    for w, shard, piece in _pieces(layer):
        w.weight_loader(w.weight, make(piece, shard), shard)


def _after_load(layer: FusedExperts) -> dict[str, int]:
    return prepare_for_device(layer, PrepareOptions(after_load=True))


def _step(rows: int = 5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(9)
    x = torch.randn(rows, H, generator=g)
    weights, ids = route(torch.randn(rows, E, generator=g), RoutingConfig(E, 2))
    return x, weights, ids


def _torch_ref(layer: FusedExperts, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return fused_experts_torch(
        x.double(), layer.gate_up.dense().double(), layer.down.dense().double(), w, ids
    )


def _no_torch(*args: object, **kwargs: object) -> torch.Tensor:
    raise AssertionError("the step fell through to the torch loop")


def test_dense_layers_take_the_method_their_dtype_and_device_give() -> None:
    f32, bf16 = _layer(), _layer(torch.bfloat16)
    assert isinstance(f32.method, CpuExperts) and f32.method.cpu_kernel
    assert isinstance(bf16.method, TorchExperts) and not bf16.method.cpu_kernel
    _load(f32, lambda piece, shard: piece)
    assert _after_load(f32) == {"after_load": 0}  # nothing held quantized: the method stays
    assert isinstance(f32.method, CpuExperts)


def test_gguf_pieces_take_the_gguf_cpu_method_after_load(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = _layer()
    _load(layer, lambda piece, shard: _gguf(piece, Q8_0))
    x, w, ids = _step()
    with pytest.raises(RuntimeError, match="not yet in their method's form"):
        layer(x, w, ids)  # loading holds the pieces; the prepare walk gives them their form
    with pytest.raises(ValueError, match="'gguf_cpu' cannot run this layer: the weights are not prepared"):
        layer.use_method(GgufCpuExperts)
    assert _after_load(layer) == {"after_load": 1}
    assert isinstance(layer.method, GgufCpuExperts)
    assert layer.gate_up.qweight is not None and layer.down.qweight is not None
    assert layer.gate_up.weight.numel() == 0 and not layer.gate_up.pending
    assert _after_load(layer) == {"after_load": 0}  # twice: a no-op
    want = _torch_ref(layer, x, w, ids)
    monkeypatch.setattr(method_mod, "fused_experts_torch", _no_torch)
    got = layer(x, w, ids)  # the Rust kernel, at any row count
    assert (got.double() - want).abs().max() <= 0.02 * want.abs().max()
    big = torch.randn(600, H)
    bw, bids = route(torch.randn(600, E), RoutingConfig(E, 2))
    assert layer(big, bw, bids).shape == (600, H)
    with pytest.raises(ValueError, match="float32 \\[tokens, hidden\\] activations"):
        layer(x.double(), w, ids)  # an input the kernel cannot take is an error, never another path


def test_pieces_the_cpu_kernels_cannot_stack_load_dense() -> None:
    """GGUF pieces of two types in one projection, or on a bfloat16 layer, and FP8 pieces off a CUDA
    device: dequantized into the dense weight after load, the dense method for the layer."""
    mixed = _layer()
    _load(mixed, lambda piece, shard: _gguf(piece, Q8_0 if shard[0] else Q4_0))
    assert _after_load(mixed) == {"after_load": 1}
    assert isinstance(mixed.method, CpuExperts) and mixed.gate_up.qweight is None
    assert mixed.gate_up.weight.shape == (E, 2 * INTER, H)
    bf16 = _layer(torch.bfloat16)
    _load(bf16, lambda piece, shard: _gguf(piece, Q8_0))
    _after_load(bf16)
    assert isinstance(bf16.method, TorchExperts) and bf16.down.qweight is None
    fp8 = _layer()
    _load(fp8, lambda piece, shard: _fp8(piece))
    _after_load(fp8)
    assert isinstance(fp8.method, CpuExperts) and fp8.gate_up.kernel_weight is None
    x, w, ids = _step()
    assert torch.isfinite(fp8(x, w, ids)).all()


@pytest.mark.parametrize("form", ["fp8", "q8_0"])
def test_kernel_pieces_on_a_cuda_device_take_the_cuda_method(
    form: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As on a CUDA device (kernel_device patched: the choice only, no kernel runs here): the pieces are
    stacked in the kernels' form and the CUDA method runs them; the layer kernels switched off move the
    layer to the torch loop over the same form, switched on back to the kernels."""
    monkeypatch.setattr(kernel_form, "kernel_device", lambda t: True)
    layer = _layer()
    _load(layer, (lambda piece, shard: _fp8(piece)) if form == "fp8" else (lambda p, s: _gguf(p, Q8_0)))
    assert _after_load(layer) == {"after_load": 1}
    assert isinstance(layer.method, CudaExperts)
    assert layer.gate_up.kernel_weight is not None and layer.gate_up.kernel_weight.form == form
    assert layer.gate_up.qweight is None and layer.gate_up.weight.numel() == 0
    assert use_layer_kernels(layer, enabled=False) == 1 and isinstance(layer.method, TorchExperts)
    x, w, ids = _step()
    torch.testing.assert_close(layer(x, w, ids).double(), _torch_ref(layer, x, w, ids), rtol=1e-5, atol=1e-5)
    assert use_layer_kernels(layer) == 1 and isinstance(layer.method, CudaExperts)


def test_dense_layer_on_a_cuda_device_takes_the_kernels_only_when_switched_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kernel_form, "kernel_device", lambda t: True)
    layer = _layer(torch.bfloat16)
    assert isinstance(layer.method, TorchExperts)
    layer.use_cuda_kernels(True)
    assert isinstance(layer.method, CudaExperts)
    layer.use_cuda_kernels(False)
    assert isinstance(layer.method, TorchExperts)
    f64 = _layer(torch.float64)
    f64.use_cuda_kernels(True)  # no kernel dtype: the torch loop
    assert isinstance(f64.method, TorchExperts)


def test_a_method_that_cannot_run_the_layer_is_refused_with_its_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    f32, bf16 = _layer(), _layer(torch.bfloat16)
    with pytest.raises(
        ValueError, match="'cuda' cannot run this layer: .*run on a CUDA device, the experts are on cpu"
    ):
        f32.use_method(CudaExperts)
    with pytest.raises(ValueError, match="'gguf_cpu' cannot run this layer: no projection is kept as GGUF"):
        f32.use_method(GgufCpuExperts)
    with pytest.raises(ValueError, match="'cpu' cannot run this layer: .*gate_up is torch.bfloat16 on cpu"):
        bf16.use_method(CpuExperts)
    assert isinstance(f32.method, CpuExperts) and isinstance(bf16.method, TorchExperts)  # unchanged
    f64 = _layer(torch.float64)
    monkeypatch.setattr(kernel_form, "kernel_device", lambda t: True)
    with pytest.raises(ValueError, match="'cuda' cannot run this layer: .*gate_up is torch.float64"):
        f64.use_method(CudaExperts)
    q = _layer()
    _load(q, lambda piece, shard: _gguf(piece, Q8_0))
    monkeypatch.undo()
    _after_load(q)
    with pytest.raises(ValueError, match="'cpu' cannot run this layer: gate_up is kept quantized"):
        q.use_method(CpuExperts)
    q.use_method(TorchExperts)  # the oracle takes any form
    x, w, ids = _step()
    torch.testing.assert_close(q(x, w, ids).double(), _torch_ref(q, x, w, ids), rtol=1e-5, atol=1e-5)


def test_dense_float32_method_takes_the_kernel_up_to_its_row_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = _layer()
    _load(layer, lambda piece, shard: piece)
    x, w, ids = _step(7)
    want = _torch_ref(layer, x, w, ids)
    with monkeypatch.context() as m:
        m.setattr(method_mod, "fused_experts_torch", _no_torch)
        torch.testing.assert_close(layer(x, w, ids).double(), want, rtol=1e-5, atol=1e-5)
    rows = method_mod.F32_KERNEL_MAX_ROWS + 1
    big = torch.randn(rows, H)
    bw, bids = route(torch.randn(rows, E), RoutingConfig(E, 2))

    def no_kernel(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("above the row limit the dense method runs torch's GEMMs")

    monkeypatch.setattr(method_mod, "cpu_fused_experts", no_kernel)
    assert layer(big, bw, bids).shape == (rows, H)
    np.testing.assert_array_equal(layer.gate_up.weight.shape, (E, 2 * INTER, H))
