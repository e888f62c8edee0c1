"""MoE GGUF files as llama.cpp writes them (llama with experts = Mixtral, qwen2moe, qwen3moe; experts
stacked per projection, router, shared expert): a float32 file gives the source model's logits (HF
transformers, float32), and a Q8_0 file loads kept quantized (stacked expert blocks on the fused
experts kernel) within the dense quantized path's tolerance of its dequantized float32 run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedrs.layers.moe import CpuExperts, GgufCpuExperts
from pagedrs.loader import load_model
from tests.helpers import load_hf_model, logits_of
from tests.models.helpers_moe import GGUF_ARCH, make_tiny_moe_gguf

IDS = [7, 8, 9, 10, 120, 3, 55, 201, 17]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("PAGEDRS_CACHE", str(root))
    return root


@pytest.mark.parametrize("kind", list(GGUF_ARCH))
def test_f32_moe_gguf_matches_source_model(tmp_path: Path, cache: Path, kind: str) -> None:
    path = make_tiny_moe_gguf(tmp_path, kind, qtype="F32")
    loaded = load_model(str(path), dtype="float32")
    hf = load_hf_model(tmp_path / f"{kind}-gguf-src")
    with torch.no_grad():
        ref = hf(torch.tensor([IDS])).logits[0].float()
    torch.testing.assert_close(logits_of(loaded, IDS), ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", list(GGUF_ARCH))
def test_q8_moe_gguf_keeps_experts_quantized(tmp_path: Path, cache: Path, kind: str) -> None:
    path = make_tiny_moe_gguf(tmp_path, kind, qtype="Q8_0")
    quant, dense = load_model(str(path)), load_model(str(path), dtype="float32")
    for layer in quant.model.model.layers:
        experts = layer.mlp.experts
        assert experts.gate_up.qweight is not None and experts.down.qweight is not None
        assert experts.gate_up.weight.numel() == 0
        assert experts.gate_up.qweight.packed and experts.down.qweight.packed  # the x8 layout at load
        assert isinstance(experts.method, GgufCpuExperts)  # chosen once, after load
    assert all(isinstance(m.mlp.experts.method, CpuExperts) for m in dense.model.model.layers)
    # the stacked blocks are exactly the dequantized run's weights
    qe, de = quant.model.model.layers[1].mlp.experts, dense.model.model.layers[1].mlp.experts
    torch.testing.assert_close(qe.gate_up.dense(), de.gate_up.weight, rtol=0, atol=0)
    torch.testing.assert_close(qe.down.dense(), de.down.weight, rtol=0, atol=0)
    lq, ld = logits_of(quant, IDS), logits_of(dense, IDS)
    assert (lq - ld).abs().max() <= 0.05 * ld.abs().max()


def test_q8_moe_gguf_tensor_parallel_2_equals_1(tmp_path: Path, cache: Path) -> None:
    """Kept quantized under tensor parallelism: each rank its rows of every expert's gate/up blocks and
    whole input blocks of its down projection; greedy ids equal one rank's under the forced workload."""
    from tests.distributed.helpers_tp import check_forced, run_workload, tp_engine

    # 64-wide experts: each rank's half of a down projection is whole 32-weight blocks
    path = make_tiny_moe_gguf(tmp_path, "qwen2_moe", qtype="Q8_0", moe_intermediate_size=64)
    ids1, _ = run_workload(tp_engine(path, 1, dtype="auto"))
    engine = tp_engine(path, 2, dtype="auto")
    try:
        ids2, spy = run_workload(engine)
        check_forced(engine, spy)
    finally:
        engine.shutdown()
    assert ids2 == ids1


def test_q8_moe_gguf_tensor_parallel_refuses_a_cut_inside_a_block(tmp_path: Path, cache: Path) -> None:
    from tests.distributed.helpers_tp import tp_engine

    path = make_tiny_moe_gguf(tmp_path, "qwen2_moe", qtype="Q8_0")  # 32-wide experts: 16 a rank
    with pytest.raises(Exception, match="cannot cut columns 0..16 of a Q8_0 weight"):
        tp_engine(path, 2, dtype="auto").shutdown()
