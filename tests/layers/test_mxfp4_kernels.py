"""MXFP4 (ggml's block_mxfp4, GGML type 39) on the CPU kernels: blocks written by gguf-py's quantizer
dequantize to gguf-py's own values, the dense matmul and the stacked experts step match float32 x the
dequantized weights within the 8-bit activations' bound (as every other 4-bit type, helpers_quant), the
portable kernels (PAGEDRS_CPU_ISA=portable, or isa="portable") give the SIMD ones' results up to float
rounding, and OpenAI's MXFP4 blocks convert to ggml's without changing a value."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from pagedrs import _core
from pagedrs.quantization.gguf_blocks import GGUFWeight
from pagedrs.quantization.mxfp4 import (
    GGML_MXFP4,
    Mxfp4Experts,
    dequantize_mxfp4,
    mxfp4_checkpoint,
    to_ggml_mxfp4,
)
from tests.layers.helpers_quant import error_bound

MXFP4 = gguf.GGMLQuantizationType.MXFP4


def _quantized(rows: int, cols: int, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    """gguf-py's MXFP4 blocks of a random [rows, cols] matrix, and gguf-py's dequantization of them."""
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    data = np.ascontiguousarray(gguf.quants.quantize(w, MXFP4), dtype=np.uint8)
    return data, torch.from_numpy(gguf.quants.dequantize(data, MXFP4).astype(np.float32))


def _rounding(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Float rounding scale of x @ w.T computed in another order: 1e-5 of sum |x| |w|."""
    return 1e-5 * (x.abs() @ w.abs().T) + 1e-6


def test_gguf_quantized_blocks_dequantize_to_ggufs_values() -> None:
    assert GGML_MXFP4 == int(MXFP4) and GGML_MXFP4 in _core.quant_type_ids()
    data, dense = _quantized(9, 96, seed=0)
    assert data.shape == (9, 3 * 17)
    got = np.empty((9, 96), dtype=np.float32)
    _core.quant_get_rows(data, GGML_MXFP4, np.arange(9, dtype=np.int64), got, False)
    assert torch.equal(torch.from_numpy(got), dense)
    assert torch.equal(GGUFWeight(GGML_MXFP4, (9, 96), data).materialize(), dense)


def test_matmul_matches_the_dequantized_weight_on_every_isa() -> None:
    n, k = 37, 5 * 32
    data, dense = _quantized(n, k, seed=1)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(1)) * 3
    want = x @ dense.T
    outs = {}
    for isa in ("portable", None):
        for m in (1, 4, 9):
            out = torch.empty(m, n)
            _core.quant_matmul(x[:m].contiguous().numpy(), data, GGML_MXFP4, out.numpy(), 0, 2, isa=isa)
            assert ((out - want[:m]).abs() <= error_bound(x[:m], dense)).all(), (isa, m)
            outs[(isa, m)] = out
        assert not torch.equal(outs[(isa, 9)], want)  # the 8-bit activations show
    for m in (1, 4, 9):
        diff = (outs[("portable", m)] - outs[(None, m)]).abs()
        assert (diff <= _rounding(x[:m], dense)).all(), m


def test_the_cpu_isa_variable_caps_mxfp4_to_the_portable_kernels(tmp_path: Path) -> None:
    n, k = 16, 64
    data, dense = _quantized(n, k, seed=2)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(2))
    np.save(tmp_path / "w.npy", data)
    np.save(tmp_path / "x.npy", x.numpy())
    code = (
        "import sys, numpy as np; from pagedrs import _core; d = sys.argv[1]; "
        "w, x = np.load(d + '/w.npy'), np.load(d + '/x.npy'); out = np.empty((3, 16), np.float32); "
        "_core.quant_matmul(x, w, 39, out, 0, 1); np.save(d + '/out.npy', out); print(_core.quant_isa())"
    )
    env = {**os.environ, "PAGEDRS_CPU_ISA": "portable"}
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "portable"
    capped = torch.from_numpy(np.load(tmp_path / "out.npy"))
    portable = torch.empty(3, n)
    _core.quant_matmul(x.numpy(), data, GGML_MXFP4, portable.numpy(), 0, 1, isa="portable")
    assert torch.equal(capped, portable)
    best = torch.empty(3, n)
    _core.quant_matmul(x.numpy(), data, GGML_MXFP4, best.numpy(), 0, 1)
    assert ((best - capped).abs() <= _rounding(x, dense)).all()


def test_stacked_mxfp4_experts_match_float32_experts_on_every_isa() -> None:
    """The fused experts step (gpt-oss's biases and clamped SwiGLU) over MXFP4 experts against the same
    step over their dequantized float32 weights: within a few percent of the largest output (8-bit
    activations, quantized before each projection, as for the other GGUF types)."""
    e, hidden, inter, tokens, k = 4, 64, 32, 7, 2
    gu, gu_dense = _quantized(e * 2 * inter, hidden, seed=3)
    dn, dn_dense = _quantized(e * hidden, inter, seed=4)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(tokens, hidden, generator=gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(tokens)]).to(torch.int64)
    wts = torch.rand(tokens, k, generator=gen)
    b_gu, b_dn = torch.randn(e, 2 * inter, generator=gen) * 0.1, torch.randn(e, hidden, generator=gen) * 0.1
    common = dict(gate_up_bias=b_gu.numpy(), down_bias=b_dn.numpy(), swiglu=(1.702, 7.0), num_threads=2)
    ref = torch.empty(tokens, hidden)
    _core.moe_experts(
        x.numpy(),
        gu_dense.view(e, 2 * inter, hidden).numpy(),
        dn_dense.view(e, hidden, inter).numpy(),
        ids.numpy(),
        wts.numpy(),
        ref.numpy(),
        isa="portable",
        **common,  # type: ignore[arg-type]
    )
    outs = []
    for isa in ("portable", None):
        out = torch.empty(tokens, hidden)
        _core.moe_experts(
            x.numpy(),
            gu.reshape(e, 2 * inter, -1),
            dn.reshape(e, hidden, -1),
            ids.numpy(),
            wts.numpy(),
            out.numpy(),
            gate_up_type=GGML_MXFP4,
            down_type=GGML_MXFP4,
            isa=isa,
            **common,  # type: ignore[arg-type]
        )
        assert (out - ref).abs().max() <= 0.05 * ref.abs().max(), isa
        assert not torch.equal(out, ref)
        outs.append(out)
    assert (outs[0] - outs[1]).abs().max() <= 1e-4 * ref.abs().max()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the largest exponents overflow to inf (in both)
def test_openai_blocks_convert_to_ggml_blocks_without_loss() -> None:
    """Every code in every nibble, every e8m0 exponent but 255 (NaN in the OCP format): ggml's blocks
    dequantize (gguf-py) to exactly the values of OpenAI's (`dequantize_mxfp4`), in HF's layout too."""
    rng = np.random.default_rng(6)
    experts, rows, groups = 3, 5, 17 * 2  # 255 exponents over 3 * 5 * 34 = 510 blocks
    blocks = torch.from_numpy(rng.integers(0, 256, (experts, rows, groups, 16), dtype=np.uint8))
    scales = torch.from_numpy((np.arange(experts * rows * groups) % 255).astype(np.uint8))
    scales = scales.view(experts, rows, groups)
    want = dequantize_mxfp4(blocks, scales)  # [E, rows, cols]
    ggml = to_ggml_mxfp4(blocks, scales)
    assert ggml.shape == (experts, rows, groups * 17)
    assert (ggml[..., ::17] == scales.numpy()).all()  # the same exponent byte
    got = torch.from_numpy(gguf.quants.dequantize(ggml, MXFP4).astype(np.float32))
    assert torch.equal(got, want)
    kept = Mxfp4Experts(ggml, (experts, groups * 32, rows))
    assert torch.equal(kept.materialize(), want.transpose(-1, -2))
    assert torch.equal(kept.expert_rows(1, 1, 2).materialize(), want[1, 1::2])
    pairs = [("m.experts.down_proj_blocks", blocks), ("m.experts.down_proj_scales", scales)]
    ((name, t),) = mxfp4_checkpoint(iter(pairs), keep=True)
    assert name == "m.experts.down_proj" and isinstance(t, Mxfp4Experts) and t.shape == kept.shape
    assert np.array_equal(t.data, ggml)
    ((_, dense),) = mxfp4_checkpoint(iter(pairs))
    assert torch.equal(dense, want.transpose(-1, -2))
