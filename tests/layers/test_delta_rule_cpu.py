"""The Rust decode step of a Gated DeltaNet layer (`_core.cpu_gated_delta_decode`) against the torch functions
of `pagedrs.layers.delta_rule` (conv1d update + recurrent gated delta rule, the gates as Qwen3.5's layer
computes them): odd head counts and sizes, value heads sharing key heads, rows in scattered state slots, three
steps in a row, at every kernel set (portable and the detected SIMD one), within 2e-5 (float32, summation
order and FMA)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagedrs import _core
from pagedrs.layers.delta_rule import causal_conv1d_update, recurrent_gated_delta_rule

HK, HV, DK, DV, K = 3, 6, 5, 7, 4
C = 2 * HK * DK + HV * DV
TOL = 2e-5


def _reference(qkv, a, b, w, a_log, dt_bias, conv, ssm, slots):  # type: ignore[no-untyped-def]
    window, state = conv[slots].clone(), ssm[slots].clone()
    mixed = causal_conv1d_update(qkv, w, window)
    q, k, v = torch.split(mixed, [HK * DK, HK * DK, HV * DV], dim=-1)
    n = qkv.shape[0]
    g = -a_log.exp() * F.softplus(a + dt_bias)
    out, state = recurrent_gated_delta_rule(
        q.reshape(n, 1, HK, DK),
        k.reshape(n, 1, HK, DK),
        v.reshape(n, 1, HV, DV),
        g[:, None],
        b.sigmoid()[:, None],
        state,
    )
    conv[slots], ssm[slots] = window, state
    return out.reshape(n, HV * DV)


@pytest.mark.parametrize("isa", ["portable", None])
def test_decode_step_matches_the_torch_rule_in_place_on_the_slots(isa: str | None) -> None:
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    w, a_log, dt_bias = rand(C, K) * 0.5, rand(HV) * 0.5, rand(HV) * 0.5
    conv0, ssm0 = rand(5, C, K - 1), rand(5, HV, DK, DV) * 0.3
    slots = torch.tensor([3, 0, 4], dtype=torch.int64)
    conv, ssm = conv0.clone(), ssm0.clone()
    ref_conv, ref_ssm = conv0.clone(), ssm0.clone()
    for _ in range(3):
        qkv, a, b = rand(3, C), rand(3, HV), rand(3, HV)
        want = _reference(qkv, a, b, w, a_log, dt_bias, ref_conv, ref_ssm, slots)
        out = np.empty((3, HV * DV), dtype=np.float32)
        args = [t.numpy() for t in (qkv, a, b, slots, w, a_log, dt_bias)]
        _core.cpu_gated_delta_decode(*args, conv.numpy(), ssm.numpy(), out, HK, isa=isa)
        torch.testing.assert_close(torch.from_numpy(out), want, atol=TOL, rtol=TOL)
        torch.testing.assert_close(conv, ref_conv, atol=TOL, rtol=TOL)
        torch.testing.assert_close(ssm, ref_ssm, atol=TOL, rtol=TOL)
    assert not torch.equal(ssm[4], ssm0[4]) and torch.equal(ssm[1], ssm0[1])  # only the rows' slots move


def test_a_slot_outside_the_pool_is_a_value_error() -> None:
    z = np.zeros
    f = np.float32
    with pytest.raises(ValueError, match="outside 0..2"):
        _core.cpu_gated_delta_decode(
            z((1, C), f),
            z((1, HV), f),
            z((1, HV), f),
            np.array([2], dtype=np.int64),
            z((C, K), f),
            z(HV, f),
            z(HV, f),
            z((2, C, K - 1), f),
            z((2, HV, DK, DV), f),
            z((1, HV * DV), f),
            HK,
        )
