"""MoE GGUF files as llama.cpp writes them (llama with experts = Mixtral, qwen2moe, qwen3moe; experts
stacked per projection, router, shared expert): a float32 file gives the source model's logits (HF
transformers, float32), and a Q8_0 file loads kept quantized (stacked expert blocks on the fused
experts kernel) within the dense quantized path's tolerance of its dequantized float32 run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

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
    # the stacked blocks are exactly the dequantized run's weights
    qe, de = quant.model.model.layers[1].mlp.experts, dense.model.model.layers[1].mlp.experts
    torch.testing.assert_close(qe.gate_up.dense(), de.gate_up.weight, rtol=0, atol=0)
    torch.testing.assert_close(qe.down.dense(), de.down.weight, rtol=0, atol=0)
    lq, ld = logits_of(quant, IDS), logits_of(dense, IDS)
    assert (lq - ld).abs().max() <= 0.05 * ld.abs().max()
