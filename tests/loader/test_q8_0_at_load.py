"""quantization="q8_0": a float checkpoint quantized at load to Q8_0 blocks, multiplied by the CPU kernels.
Its weights are exactly gguf-py's Q8_0 round trip of the float weights (each within half a step of its
block's scale), every linear layer and the vocabulary table hold the blocks (about a quarter of float32's
bytes), and the model agrees with the float32 model of those Q8_0 weights within the 8-bit rounding of
the activations (logits within 5% of the largest along the greedy path, the same next token at all but near ties) on
every architecture family;
TP=2 equals TP=1;
misuse is a ValueError naming the value."""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from pagedrs.engine.arg_utils import EngineArgs
from pagedrs.layers.linear import ReplicatedEmbedding, VocabParallelEmbedding
from pagedrs.layers.quantized import QuantizedWeight
from pagedrs.loader import LoadedModel, load_model
from pagedrs.loader.options import LoadOptions
from pagedrs.quantization.gguf_blocks import quantize_to_q8_0
from tests.distributed.helpers_tp import MODELS, check_forced, run_workload, tp_engine
from tests.helpers import logits_of, make_tiny_gguf, make_tiny_llama
from tests.loader.helpers_quant import make_quantized_pair


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """GGUF conversions into the test's folder, not the user's cache (the rank processes inherit it)."""
    monkeypatch.setenv("PAGEDRS_CACHE", str(tmp_path / "cache"))


IDS = [7, 8, 9, 10, 120, 3, 200, 45]
STEPS = 8
Q8 = LoadOptions(quantization="q8_0")


def test_blocks_are_the_q8_0_round_trip() -> None:
    torch.manual_seed(0)
    w = torch.randn(24, 96) * torch.logspace(-3, 1, 24)[:, None]  # rows of very different magnitudes
    q = quantize_to_q8_0(w)
    assert q.type_name == "Q8_0" and q.data.shape == (24, 3 * 34)
    back = q.materialize()
    want = gguf.quants.dequantize(
        gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0
    )
    assert np.array_equal(back.numpy(), want)
    step = w.abs().view(24, 3, 32).amax(-1, keepdim=True) / 127  # each block's scale
    # half a step, plus 127 times the f16 rounding of the scale (half an ulp: 2^-11 relative, 2^-25 subnormal)
    bound = step / 2 + 127 * torch.maximum(step * 2**-11, torch.tensor(2.0**-25))
    assert bool(((back - w).abs().view(24, 3, 32) <= bound).all())
    with pytest.raises(ValueError, match=r"multiple of 32 columns.*\(4, 40\)"):
        quantize_to_q8_0(torch.zeros(4, 40))


def _round_trip(loaded: LoadedModel) -> None:
    """Every weight that q8_0 quantizes replaced by its Q8_0 round trip, in float32."""
    for m in loaded.model.modules():
        if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ReplicatedEmbedding):
            w = m.weight.data
        elif hasattr(m, "qweight"):
            w = m.weight.data
        else:
            continue
        if w.shape[1] % 32 == 0:
            w.copy_(quantize_to_q8_0(w).materialize())


@pytest.mark.parametrize("arch", list(MODELS))
def test_model_agrees_with_float32(tmp_path: Path, arch: str, caplog: pytest.LogCaptureFixture) -> None:
    folder = MODELS[arch](tmp_path)
    with caplog.at_level(logging.INFO, logger="pagedrs.loader"):
        quant = load_model(str(folder), opts=Q8, with_tokenizer=False)
    assert "quantized at load to Q8_0" in caplog.text and quant.quantization == "q8_0"
    ref = load_model(str(folder), dtype="float32", with_tokenizer=False)
    exact = load_model(str(folder), dtype="float32", with_tokenizer=False)  # the weights as stored
    packed = [m for m in quant.model.modules() if isinstance(getattr(m, "qweight", None), QuantizedWeight)]
    dense = [m for m in ref.model.modules() if hasattr(m, "qweight")]
    assert packed and len(packed) == sum(m.weight.shape[1] % 32 == 0 for m in dense)
    assert quant.weight_nbytes < 0.6 * ref.weight_nbytes
    _round_trip(ref)  # the float32 model of the Q8_0 weights: what is left is the 8-bit activations
    ids = [i % int(quant.hf_config.vocab_size) for i in IDS]
    agree = 0
    for _ in range(STEPS):  # along the reference's greedy path
        lq, lr = logits_of(quant, ids), logits_of(ref, ids)
        # 8-bit activations move the logits by at most 5% of the largest, or, in a tiny random model whose
        # logits swing with any rounding (Gemma 3's: 8-bit weights alone move them 5.7%), by at most 1.5x
        # what the 8-bit weights move them
        weights_move = (lr - logits_of(exact, ids)).abs().max()
        assert (lq - lr).abs().max() <= max(0.05 * lr.abs().max(), 1.5 * weights_move)
        agree += int(lq[-1].argmax()) == int(lr[-1].argmax())
        ids.append(int(lr[-1].argmax()))
    # a tiny random model's next-token logits are nearly flat (a tie flips under 8-bit activations)
    assert agree >= STEPS - 2, agree


def test_tp2_equals_tp1(tmp_path: Path) -> None:
    """Each rank quantizes its own shard: the same blocks as one rank's (32-column cuts), so TP=2 gives
    TP=1's greedy ids under forced preemption, chunking and prefix hits."""
    folder = make_tiny_llama(tmp_path, arch="llama")
    want, _ = run_workload(tp_engine(folder, 1, dtype="auto", quantization="q8_0"))
    engine = tp_engine(folder, 2, dtype="auto", quantization="q8_0")
    try:
        got, spy = run_workload(engine)
        check_forced(engine, spy)
        assert got == want
    finally:
        engine.shutdown()


def test_misuse_is_a_value_error(tmp_path: Path) -> None:
    folder = make_tiny_llama(tmp_path, arch="llama")
    with pytest.raises(ValueError, match=r"needs device cpu and dtype auto or float32.*'float16'"):
        load_model(str(folder), dtype="float16", opts=Q8, with_tokenizer=False)
    qdir, _ = make_quantized_pair(tmp_path, "gptq", bits=4, group_size=32, sym=True, desc_act=False)
    with pytest.raises(ValueError, match=r"already quantized \(quant_method 'gptq'\)"):
        load_model(str(qdir), opts=Q8, with_tokenizer=False)
    gguf_path = make_tiny_gguf(tmp_path, "llama")
    for model in (str(gguf_path), None):
        with pytest.raises(ValueError, match="quantization='q8_0' quantizes a 16/32-bit checkpoint"):
            EngineArgs(model=model, quantization="q8_0").early_configs()
    with pytest.raises(ValueError, match="GGUF file already"):
        load_model(str(gguf_path), opts=Q8, with_tokenizer=False)
