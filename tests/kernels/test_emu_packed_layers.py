"""GPTQ / AWQ / FP8 checkpoints kept packed as on a GPU (`pagedrs.layers.packed`), run on CPU tensors
with the CUDA dequantize kernels on the emulator: the model equals the float32 model holding the
dequantized values (logits within 1e-4, the same greedy ids), holds the packed bytes, and each
tensor-parallel rank's packed shard dequantizes to exactly that rank's shard of the dequantized model.
FP8 through `torch._scaled_mm` (per-token e4m3 activations, as on sm_89+) stays within the fp8 rounding of
the activations."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import pagedrs.loader.load
from pagedrs.distributed.group import TPGroup
from pagedrs.kernels._loader import CTYPES, quant_op_names
from pagedrs.layers.packed import DevicePackedWeight
from pagedrs.loader import LoadedModel, load_model
from pagedrs.quantization.config import QuantConfig
from pagedrs.quantization.packed_parts import Fp8, PackedInt
from tests.helpers import greedy_by_logits, logits_of
from tests.kernels.emu.emulator import host_kernels, needs_emulator
from tests.loader.helpers_quant import make_quantized_pair

pytestmark = needs_emulator

IDS = [7, 8, 9, 10, 120, 3, 200, 45]
LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
CASES = {
    "gptq4-g32-sym": ("gptq", dict(bits=4, group_size=32, sym=True, desc_act=False)),
    "gptq4-g32-asym-actorder": ("gptq", dict(bits=4, group_size=32, sym=False, desc_act=True)),
    "gptq8-perchannel": ("gptq", dict(bits=8, group_size=-1, sym=True, desc_act=False)),
    "awq4-g32": ("awq", dict(group_size=32)),
    "fp8-tensor": ("fp8", dict(strategy="tensor")),
    "ct-fp8-channel": ("compressed-tensors", dict(strategy="channel")),
}


@pytest.fixture(scope="module")
def emulated() -> Iterator[None]:
    names = [n for ctype in CTYPES.values() for n in quant_op_names(ctype)]
    with host_kernels(names):
        yield


@pytest.fixture
def as_on_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loader keeps GPTQ/AWQ/FP8 layers in the GPU form on this CPU."""
    monkeypatch.setattr(pagedrs.loader.load, "packed_form", lambda dtype, device: "device")


def _packed_bytes(loaded: LoadedModel) -> int:
    return sum(m.qweight.nbytes for m in loaded.model.modules() if getattr(m, "qweight", None) is not None)


@pytest.mark.parametrize("case", list(CASES))
def test_packed_model_equals_the_dequantized_model(
    tmp_path: Path, case: str, emulated: None, as_on_gpu: None, caplog: pytest.LogCaptureFixture
) -> None:
    method, kw = CASES[case]
    qdir, rdir = make_quantized_pair(tmp_path, method, **kw)
    with caplog.at_level(logging.INFO, logger="pagedrs.loader"):
        quant = load_model(str(qdir), dtype="float32", with_tokenizer=False)
    kept = "kept in fp8" if "fp8" in case else "kept packed for the GPU kernels"
    assert kept in caplog.text and "dequantized" not in caplog.text
    ref = load_model(str(rdir), dtype="float32", with_tokenizer=False)
    for layer in quant.model.model.layers:
        for name in LINEARS:
            q = layer.get_submodule(name)
            assert isinstance(q.qweight, DevicePackedWeight) and q.weight.numel() == 0, name
    torch.testing.assert_close(logits_of(quant, IDS), logits_of(ref, IDS), rtol=1e-4, atol=1e-4)
    assert greedy_by_logits(quant, IDS) == greedy_by_logits(ref, IDS)
    assert quant.weight_nbytes < ref.weight_nbytes


@pytest.mark.parametrize("case", ["gptq4-g32-asym-actorder", "awq4-g32", "ct-fp8-channel"])
def test_each_rank_holds_its_packed_shard(tmp_path: Path, case: str, emulated: None, as_on_gpu: None) -> None:
    """TP=2: q|k|v and gate|up cut by rows, o and down by input columns (GPTQ act-order: every group kept,
    each column's group id cut; AWQ: whole groups)."""
    method, kw = CASES[case]
    qdir, rdir = make_quantized_pair(tmp_path, method, **kw)
    whole = _packed_bytes(load_model(str(qdir), dtype="float32", with_tokenizer=False))
    for rank in range(2):
        tp = TPGroup(rank, 2)
        quant = load_model(str(qdir), dtype="float32", tp=tp, with_tokenizer=False)
        ref = load_model(str(rdir), dtype="float32", tp=tp, with_tokenizer=False)
        for layer in range(len(ref.model.model.layers)):
            for name in LINEARS:
                q = quant.model.model.layers[layer].get_submodule(name).qweight
                want = ref.model.model.layers[layer].get_submodule(name).weight.data
                assert isinstance(q, DevicePackedWeight)
                got = q.matmul(torch.eye(q.in_features)).T  # the kernels' (or fp8's) weight, column by column
                torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"rank {rank} {name}")
        # about half of the packed bytes (a row-parallel GPTQ layer keeps all its groups' scales and zeros)
        assert _packed_bytes(quant) < 0.75 * whole


def test_a_shard_that_splits_a_group_or_word_is_refused() -> None:
    awq = QuantConfig("awq", bits=4, group_size=64)
    w = PackedInt(
        awq,
        torch.zeros(128, 2, dtype=torch.int32),
        torch.zeros(2, 2, dtype=torch.int32),
        torch.ones(2, 16, dtype=torch.float16),
        None,
    )
    assert w.shape == (16, 128) and w.narrow(1, 64, 64).shape == (16, 64)
    with pytest.raises(ValueError, match=r"columns 32\.\.64 of a AWQ int4 \(group 64\) weight.*64-column"):
        w.narrow(1, 32, 32)
    with pytest.raises(ValueError, match=r"rows 4\.\.8 .*8-row"):
        w.narrow(0, 4, 4)
    # per channel (one group over all inputs): any cut of the inputs keeps the group, exactly
    one = PackedInt(
        QuantConfig("awq", bits=4, group_size=-1),
        torch.randint(-(2**31), 2**31 - 1, (128, 2), dtype=torch.int32),
        torch.randint(-(2**31), 2**31 - 1, (1, 2), dtype=torch.int32),
        torch.rand(1, 16, dtype=torch.float16) + 0.5,
        None,
    )
    torch.testing.assert_close(
        one.narrow(1, 40, 24).materialize(), one.materialize()[:, 40:64], rtol=0, atol=0
    )
    gptq = QuantConfig("gptq", bits=4, group_size=32)
    g = PackedInt(
        gptq,
        torch.zeros(8, 16, dtype=torch.int32),
        torch.zeros(2, 2, dtype=torch.int32),
        torch.ones(2, 16, dtype=torch.float16),
        torch.arange(64, dtype=torch.int32) // 32,
    )
    assert g.narrow(1, 16, 16).shape == (16, 16)  # inside a group: every group kept, ids cut
    with pytest.raises(ValueError, match=r"columns 4\.\.8 .*8-column"):
        g.narrow(1, 4, 4)


def test_fp8_scaled_mm_with_per_token_activation_scales() -> None:
    """The sm_89+ path (torch._scaled_mm runs on CPU too): bf16 activations rounded per token to e4m3, the
    product within that rounding (3 mantissa bits: 2^-4 relative per element) of the float32 product."""
    torch.manual_seed(0)
    w = (torch.randn(48, 64) * 0.05).to(torch.float8_e4m3fn)
    scale = torch.rand(48) + 0.5
    packed = DevicePackedWeight([Fp8(w, scale)], torch.device("cpu"))
    packed.scaled_mm = True
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    got = packed.matmul(x).float()
    want = x.float() @ (w.float() * scale[:, None]).T
    bound = 2**-4 * (x.float().abs() @ (w.float() * scale[:, None]).abs().T) + 0.02 * want.abs() + 1e-3
    assert bool(((got - want).abs() <= bound).all())
    packed.scaled_mm = False  # weight-only: the weight in bf16, the product as torch computes it
    torch.testing.assert_close(packed.matmul(x).float(), want, rtol=0.02, atol=0.05)
