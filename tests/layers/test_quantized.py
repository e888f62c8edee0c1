"""GGUF-quantized weights on CPU: the Rust kernels through the binding against gguf-py's dequantizer +
torch matmul, and the layers that keep such weights (fused pieces, mixed types, dense fallback, the
tied embedding / output head).

Tolerance: the kernels quantize activations to 8 bits per block of 32 (as llama.cpp does), so an output
may differ from float32 x times the dequantized weight by at most max|x| / 254 * sum|w| (helpers_quant).
"""

from __future__ import annotations

import os
import platform

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagedrs import _core
from pagedrs.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from pagedrs.layers.quantized import X8_ISAS, QuantizedWeight
from pagedrs.quantization.gguf_blocks import GGUFWeight, kernel_types
from tests.layers.helpers_quant import KERNEL_TYPES, Q, dequantized, error_bound, random_weight

# This architecture's SIMD kernel sets, the base one last (`_core.quant_isa()` names).
_SIMD = {
    "x86_64": ("avx512-vnni", "avx2"),
    "amd64": ("avx512-vnni", "avx2"),
    "aarch64": ("neon-dotprod", "neon"),
}
_FAMILY = _SIMD.get(platform.machine().lower(), ()) + ("portable",)


def test_kernel_types_are_the_gguf_types_with_kernels():
    assert kernel_types() == frozenset(int(t) for t in KERNEL_TYPES)
    assert _core.quant_isa() in _FAMILY


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 3, 4, 9])
def test_matmul_matches_gguf_dequantize(qtype, m):
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    n, k = 37, 3 * block  # odd row count (a thread's share ends mid-way), several blocks per row
    w = random_weight(qtype, n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3
    dense = dequantized(w)
    want = x @ dense.T
    for threads in (1, 2):
        got = QuantizedWeight([w]).matmul(x) if threads == 2 else _matmul_1(x, w)
        err = (got - want).abs()
        assert (err <= error_bound(x, dense)).all(), f"max err {err.max()}"
    assert not torch.equal(got, want)  # the 8-bit activations show: not a float32 matmul in disguise


def _matmul_1(x: torch.Tensor, w: GGUFWeight) -> torch.Tensor:
    out = torch.empty(x.shape[0], w.shape[0])
    _core.quant_matmul(x.numpy(), w.data, w.ggml_type, out.numpy(), 0, 1)
    return out


def test_matmul_writes_only_its_columns_and_checks_shapes():
    w = random_weight(Q.Q4_1, 8, 64)
    x = torch.randn(2, 64)
    out = torch.full((2, 13), float("nan"))
    _core.quant_matmul(x.numpy(), w.data, w.ggml_type, out.numpy(), 3, 2)
    assert out[:, :3].isnan().all() and out[:, 11:].isnan().all() and not out[:, 3:11].isnan().any()
    with pytest.raises(ValueError, match="do not fit"):
        _core.quant_matmul(x.numpy(), w.data, w.ggml_type, out.numpy(), 6, 1)
    with pytest.raises(ValueError, match="row_bytes"):
        _core.quant_matmul(x[:, :32].contiguous().numpy(), w.data, w.ggml_type, out.numpy(), 0, 1)
    with pytest.raises(ValueError, match="GGML type 35"):  # TQ2_0: no kernel
        _core.quant_matmul(x.numpy(), w.data, int(Q.TQ2_0), out.numpy(), 0, 1)


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_rows_match_gguf_dequantize(qtype):
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    w = random_weight(qtype, 11, 2 * block, seed=3)
    ids = torch.tensor([[10, 0], [3, 3]])
    got = QuantizedWeight([w]).rows(ids)
    assert got.shape == (2, 2, 2 * block)
    torch.testing.assert_close(got, dequantized(w)[ids], rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="outside 0..11"):
        QuantizedWeight([w]).rows(torch.tensor([11]))


def test_gguf_weight_cuts_and_permutes_on_rows_and_blocks():
    w = random_weight(Q.Q5_1, 6, 96, seed=4)
    dense = dequantized(w)
    torch.testing.assert_close(w.materialize(), dense)
    torch.testing.assert_close(w.narrow(0, 2, 3).materialize(), dense[2:5])
    torch.testing.assert_close(w.narrow(1, 32, 64).materialize(), dense[:, 32:96])
    order = np.array([5, 0, 4, 1, 3, 2])
    torch.testing.assert_close(w.permute_rows(order).materialize(), dense[order])
    with pytest.raises(ValueError, match="32-weight blocks"):
        w.narrow(1, 16, 32)


def _load(layer, name, tensor, shard=None):
    param = getattr(layer, name)
    param.weight_loader(param, tensor) if shard is None else param.weight_loader(param, tensor, shard)


def test_qkv_pieces_of_mixed_types_stay_quantized():
    q, k, v = (
        random_weight(Q.Q4_0, 8, 64, 1),
        random_weight(Q.Q8_0, 4, 64, 2),
        random_weight(Q.Q8_0, 4, 64, 3),
    )
    layer = QKVParallelLinear(64, 4, 2, 1, bias=True)
    bias = torch.randn(16)
    for shard, w in (("v", v), ("q", q), ("k", k)):  # any order
        _load(layer, "weight", w, shard)
    for shard, piece in zip("qkv", bias.split([8, 4, 4]), strict=True):
        _load(layer, "bias", piece, shard)
    assert layer.qweight is not None and layer.qweight.type_names == ["Q4_0", "Q8_0"]  # k|v merged
    assert layer.weight.numel() == 0  # no dense copy kept
    dense = torch.cat([dequantized(q), dequantized(k), dequantized(v)])
    x = torch.randn(5, 64)
    err = (layer(x) - F.linear(x, dense, bias)).abs()
    assert (err <= error_bound(x, dense)).all()


def test_a_dense_piece_makes_the_whole_weight_dense():
    gate, up = random_weight(Q.Q4_1, 6, 64, 5), torch.randn(6, 64)
    layer = MergedColumnParallelLinear(64, [6, 6])
    _load(layer, "weight", gate, 0)
    _load(layer, "weight", up, 1)
    assert layer.qweight is None
    torch.testing.assert_close(layer.weight.data, torch.cat([dequantized(gate), up]))


def test_row_and_column_layers_and_unsupported_types():
    x = torch.randn(3, 256)
    down = random_weight(Q.Q6_K, 5, 256, 6)
    row = RowParallelLinear(256, 5)
    _load(row, "weight", down)
    assert row.qweight is not None
    assert ((row(x) - x @ dequantized(down).T).abs() <= error_bound(x, dequantized(down))).all()
    tq2 = random_weight(Q.TQ2_0, 5, 256, 7)  # no kernel: loaded dequantized
    col = ColumnParallelLinear(256, 5)
    _load(col, "weight", tq2)
    assert col.qweight is None
    torch.testing.assert_close(col(x), x @ dequantized(tq2).T)


def test_tied_embedding_and_head_share_the_quantized_table():
    table = random_weight(Q.Q8_0, 50, 64, 8)
    embed = VocabParallelEmbedding(50, 64)
    head = ParallelLMHead(50, 64)
    head.tie_to(embed)
    _load(embed, "weight", table)
    dense = dequantized(table)
    ids = torch.tensor([0, 49, 7])
    torch.testing.assert_close(embed(ids), dense[ids])
    h = torch.randn(2, 64)
    logits = head.compute_logits(h)
    assert logits is not None and logits.shape == (2, 50)
    assert ((logits - h @ dense.T).abs() <= error_bound(h, dense)).all()


def test_long_chunks_take_a_float32_gemm_over_the_dequantized_weight():
    """From the weight's `dequant_min_rows` on (a prefill chunk), x @ W^T is torch's float32 GEMM over W
    dequantized (pieces of mixed types included), no 8-bit activations; below it, the integer kernels.
    Weights all in the x8 layout cross over later."""
    from pagedrs.layers import quantized

    pieces = [
        random_weight(Q.Q4_1, 6, 64, 1),
        random_weight(Q.Q8_0, 5, 64, 2),
        random_weight(Q.Q6_K, 3, 256, 3),
    ]
    qw = QuantizedWeight(pieces[:2])
    dense = torch.cat([dequantized(p) for p in pieces[:2]])
    assert torch.equal(qw.dequantized(), dense)
    rows = quantized.DEQUANT_MIN_ROWS
    assert qw.dequant_min_rows == rows  # pieces of 6 and 5 rows: not in the x8 layout
    x8 = QuantizedWeight([random_weight(Q.Q4_1, 16, 64, 5)])
    want = quantized.DEQUANT_MIN_ROWS_X8 if _core.quant_isa() in X8_ISAS else rows
    assert x8.dequant_min_rows == want
    q8 = QuantizedWeight([random_weight(Q.Q8_0, 16, 64, 5)])  # x8 too, but cheap to dequantize
    assert q8.runs[0].packed == (_core.quant_isa() in X8_ISAS) and q8.dequant_min_rows == rows
    x = torch.randn(rows + 3, 64, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(qw.matmul(x), x @ dense.T, rtol=1e-5, atol=1e-5)
    short = qw.matmul(x[: rows - 1])
    assert (short - x[: rows - 1] @ dense.T).abs().max() > 1e-4  # the 8-bit activations show below it
    assert (short - x[: rows - 1] @ dense.T).abs().max() <= error_bound(x[: rows - 1], dense).max()
    k6 = QuantizedWeight(pieces[2:])
    assert torch.equal(k6.dequantized(), dequantized(pieces[2]))


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_each_row_is_bit_identical_whatever_the_batch(qtype):
    """A row's outputs do not depend on how many rows share the call or where it sits (tiles of several
    rows, tails, threads): a decode step of one sequence and a speculative verification of five, or a
    batch of 13, give that sequence the same bits (greedy speculative decoding relies on it)."""
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    n, k = 45, 2 * block
    w = random_weight(qtype, n, k, seed=11)
    x = torch.randn(13, k, generator=torch.Generator().manual_seed(11)) * 2
    full = _matmul_1(x, w)
    for m in (1, 2, 3, 4, 5, 7, 8, 9):
        for start in range(0, 13 - m + 1, 2):
            part = _matmul_1(x[start : start + m].contiguous(), w)
            assert torch.equal(part, full[start : start + m]), f"m={m} start={start}"
    assert torch.equal(QuantizedWeight([w]).matmul(x), full)  # the warm pool's threads too


_X8 = [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K]


@pytest.mark.parametrize("qtype", _X8, ids=lambda t: t.name)
def test_x8_layout_multiplies_and_dequantizes_as_the_file_layout(qtype):
    """Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K weights with a multiple of 8 rows are
    repacked 8 rows at a time at load (on AVX2): same products within the kernels' bound, same
    dequantized rows, each row's bits independent of the batch."""
    n, k = 40, 3 * (gguf.GGML_QUANT_SIZES[qtype][0])
    w = random_weight(qtype, n, k, seed=7)
    packed = _core.quant_pack_x8(w.data, int(qtype))
    assert packed.shape == w.data.shape and not np.array_equal(packed, w.data)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(7)) * 3
    dense = dequantized(w)
    full = torch.empty(9, n)
    _core.quant_matmul(x.numpy(), packed, int(qtype), full.numpy(), 0, 2, packed=True)
    assert ((full - x @ dense.T).abs() <= error_bound(x, dense)).all()
    for start, m in ((0, 1), (3, 1), (4, 2), (6, 3), (2, 4), (1, 5)):
        part = torch.empty(m, n)
        _core.quant_matmul(x[start : start + m].numpy(), packed, int(qtype), part.numpy(), 0, 1, packed=True)
        assert torch.equal(part, full[start : start + m]), f"rows {start}+{m}"
    ids = np.array([39, 0, 8, 8], dtype=np.int64)
    rows = np.empty((4, k), dtype=np.float32)
    _core.quant_get_rows(packed, int(qtype), ids, rows, packed=True)
    torch.testing.assert_close(torch.from_numpy(rows), dense[ids], rtol=1e-6, atol=1e-7)
    qw = QuantizedWeight([w])
    assert qw.runs[0].packed == (_core.quant_isa() in X8_ISAS)
    if qw.runs[0].packed:
        assert torch.equal(qw.matmul(x), full)
    torch.testing.assert_close(qw.dequantized(), dense, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q5_0, Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_every_kernel_set_gives_the_same_bits(qtype):
    """`isa=` picks the kernels (on x86-64 AVX-512 VNNI's `vpdpbusd` in the x8 layout, AVX2's `maddubs`;
    ones this CPU lacks give way to the nearest below): in the x8 layout every kernel set gives the same
    bits at 1-9 rows; in the file layout AVX-512 VNNI and AVX2 (the same kernels there) do, and the
    others sum in another order (within the error bound); an unknown name is a ValueError."""
    n, k = 24, 256
    w = random_weight(qtype, n, k, seed=3)
    x = (torch.randn(9, k, generator=torch.Generator().manual_seed(3)) * 4).numpy()
    layouts = [(w.data, False), (_core.quant_pack_x8(w.data, int(qtype)), True)]
    bound = error_bound(torch.from_numpy(x), dequantized(w)).numpy()
    ref = _FAMILY[-2] if len(_FAMILY) > 1 else "portable"  # the base SIMD set
    for data, packed in layouts:
        want = np.empty((9, n), dtype=np.float32)
        _core.quant_matmul(x, data, int(qtype), want, 0, 2, packed, isa=ref)
        assert (np.abs(want - x @ dequantized(w).numpy().T) <= bound).all()
        for isa in (*_FAMILY, _core.quant_isa()):
            same_kernels = packed or isa == ref or {isa, ref} <= X8_ISAS
            for m in (1, 2, 4, 5, 9):
                got = np.empty((m, n), dtype=np.float32)
                _core.quant_matmul(x[:m], data, int(qtype), got, 0, 2, packed, isa=isa)
                if same_kernels:
                    assert np.array_equal(got.view(np.uint32), want[:m].view(np.uint32)), (isa, m, packed)
                else:
                    assert (np.abs(got - want[:m]) <= 2 * bound[:m]).all(), (isa, m, packed)
    with pytest.raises(ValueError, match="avx1024"):
        _core.quant_matmul(x[:1], w.data, int(qtype), np.empty((1, n), np.float32), isa="avx1024")


def test_the_cpu_isa_variable_caps_the_kernels():
    """PAGEDRS_CPU_ISA names lower kernels for comparisons (as oneDNN's ONEDNN_MAX_CPU_ISA); a name this
    CPU does not run, or no kernel set's name, leaves the best ones."""
    import subprocess
    import sys

    def isa(value: str | None) -> str:
        env = {k: v for k, v in os.environ.items() if k != "PAGEDRS_CPU_ISA"}
        if value is not None:
            env["PAGEDRS_CPU_ISA"] = value
        code = "from pagedrs import _core; print(_core.quant_isa())"
        return subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        ).stdout.strip()

    best = isa(None)
    assert isa("portable") == "portable"
    assert isa("avx1024") == best
    assert isa("neon" if best in ("avx2", "avx512-vnni") else "avx2") == best


def test_x8_layout_refuses_what_it_cannot_lay_out():
    with pytest.raises(ValueError, match="multiple of 8"):
        _core.quant_pack_x8(random_weight(Q.Q4_1, 12, 32).data, int(Q.Q4_1))
    with pytest.raises(ValueError, match="MXFP4"):
        _core.quant_pack_x8(random_weight(Q.MXFP4, 8, 256).data, int(Q.MXFP4))
    w = random_weight(Q.Q4_0, 8, 64)
    out = np.empty((1, 16), dtype=np.float32)
    with pytest.raises(ValueError, match="multiple of 8"):
        _core.quant_matmul(np.ones((1, 64), np.float32), w.data[:4], int(Q.Q4_0), out, 0, 1, packed=True)
