"""Dense float32 CPU weights packed once for oneDNN's matmul (pagedrs.layers.onednn): the same products as
`F.linear` up to float32 summation order, every dense linear and the output head packed by the engine, the
other formats and liquid scaling left alone, PAGEDRS_ONEDNN=0 turning it off."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pagedrs import LLM, SamplingParams
from pagedrs.layers.linear import ParallelLMHead, RowParallelLinear, _LinearBase
from pagedrs.layers.onednn import PackedDense, available, pack_dense_weights
from pagedrs.layers.quantized import QuantizedWeight
from pagedrs.loader import load_model
from pagedrs.loader.options import LoadOptions
from tests.helpers import make_tiny_llama

pytestmark = pytest.mark.skipif(not available(), reason="torch without oneDNN (mkldnn)")


@pytest.mark.parametrize("rows", [0, 1, 5, 64, 131])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_matmul_equals_f_linear(rows: int, with_bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(200, 96, generator=g)
    b = torch.randn(200, generator=g) if with_bias else None
    x = torch.randn(rows, 96, generator=g)
    got = PackedDense(w).matmul(x, b)
    assert got.shape == (rows, 200) and got.dtype == torch.float32
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_packed_matmul_takes_leading_dims_and_strided_rows() -> None:
    w = torch.randn(48, 32)
    x = torch.randn(3, 4, 64)[..., ::2]  # [3, 4, 32], not contiguous
    torch.testing.assert_close(PackedDense(w).matmul(x), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_the_packed_layout_holds_the_weight_exactly() -> None:
    w = torch.randn(70, 40)
    assert torch.equal(PackedDense(w).dequantized(), w)


def test_packed_dense_refuses_other_weights() -> None:
    with pytest.raises(ValueError, match="float32 CPU weight"):
        PackedDense(torch.randn(4, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"\(4, 4, 2\)"):
        PackedDense(torch.randn(4, 4, 2))


def _linears(model: torch.nn.Module) -> list[_LinearBase]:
    return [m for m in model.modules() if isinstance(m, _LinearBase)]


def test_every_dense_linear_and_the_output_head_are_packed_with_the_same_logits(tmp_path: Path) -> None:
    loaded = load_model(str(make_tiny_llama(tmp_path, seed=3)), dtype="float32", device="cpu")
    net = loaded.model
    ids = torch.tensor([5, 17, 99, 3, 250, 7])
    linears = _linears(net)
    assert any(isinstance(m, RowParallelLinear) for m in linears)
    xs = {id(m): torch.randn(4, m.weight.shape[1]) for m in linears}
    before = {id(m): m(xs[id(m)]) for m in linears}
    head = next(m for m in net.modules() if isinstance(m, ParallelLMHead))
    hidden = torch.randn(3, head.embedding_dim)
    logits_before = head.compute_logits(hidden)
    embedded_before = net.model.embed_tokens(ids)

    n = pack_dense_weights(net)
    assert n == len(linears) + 1
    for m in linears:
        assert isinstance(m.qweight, PackedDense) and m.weight.numel() == 0
        torch.testing.assert_close(m(xs[id(m)]), before[id(m)], rtol=1e-5, atol=1e-5)
    assert isinstance(head.packed, PackedDense)
    assert logits_before is not None
    torch.testing.assert_close(head.compute_logits(hidden), logits_before, rtol=1e-5, atol=1e-5)
    assert torch.equal(net.model.embed_tokens(ids), embedded_before)  # the (tied) table is still read
    assert pack_dense_weights(net) == 0  # packed once


def test_off_switch_and_quantized_layers_left_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = str(make_tiny_llama(tmp_path, seed=4))
    monkeypatch.setenv("PAGEDRS_ONEDNN", "0")
    net = load_model(path, dtype="float32", device="cpu").model
    assert not available() and pack_dense_weights(net) == 0
    assert all(m.qweight is None and m.weight.numel() > 0 for m in _linears(net))
    monkeypatch.delenv("PAGEDRS_ONEDNN")
    q8 = load_model(path, dtype="float32", device="cpu", opts=LoadOptions(quantization="q8_0")).model
    assert pack_dense_weights(q8) == 0
    assert all(isinstance(m.qweight, QuantizedWeight) for m in _linears(q8))


def test_the_engine_packs_its_float32_weights_and_keeps_greedy_ids(tmp_path: Path) -> None:
    """The engine's runner multiplies with the packed weights; its greedy ids equal those of the same model
    with PAGEDRS_ONEDNN=0 (F.linear) on a few prompts: summation order only, no near tie on these."""
    path = str(make_tiny_llama(tmp_path, seed=5))
    prompts = ["hello there", "abcabc", "The quick brown fox"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(path, dtype="float32", device="cpu", disable_log_stats=True, num_kv_blocks=64)
    runner = llm.llm_engine.engine_core.executor.runner  # type: ignore[attr-defined]
    assert all(isinstance(m.qweight, PackedDense) for m in _linears(runner.model))
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.shutdown()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDRS_ONEDNN", "0")
        plain = LLM(path, dtype="float32", device="cpu", disable_log_stats=True, num_kv_blocks=64)
        runner = plain.llm_engine.engine_core.executor.runner  # type: ignore[attr-defined]
        assert all(m.qweight is None for m in _linears(runner.model))
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
        plain.shutdown()
    assert got == want
