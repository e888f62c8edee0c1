"""The Gated DeltaNet decode step of cuda/delta_rule.cu (conv update + one step of the gated delta rule, in
place on state slots), run by the CPU emulator, against the torch functions of pagedrs.layers.delta_rule: two
key heads shared by four value heads, head dims that are not multiples of a warp, a skipped row (slot -1),
three steps chained on the same slots; then a tiny Qwen3.5 linear-attention layer's decode with the kernels
switched on against its torch path."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pagedrs.kernels import delta_rule_ops
from pagedrs.kernels._loader import CTYPES, delta_rule_names
from pagedrs.layers.delta_rule import causal_conv1d_update, recurrent_gated_delta_rule
from pagedrs.layers.kernel_switch import use_layer_kernels
from pagedrs.loader import load_model
from tests.helpers import make_tiny_model
from tests.kernels.emu.emulator import needs_emulator, recording_kernels
from tests.models.helpers_qwen3_5 import qwen3_5_config

pytestmark = needs_emulator

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HK, HV, DK, DV, KERNEL, SLOTS = 2, 4, 12, 20, 4, 5
CHANNELS = 2 * HK * DK + HV * DV
# float32: sums in another order; 16-bit: one rounding of the output (and of the conv's inputs in torch)
TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 3e-2)}


@pytest.fixture(scope="module")
def launched() -> Iterator[list[str]]:
    names = [n for ctype in CTYPES.values() for n in delta_rule_names(ctype)]
    with recording_kernels(names) as seen:
        yield seen


def _reference(
    qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    w: torch.Tensor,
    dt_bias: torch.Tensor,
    a_log: torch.Tensor,
    conv: torch.Tensor,
    ssm: torch.Tensor,
    slots: list[int],
) -> torch.Tensor:
    """The torch path (as models.qwen3_5.GatedDeltaNet._decode), on the rows whose slot is not -1."""
    keep = [i for i, s in enumerate(slots) if s >= 0]
    idx = torch.tensor([slots[i] for i in keep])
    window, state = conv.index_select(0, idx), ssm.index_select(0, idx)
    mixed = causal_conv1d_update(qkv[keep], w, window)
    q, k, v = torch.split(mixed, [HK * DK, HK * DK, HV * DV], dim=-1)
    n = len(keep)
    g = -a_log.float().exp() * torch.nn.functional.softplus(a[keep].float() + dt_bias)
    beta = b[keep].sigmoid()
    out, state = recurrent_gated_delta_rule(
        q.reshape(n, 1, HK, DK),
        k.reshape(n, 1, HK, DK),
        v.reshape(n, 1, HV, DV),
        g[:, None],
        beta[:, None],
        state,
    )
    conv.index_copy_(0, idx, window)
    ssm.index_copy_(0, idx, state)
    return out.reshape(n, HV * DV)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_steps_match_torch(launched: list[str], dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    w, dt_bias, a_log = rand(CHANNELS, KERNEL, scale=0.5), rand(HV), rand(HV, scale=0.3)
    conv = torch.randn(SLOTS, CHANNELS, KERNEL - 1, generator=gen)
    ssm = torch.randn(SLOTS, HV, DK, DV, generator=gen) * 0.2
    conv_ref, ssm_ref = conv.clone(), ssm.clone()
    slots = [3, -1, 0, 4]
    keep = [i for i, s in enumerate(slots) if s >= 0]
    for step in range(3):
        qkv, a, b = rand(len(slots), CHANNELS), rand(len(slots), HV), rand(len(slots), HV)
        if step == 2:
            a[0, 0] = 30.0  # past softplus' threshold of 20
        got = delta_rule_ops.gated_delta_decode(
            qkv, a, b, w, dt_bias, a_log, conv, ssm, torch.tensor(slots, dtype=torch.int32), HK
        )
        ref = _reference(qkv, a, b, w, dt_bias, a_log, conv_ref, ssm_ref, slots)
        atol, rtol = TOL[dtype]
        assert got.dtype == dtype and got.shape == (len(slots), HV * DV)
        torch.testing.assert_close(got[keep].float(), ref.float(), atol=atol, rtol=rtol)
        torch.testing.assert_close(ssm, ssm_ref, atol=atol, rtol=rtol)
        torch.testing.assert_close(conv, conv_ref, atol=atol, rtol=rtol)
    untouched = [s for s in range(SLOTS) if s not in slots]
    assert untouched and all(torch.equal(ssm[s], ssm_ref[s]) for s in untouched)
    assert f"pagedrs::gdn_recurrent<{CTYPES[str(dtype).removeprefix('torch.')]}>" in launched


def test_bad_shapes_are_refused() -> None:
    qkv = torch.zeros(2, CHANNELS)
    a = torch.zeros(2, HV)
    conv, ssm = torch.zeros(SLOTS, CHANNELS, KERNEL - 1), torch.zeros(SLOTS, HV, DK, DV)
    args = (torch.zeros(CHANNELS, KERNEL), torch.zeros(HV), torch.zeros(HV))
    slots = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="multiple of key heads 3"):
        delta_rule_ops.gated_delta_decode(qkv, a, a, *args, conv, ssm, slots, 3)
    with pytest.raises(ValueError, match="ssm_state must be contiguous float32"):
        delta_rule_ops.gated_delta_decode(qkv, a, a, *args, conv, ssm.double(), slots, HK)
    with pytest.raises(ValueError, match="slots must be contiguous int32"):
        delta_rule_ops.gated_delta_decode(qkv, a, a, *args, conv, ssm, slots.long(), HK)


def test_qwen3_5_layer_decode_with_kernels_matches_torch(launched: list[str], tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path / "qwen3_5", qwen3_5_config())
    model = load_model(str(path), dtype="float32").model
    layer = next(m for m in model.modules() if hasattr(m, "use_cuda_kernels") and hasattr(m, "A_log"))
    gen = torch.Generator().manual_seed(1)
    rows, conv_dim = 3, layer.conv1d.weight.shape[0]
    conv = torch.randn(4, conv_dim, layer.conv1d.weight.shape[-1] - 1, generator=gen)
    ssm = torch.randn(4, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim, generator=gen) * 0.2
    qkv = torch.randn(rows, conv_dim, generator=gen)
    a, b = (
        torch.randn(rows, layer.num_v_heads, generator=gen),
        torch.randn(rows, layer.num_v_heads, generator=gen),
    )
    idx = torch.tensor([2, 0, 3])
    ref_conv, ref_ssm = conv.clone(), ssm.clone()
    ref = layer._decode(qkv, a, b, ref_conv, ref_ssm, idx)
    assert use_layer_kernels(model) >= 1 and layer.cuda_kernels
    seen = len(launched)
    got = layer._decode(qkv, a, b, conv, ssm, idx)
    assert "pagedrs::gdn_recurrent<float>" in launched[seen:]
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(ssm, ref_ssm, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(conv, ref_conv, atol=0, rtol=0)
