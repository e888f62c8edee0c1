"""GGUF files of the low-bit types (Q2_K, Q3_K, IQ4_NL, IQ4_XS) loaded with dtype "auto" on CPU: every
matrix stays in its block layout on the integer kernels, its products agree with gguf-py's dequantized
float32 weights within the 8-bit activations' bound, and a tiny model's greedy tokens equal its float32
run over the dequantized weights (up to a near tie, as the 8-bit activations can flip one). The files are written from float weights by the round-to-nearest
quantizers of helpers_lowbit (gguf-py has none for these types)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from pagedrs.loader import load_model
from tests.helpers import greedy_by_logits, logits_of, make_tiny_gguf
from tests.layers.helpers_quant import error_bound
from tests.loader.helpers_lowbit import LOW_BIT_TYPES, quantize

HIDDEN = 256  # the 256-weight blocks of Q2_K, Q3_K and IQ4_XS divide every row


def test_quantizers_write_what_gguf_reads_back():
    a = np.random.default_rng(0).standard_normal((8, 512)).astype(np.float32) * 0.02
    # relative RMS error of round-to-nearest on Gaussian weights (llama.cpp's searches do better)
    worst = {"Q2_K": 0.4, "Q3_K": 0.2, "IQ4_NL": 0.1, "IQ4_XS": 0.1}
    for qtype in LOW_BIT_TYPES:
        q = quantize(a, qtype)
        assert q.shape == (8, 512 // gguf.GGML_QUANT_SIZES[qtype][0] * gguf.GGML_QUANT_SIZES[qtype][1])
        back = gguf.quants.dequantize(q, qtype)
        err = np.sqrt(((back - a) ** 2).mean() / (a**2).mean())
        assert err <= worst[qtype.name], (qtype.name, err)


@pytest.mark.parametrize("qtype", LOW_BIT_TYPES, ids=lambda t: t.name)
def test_low_bit_gguf_runs_on_the_integer_kernels(tmp_path: Path, monkeypatch, qtype):
    monkeypatch.setenv("PAGEDRS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf.quants, "quantize", quantize)
    path = make_tiny_gguf(
        tmp_path,
        "llama",
        qtype=qtype.name,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_attention_heads=4,
        num_hidden_layers=1,
    )
    quant, dense = load_model(str(path)), load_model(str(path), dtype="float32")
    layer, dense_layer = quant.model.model.layers[0], dense.model.model.layers[0]
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(1))
    for name in ("self_attn.qkv_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        qw = layer.get_submodule(name).qweight
        assert qw is not None and set(qw.type_names) == {qtype.name}, name
        w = dense_layer.get_submodule(name).weight.data
        xi = (
            x
            if w.shape[1] == HIDDEN
            else torch.randn(5, w.shape[1], generator=torch.Generator().manual_seed(2))
        )
        err = (qw.matmul(xi) - xi @ w.T).abs()
        assert (err <= error_bound(xi, w)).all(), f"{name}: max err {err.max()}"
    ids = [7, 8, 9, 10, 120, 3]
    lq, ld = logits_of(quant, ids), logits_of(dense, ids)
    tol = 0.05 * float(ld.abs().max())
    assert (lq - ld).abs().max() <= tol
    _greedy_agrees(quant, dense, ids, tol)


def _greedy_agrees(quant, dense, ids: list[int], tol: float) -> None:
    """6 greedy tokens of each run equal up to their first difference, where the float32 run's logits of
    the two tokens are within `tol` (a near tie the 8-bit activations may flip)."""
    a, b = greedy_by_logits(quant, ids), greedy_by_logits(dense, ids)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x != y:
            ld = logits_of(dense, ids + b[:i])[-1]
            assert float(ld[y] - ld[x]) <= tol, (i, x, y, float(ld[y]), float(ld[x]))
            return
