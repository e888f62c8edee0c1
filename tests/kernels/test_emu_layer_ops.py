"""The fused layer kernels of cuda/layer_ops.cu, run by the CPU emulator, against the torch path of the same
layers (RMSNorm with and without the residual add, RoPE in both layouts with partial rotary and longrope,
the gated activations); then a tiny model stepping with every layer kernel and the CUDA attention backend
on, against the all-torch path."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pagedrs.kernels import layer_ops
from pagedrs.kernels._loader import CTYPES, attention_names, cache_names, layer_op_names
from pagedrs.layers.activation import GeluAndMul, SiluAndMul
from pagedrs.layers.attention.cupy import CupyAttentionBackend
from pagedrs.layers.attention.torch_ref import TorchAttentionBackend
from pagedrs.layers.kernel_switch import use_layer_kernels
from pagedrs.layers.norm import RMSNorm
from pagedrs.layers.rotary import RotaryEmbedding
from pagedrs.loader import load_model
from tests.helpers import make_tiny_llama
from tests.kernels.emu.emulator import needs_emulator, recording_kernels
from tests.models.paged_harness import assert_steps_close, run_mixed_steps

pytestmark = needs_emulator

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# One rounding of a 16-bit result apart (the kernel keeps fp32 where torch keeps fp32, but sums in another
# order), float32 to the last bits.
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


@pytest.fixture(scope="module")
def launched() -> Iterator[list[str]]:
    """Runs kernels on the emulator; yields the list of kernel names launched (appended as they run)."""
    names = list(cache_names())
    for ctype in CTYPES.values():
        names += layer_op_names(ctype) + attention_names(ctype, 16)
    with recording_kernels(names) as seen:
        yield seen


def _close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    atol, rtol = TOL[ref.dtype]
    assert ours.dtype == ref.dtype and ours.shape == ref.shape, what
    torch.testing.assert_close(ours.float(), ref.float(), atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


def _rows(tokens: int, width: int, dtype: torch.dtype, *, pad: int, seed: int) -> torch.Tensor:
    """[tokens, width] random rows; pad > 0 makes it a view with token stride width + pad."""
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(tokens, width + pad, generator=g).mul_(2.0).to(dtype)
    return full[:, :width]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("hidden", "pad"), [(64, 0), (64, 3), (36, 0), (20, 8)])
def test_rms_norm(launched: list[str], dtype: torch.dtype, hidden: int, pad: int) -> None:
    norm = RMSNorm(hidden, 1e-5, dtype=dtype)
    norm.weight.data = torch.rand(hidden).add_(0.5).to(dtype)
    x = _rows(7, hidden, dtype, pad=pad, seed=hidden + pad)
    ref = norm(x)
    norm.use_kernels = True
    del launched[:]
    ours = norm(x)
    assert [n.split("<")[0] for n in launched] == ["pagedrs::rms_norm"]
    _close(ours, ref, "rms_norm")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("hidden", "pad"), [(64, 0), (48, 5), (20, 0)])
def test_fused_add_rms_norm_in_place(launched: list[str], dtype: torch.dtype, hidden: int, pad: int) -> None:
    norm = RMSNorm(hidden, 1e-6, dtype=dtype)
    norm.weight.data = torch.rand(hidden).add_(0.5).to(dtype)
    x = _rows(5, hidden, dtype, pad=pad, seed=1)
    residual = _rows(5, hidden, dtype, pad=0, seed=2)
    ref_out, ref_res = norm(x.clone(), residual.clone())
    norm.use_kernels = True
    del launched[:]
    out, res = norm(x, residual)
    assert launched and launched[0].startswith("pagedrs::fused_add_rms_norm")
    assert out is x and res is residual  # in place
    assert torch.equal(res, ref_res)  # one rounded add, as torch's
    _close(out, ref_out, "fused_add_rms_norm")


def test_vector_and_scalar_instantiations_are_both_used(launched: list[str]) -> None:
    aligned = torch.randn(3, 64)
    odd = torch.randn(3, 66)[:, :63]
    del launched[:]
    layer_ops.rms_norm(aligned, torch.ones(64), 1e-6)
    layer_ops.rms_norm(odd, torch.ones(63), 1e-6)
    assert launched == ["pagedrs::rms_norm<float, 4>", "pagedrs::rms_norm<float, 1>"]


def _rope(head: int, rotary_dim: int, params: dict, *, neox: bool, max_position: int = 64) -> RotaryEmbedding:
    return RotaryEmbedding(head, rotary_dim, max_position, params, is_neox_style=neox)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("rotary_dim", [16, 8])
def test_rotary_in_place_on_qkv_views(
    launched: list[str], dtype: torch.dtype, neox: bool, rotary_dim: int
) -> None:
    head, heads, kv_heads, tokens = 16, 4, 2, 9
    rope = _rope(head, rotary_dim, {"rope_type": "default", "rope_theta": 100.0}, neox=neox)
    qkv = _rows(tokens, (heads + 2 * kv_heads) * head, dtype, pad=0, seed=rotary_dim)
    positions = torch.tensor([0, 1, 2, 3, 17, 40, 63, 5, 5])
    q, k, v = qkv.split([heads * head, kv_heads * head, kv_heads * head], dim=-1)
    ref_q, ref_k = rope(positions, q.clone(), k.clone())
    v_before = v.clone()
    rope.use_kernels = True
    del launched[:]
    out_q, out_k = rope(positions, q, k)
    assert launched == [f"pagedrs::rotary_embedding<{CTYPES[str(dtype)[6:]]}, {str(neox).lower()}>"]
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()
    assert torch.equal(v, v_before)
    # the torch path's roundings (cos/sin to the dtype, each product, the sum): equal to the bit
    assert torch.equal(out_q, ref_q) and torch.equal(out_k, ref_k)
    if rotary_dim < head:  # partial rotary: the tail of each head is untouched
        tail = q.view(tokens, heads, head)[..., rotary_dim:]
        assert torch.equal(tail, qkv[:, : heads * head].view(tokens, heads, head)[..., rotary_dim:])


def test_gptj_layout_rotates_interleaved_pairs() -> None:
    """The torch oracle itself: GPT-J pairs (2j, 2j+1) rotate by the angle of pair j (HF's
    rotate_every_two), neox pairs (j, j + d/2) by the same angles."""
    rope = _rope(4, 4, {"rope_type": "default", "rope_theta": 10.0}, neox=False)
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    q, _ = rope(torch.tensor([3]), x.clone(), x.clone())
    angles = [3.0, 3.0 / math.sqrt(10.0)]
    expect = []
    for j, a in enumerate(angles):
        x0, x1 = x[0, 2 * j].item(), x[0, 2 * j + 1].item()
        expect += [x0 * math.cos(a) - x1 * math.sin(a), x1 * math.cos(a) + x0 * math.sin(a)]
    torch.testing.assert_close(q[0], torch.tensor(expect))


def test_longrope_picks_the_long_cache_per_token(launched: list[str]) -> None:
    head = 16
    params = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0 + 0.1 * i for i in range(head // 2)],
        "long_factor": [2.0 + 0.5 * i for i in range(head // 2)],
        "original_max_position_embeddings": 16,
        "factor": 4.0,
    }
    rope = _rope(head, head, params, neox=True, max_position=64)
    tokens = 6
    positions = torch.tensor([3, 4, 10, 20, 21, 2])
    seq_lens = torch.tensor([5, 5, 12, 22, 22, 40])  # tokens 3, 4, 5 belong to requests past 16
    q = _rows(tokens, 2 * head, torch.float32, pad=0, seed=3)
    k = _rows(tokens, head, torch.float32, pad=0, seed=4)
    ref_q, ref_k = rope(positions, q.clone(), k.clone(), seq_lens)
    short_q, _ = rope(positions, q.clone(), k.clone(), torch.zeros_like(seq_lens))
    assert not torch.allclose(ref_q[3:], short_q[3:]) and torch.equal(ref_q[:3], short_q[:3])
    rope.use_kernels = True
    out_q, out_k = rope(positions, q, k, seq_lens)
    _close(out_q, ref_q, "longrope q")
    _close(out_k, ref_k, "longrope k")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("layer", "kernel_act"),
    [(SiluAndMul(), 0), (GeluAndMul("none"), 1), (GeluAndMul("tanh"), 2)],
    ids=["silu", "gelu", "gelu_tanh"],
)
@pytest.mark.parametrize(("d", "pad"), [(64, 0), (12, 2), (40, 0)])
def test_gated_activations(
    launched: list[str], dtype: torch.dtype, layer: torch.nn.Module, kernel_act: int, d: int, pad: int
) -> None:
    x = _rows(6, 2 * d, dtype, pad=pad, seed=d)
    layer.use_kernels = False
    ref = layer(x)
    layer.use_kernels = True
    del launched[:]
    ours = layer(x)
    layer.use_kernels = False
    assert len(launched) == 1 and launched[0].endswith(f", {kernel_act}>")
    _close(ours, ref, "act_and_mul")


def test_inputs_the_kernels_do_not_take_go_to_torch(launched: list[str]) -> None:
    """float64, a strided last dim, 3-d activations: the torch path, same result, no launch."""
    norm, act = RMSNorm(8, 1e-6, dtype=torch.float64), SiluAndMul()
    norm.use_kernels = act.use_kernels = True
    x = torch.randn(3, 8, dtype=torch.float64)
    strided = torch.randn(3, 16)[:, ::2]
    del launched[:]
    assert torch.equal(norm(x), RMSNorm(8, 1e-6, dtype=torch.float64)(x))
    assert torch.equal(act(strided), SiluAndMul()(strided))
    assert torch.equal(act(torch.ones(2, 3, 8)), SiluAndMul()(torch.ones(2, 3, 8)))
    assert launched == []


def test_bad_arguments_are_value_errors() -> None:
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        layer_ops.rms_norm(torch.ones(2, 8, dtype=torch.int32), torch.ones(8, dtype=torch.int32), 1e-6)
    with pytest.raises(ValueError, match="weight dtype"):
        layer_ops.rms_norm(torch.ones(2, 8), torch.ones(8, dtype=torch.float16), 1e-6)
    with pytest.raises(ValueError, match=r"residual .* must match"):
        layer_ops.fused_add_rms_norm(torch.ones(2, 8), torch.ones(3, 8), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="even number of columns"):
        layer_ops.act_and_mul(torch.ones(2, 7), "silu")
    with pytest.raises(ValueError, match="'relu'"):
        layer_ops.act_and_mul(torch.ones(2, 8), "relu")
    with pytest.raises(ValueError, match="positions must be contiguous int64"):
        layer_ops.rotary_embedding(
            torch.zeros(2, dtype=torch.int32), torch.ones(2, 16), torch.ones(2, 16), 16, torch.ones(8, 16)
        )
    with pytest.raises(ValueError, match="rotary dim 6 must be even and at most head_size=4"):
        layer_ops.rotary_embedding(
            torch.zeros(2, dtype=torch.int64), torch.ones(2, 8), torch.ones(2, 4), 4, torch.ones(8, 6)
        )
    with pytest.raises(ValueError, match="rotary_dim must be even"):
        RotaryEmbedding(16, 7, 64, {"rope_type": "default"})


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [("llama3", {}), ("qwen2", {}), ("llama", {"hidden_act": "gelu_pytorch_tanh"})],
    ids=["llama3-rope", "qwen2-bias", "gelu-tanh-mlp"],
)
def test_tiny_model_with_layer_kernels_matches_torch_path(
    launched: list[str], arch: str, overrides: dict, tmp_path: Path
) -> None:
    """float32: chunked prefill, a prefix-only request and decodes; every step's logits agree and the greedy
    token of every position is the same."""
    model = load_model(str(make_tiny_llama(tmp_path, arch, **overrides))).model
    runs = []
    for kernels in (False, True):
        # 2 norms and the MLP's activation per layer, the final norm, the shared RoPE
        assert use_layer_kernels(model, kernels) == 3 * model.num_layers + 2
        del launched[:]
        runs.append(run_mixed_steps(model, CupyAttentionBackend() if kernels else TorchAttentionBackend()))
        if kernels:
            kinds = {n.split("<")[0].removeprefix("pagedrs::") for n in launched}
            assert {"rms_norm", "fused_add_rms_norm", "rotary_embedding", "act_and_mul"} <= kinds
    use_layer_kernels(model, False)
    assert_steps_close(*runs, same_argmax=True)
