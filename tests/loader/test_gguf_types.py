"""Every tensor type the `gguf` package can dequantize (legacy, K-quants, I-quants, ternary, FP4, BF16)
loads from a GGUF file: the float32 weights equal gguf's own dequantization of the stored blocks (Q rows
unpermuted as llama.cpp's converter permuted them), and dtype "auto" on CPU loads the types that have no
quantized kernel dequantized, naming them in a log line. The blocks are random bytes (gguf cannot quantize
most of these types), so a few values are NaN or inf; they are compared as values, NaN equal to NaN."""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import _type_traits

from pagedrs.loader import load_model
from pagedrs.loader.gguf import unpermute_qk
from pagedrs.quantization.gguf_blocks import kernel_types
from tests.helpers import make_tiny_gguf

Q = gguf.GGMLQuantizationType
TYPES = sorted(_type_traits, key=lambda t: t.value)  # every type gguf-py has a dequantizer for
HIDDEN, HEADS = 256, 4  # rows of 256: every block size divides them
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # random scales overflow to inf


def random_blocks(a: np.ndarray, qtype: Q) -> np.ndarray:
    """Stands in for gguf.quants.quantize: random bytes of `qtype`'s row layout for a [rows, cols] matrix."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(a.shape[0] * 7 + a.shape[1])
    return rng.integers(0, 256, size=(a.shape[0], a.shape[1] // block * size), dtype=np.uint8)


@pytest.fixture
def write_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("PAGEDRS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf.quants, "quantize", random_blocks)

    def write(qtype: Q) -> Path:
        return make_tiny_gguf(
            tmp_path / qtype.name,
            "llama",
            qtype=qtype.name,
            hidden_size=HIDDEN,
            intermediate_size=2 * HIDDEN,
            num_attention_heads=HEADS,
        )

    return write


def stored(path: Path, name: str) -> np.ndarray:
    """gguf-py's dequantization of tensor `name` as stored in the file."""
    t = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == name)
    return gguf.quants.dequantize(t.data, t.tensor_type)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_every_type_loads_as_gguf_dequantizes_it(write_gguf, qtype: Q) -> None:
    path = write_gguf(qtype)
    reader = gguf.GGUFReader(str(path))
    assert {int(t.tensor_type) for t in reader.tensors if len(t.shape) == 2} == {int(qtype)}
    layer = load_model(str(path), dtype="float32", with_tokenizer=False).model.model.layers[0]
    want = {
        "down": stored(path, "blk.0.ffn_down.weight"),
        "q": unpermute_qk(stored(path, "blk.0.attn_q.weight"), HEADS),
    }
    got = {"down": layer.mlp.down_proj.weight, "q": layer.self_attn.qkv_proj.weight[:HIDDEN]}
    for key, w in want.items():
        torch.testing.assert_close(got[key].detach(), torch.from_numpy(w), atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("qtype", [Q.IQ2_XXS, Q.IQ3_S, Q.TQ2_0, Q.NVFP4], ids=lambda t: t.name)
def test_types_without_a_cpu_kernel_load_dequantized(write_gguf, qtype: Q, caplog) -> None:
    assert int(qtype) not in kernel_types()
    path = write_gguf(qtype)
    with caplog.at_level(logging.INFO, logger="pagedrs.loader"):
        layer = load_model(str(path), with_tokenizer=False).model.model.layers[0]  # dtype "auto", CPU
    assert f"of type {qtype.name} have no quantized CPU kernel" in caplog.text
    want = torch.from_numpy(stored(path, "blk.0.ffn_down.weight"))
    torch.testing.assert_close(layer.mlp.down_proj.weight.detach(), want, atol=0, rtol=0, equal_nan=True)
