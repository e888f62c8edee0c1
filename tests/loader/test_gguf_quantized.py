"""GGUF files loaded with dtype "auto" on CPU: quantized tensors stay in their block layout (the layers
hold `QuantizedWeight`s), and the model agrees with the float32 dequantized path (the oracle)."""

from __future__ import annotations

import logging

import gguf
import numpy as np
import pytest
import torch

from pagedrs.loader import keeps_quantized, load_model
from pagedrs.loader.gguf import iter_gguf_weights
from pagedrs.quantization.gguf_blocks import GGUFWeight
from tests.helpers import logits_of, make_tiny_gguf
from tests.layers.helpers_quant import Q, random_blocks


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("PAGEDRS_CACHE", str(root))
    return root


def test_tiny_q8_gguf_keeps_quantized_weights(tmp_path, cache):
    path = make_tiny_gguf(tmp_path, "llama", qtype="Q8_0")
    quant, dense = load_model(str(path)), load_model(str(path), dtype="float32")
    layer = quant.model.model.layers[0]
    assert layer.self_attn.qkv_proj.qweight is not None and layer.mlp.down_proj.qweight is not None
    assert dense.model.model.layers[0].self_attn.qkv_proj.qweight is None
    # The quantized weights are exactly the dequantized path's weights (Q/K rows unpermuted alike).
    for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        q = quant.model.model.layers[1].get_submodule(name).qweight
        d = dense.model.model.layers[1].get_submodule(name).weight.data
        eye = torch.eye(d.shape[1])
        # rows of W^T through the kernel: x = one-hot columns quantize exactly (one value per block)
        torch.testing.assert_close(q.matmul(eye).T, d, rtol=1e-5, atol=1e-6)
    ids = [7, 8, 9, 10, 120, 3]
    lq, ld = logits_of(quant, ids), logits_of(dense, ids)
    assert (lq - ld).abs().max() <= 0.05 * ld.abs().max()


def test_quantized_only_for_auto_dtype_on_cpu(tmp_path):
    path = str(make_tiny_gguf(tmp_path, "llama", qtype="Q8_0"))
    cpu = torch.device("cpu")
    assert keeps_quantized(path, "auto", cpu, "auto")
    assert not keeps_quantized(path, "float32", cpu, "auto")
    assert not keeps_quantized(path, "auto", torch.device("cuda"), "auto")
    assert not keeps_quantized(path, "auto", cpu, "dummy")
    assert not keeps_quantized(str(tmp_path / "tiny-llama-gguf-src"), "auto", cpu, "auto")


def test_type_without_kernel_is_dequantized_with_a_log_line(tmp_path, caplog):
    path = tmp_path / "mixed.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    tq2 = random_blocks(Q.TQ2_0, 8, 256, seed=1)
    q40 = random_blocks(Q.Q4_0, 8, 256, seed=2)
    w.add_tensor("blk.0.attn_q.weight", tq2, raw_dtype=Q.TQ2_0)
    w.add_tensor("blk.0.ffn_up.weight", q40, raw_dtype=Q.Q4_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with caplog.at_level(logging.INFO, logger="pagedrs.loader"):
        got = dict(iter_gguf_weights(path, num_heads=2, num_kv_heads=1))
    q_proj, up = got["model.layers.0.self_attn.q_proj.weight"], got["model.layers.0.mlp.up_proj.weight"]
    assert isinstance(q_proj, torch.Tensor) and q_proj.shape == (8, 256)
    assert isinstance(up, GGUFWeight) and up.type_name == "Q4_0" and up.shape == (8, 256)
    assert any("TQ2_0" in r.getMessage() and "dequantized" in r.getMessage() for r in caplog.records)
    # llama.cpp's Q row permutation is undone on the dequantized tensor too
    raw = torch.from_numpy(gguf.quants.dequantize(tq2, Q.TQ2_0).astype(np.float32))
    order = np.arange(8).reshape(2, 2, 2).swapaxes(2, 1).reshape(8)
    torch.testing.assert_close(q_proj, raw[order])


def test_default_model_quantized_agrees_with_float32():
    try:
        quant = load_model(None)
    except ValueError as e:
        pytest.skip(f"default model not installed: {e}")
    dense = load_model(None, dtype="float32")
    head = quant.model.lm_head.quant.weight
    assert head is not None and head.type_names == ["Q8_0"]  # the tied token_embd table
    assert quant.model.model.layers[0].mlp.gate_up_proj.qweight.type_names == ["Q4_1"]
    ids = quant.tokenizer("The capital of France is")["input_ids"]
    lq, ld = logits_of(quant, ids), logits_of(dense, ids)
    assert torch.equal(lq.argmax(-1), ld.argmax(-1))
    assert (lq - ld).abs().max() <= 0.1 * ld.abs().max()
    assert quant.tokenizer.decode(int(lq[-1].argmax())).strip() == "Paris"
