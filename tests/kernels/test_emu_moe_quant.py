"""Quantized experts kept quantized for the CUDA fused experts kernel (cuda/moe_ops.cu), run on CPU tensors
through the kernel emulator: the kernel's fp8 form with block scales against a float64 reference; a tiny
Qwen3-MoE FP8 checkpoint (block `weight_scale_inv` as Qwen3-*-FP8 ships it, or compressed-tensors'
per-channel scales) loaded as on a GPU keeps its experts in fp8 and its run through the kernel equals the
float32 model holding the dequantized weights; a Q8_0 MoE GGUF file loaded as on a GPU keeps its experts'
Q8_0 blocks and equals its float32 dequantized run."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import pagedrs.loader.load
from pagedrs.distributed.group import TPGroup
from pagedrs.kernels import moe_ops
from pagedrs.kernels._loader import moe_op_names, quant_op_names
from pagedrs.kernels.moe_ops import ExpertMatrix
from pagedrs.layers.moe import CudaExperts, FusedExperts, kernel_form
from pagedrs.loader import LoadedModel, load_model
from pagedrs.quantization import fp8_block
from pagedrs.quantization.fp8_block import Fp8Block
from tests.helpers import greedy_by_logits, logits_of
from tests.kernels.emu.emulator import needs_emulator, recording_kernels
from tests.kernels.helpers_moe_quant import make_fp8_moe_pair
from tests.loader.helpers_quant import fp8_block_quantize
from tests.models.helpers_moe import make_tiny_moe_gguf

pytestmark = needs_emulator

IDS = [7, 8, 9, 10, 120, 3, 55, 201, 17]
# float32 activations: the kernel (fp32 FMAs) and torch on the dequantized weights differ only in the order
# of their float32 sums
LOGITS_TOL = 1e-4


@pytest.fixture(scope="module")
def launched() -> Iterator[list[str]]:
    names = [n for ctype in ("float", "pagedrs::bf16_t") for n in moe_op_names(ctype)]
    names += quant_op_names("float")  # the packed GPTQ / AWQ dense layers' dequantize kernels
    with recording_kernels(names) as seen:
        yield seen


@pytest.fixture
def as_on_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Load and run as on a CUDA device: FP8 layers kept in their GPU form, GGUF Q8_0 experts kept for the
    kernel, and the experts' forward through the CUDA kernels (here the emulator)."""
    monkeypatch.setattr(pagedrs.loader.load, "packed_form", lambda dtype, device: "device")
    monkeypatch.setattr(pagedrs.loader.load, "keeps_q8_0_experts", lambda path, device, fmt: True)
    monkeypatch.setattr(kernel_form, "kernel_device", lambda t: True)


def _experts(loaded: LoadedModel) -> list[FusedExperts]:
    found = [m for m in loaded.model.modules() if isinstance(m, FusedExperts)]
    assert found
    return found


def _on_kernels(loaded: LoadedModel) -> None:
    """The experts' CUDA kernels switched on, as the "cupy" backend's layer kernels do: the CUDA method."""
    for m in _experts(loaded):
        m.use_cuda_kernels(True)
        assert isinstance(m.method, CudaExperts)


def _reference(x: torch.Tensor, wgu: torch.Tensor, wd: torch.Tensor, w: torch.Tensor, ids: torch.Tensor):
    x, wgu, wd = x.double(), wgu.double(), wd.double()
    inter = wd.shape[2]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            gu = wgu[ids[t, j]] @ x[t]
            out[t] += float(w[t, j]) * (wd[ids[t, j]] @ (torch.nn.functional.silu(gu[:inter]) * gu[inter:]))
    return out


@pytest.mark.parametrize(("dtype", "mma"), [(torch.float32, False), (torch.bfloat16, True)])
def test_fp8_block_scales_match_float64_reference(dtype: torch.dtype, mma: bool, launched: list[str]) -> None:
    """Blocks of 16 x 32 over 96 columns (gate/up) and 40 columns (down: a partial last block)."""
    g = torch.Generator().manual_seed(3)
    experts, hidden, inter, tokens = 3, 96, 40, 13
    wgu = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    wd = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    wd[:, :, 32:] *= 20  # the partial column block has its own (much larger) scale
    block = (16, 32)
    mats, deq = [], []
    for w in (wgu, wd):
        qs = [fp8_block_quantize(w[e], block) for e in range(experts)]
        q, s = torch.stack([a for a, _ in qs]), torch.stack([b for _, b in qs])
        mats.append(ExpertMatrix(q, "fp8", s, block=block))
        deq.append(torch.stack([Fp8Block(a, b, block).materialize() for a, b in qs]))
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(experts, generator=g)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2, generator=g).to(dtype)
    launched.clear()
    out = moe_ops.fused_experts(x, mats[0], mats[1], weights, ids, use_tensor_cores=mma)
    assert any(", 2, 16, " in n and n.startswith("pagedrs::moe_down<") for n in launched)
    ref = _reference(x, deq[0], deq[1], weights, ids)
    tol = 2e-6 if dtype == torch.float32 else 2e-2
    assert (out.double() - ref).abs().max() <= tol * ref.abs().max()
    # the block scales matter: one scale per row (the first block's) gives another result
    per_row = ExpertMatrix(mats[1].data, "fp8", mats[1].scale[:, :, 0].repeat_interleave(16, 1).contiguous())
    other = moe_ops.fused_experts(x, mats[0], per_row, weights, ids, use_tensor_cores=mma)
    assert (other.double() - ref).abs().max() > 0.1 * ref.abs().max()
    bad = ExpertMatrix(
        mats[0].data[:, :40].contiguous(), "fp8", mats[0].scale[:, :3].contiguous(), block=block
    )
    with pytest.raises(ValueError, match=r"scale block \[16, 32\] must .* divide the 40 rows"):
        moe_ops.fused_experts(x, bad, mats[1], weights, ids)


@pytest.mark.parametrize(
    ("strategy", "block", "scale_blocks"),
    [
        ("block", (128, 128), (None, None)),  # pieces of 32 / 64 rows and columns: one scale per row
        ("block", (32, 32), ((32, 32), (32, 32))),  # whole blocks: kept as the checkpoint's
        ("block", (64, 32), ((1, 32), (64, 32))),  # gate/up pieces of 32 rows: each row its block scales
        ("tensor", (0, 0), (None, None)),  # one scale per tensor: repeated per row
        ("channel", (0, 0), (None, None)),  # compressed-tensors per output channel
    ],
    ids=["block128", "block32", "block64x32", "fp8-tensor", "ct-channel"],
)
def test_fp8_moe_checkpoint_keeps_fp8_experts_and_equals_dequantized_model(
    tmp_path: Path,
    strategy: str,
    block: tuple[int, int],
    scale_blocks: tuple[tuple[int, int] | None, tuple[int, int] | None],
    as_on_gpu: None,
    launched: list[str],
) -> None:
    qdir, rdir = make_fp8_moe_pair(tmp_path, strategy, block)
    quant = load_model(str(qdir), dtype="float32", with_tokenizer=False)
    ref = load_model(str(rdir), dtype="float32", with_tokenizer=False)
    for m in _experts(quant):
        for w, scale_block in zip((m.gate_up, m.down), scale_blocks, strict=True):
            kw = w.kernel_weight
            assert kw is not None and kw.form == "fp8" and kw.data.dtype == torch.float8_e4m3fn
            assert kw.block == scale_block and w.weight.numel() == 0
    # the kernel's weights are exactly the dequantized model's
    for mq, mr in zip(_experts(quant), _experts(ref), strict=True):
        torch.testing.assert_close(mq.gate_up.dense(), mr.gate_up.weight, rtol=0, atol=0)
        torch.testing.assert_close(mq.down.dense(), mr.down.weight, rtol=0, atol=0)
    _on_kernels(quant)
    launched.clear()
    got = logits_of(quant, IDS)
    assert "pagedrs::moe_gate_up<float, 2, 0, 16, false>" in launched
    assert sum(n.startswith("pagedrs::moe_down<float, 2,") for n in launched) == len(_experts(quant))
    want = logits_of(ref, IDS)
    torch.testing.assert_close(got, want, rtol=LOGITS_TOL, atol=LOGITS_TOL)
    assert greedy_by_logits(quant, IDS, steps=3) == greedy_by_logits(ref, IDS, steps=3)
    assert quant.weight_nbytes < ref.weight_nbytes


def test_q8_0_moe_gguf_keeps_q8_0_experts_for_the_kernel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, as_on_gpu: None, launched: list[str]
) -> None:
    monkeypatch.setenv("PAGEDRS_CACHE", str(tmp_path / "cache"))
    path = make_tiny_moe_gguf(tmp_path, "qwen3_moe", qtype="Q8_0")
    quant = load_model(str(path), dtype="float32", with_tokenizer=False)
    monkeypatch.undo()  # the oracle: the float32 cache folder, dense experts on torch
    monkeypatch.setenv("PAGEDRS_CACHE", str(tmp_path / "cache"))
    dense = load_model(str(path), dtype="float32", with_tokenizer=False)
    for mq, md in zip(_experts(quant), _experts(dense), strict=True):
        for wq, wd in ((mq.gate_up, md.gate_up), (mq.down, md.down)):
            kw = wq.kernel_weight
            assert kw is not None and kw.form == "q8_0" and kw.data.dtype == torch.uint8
            assert wq.qweight is None and wq.weight.numel() == 0 and wd.kernel_weight is None
            torch.testing.assert_close(wq.dense(), wd.weight, rtol=0, atol=0)
    monkeypatch.setattr(kernel_form, "kernel_device", lambda t: True)  # the quantized model's device again
    _on_kernels(quant)
    launched.clear()
    got = logits_of(quant, IDS)
    assert sum(n.startswith("pagedrs::moe_down<float, 1,") for n in launched) == len(_experts(quant))
    want = logits_of(dense, IDS)
    torch.testing.assert_close(got, want, rtol=LOGITS_TOL, atol=LOGITS_TOL)


def test_fp8_block_cuts() -> None:
    q, s = fp8_block_quantize(torch.randn(64, 256), (128, 128))
    w = Fp8Block(q, s, (128, 128))
    assert w.narrow(1, 128, 128).shape == (64, 128)
    cut = w.narrow(0, 16, 32)  # inside a row block: one scale row per weight row, exact
    assert isinstance(cut, Fp8Block) and cut.block == (1, 128)
    torch.testing.assert_close(cut.materialize(), w.materialize()[16:48], rtol=0, atol=0)
    inside = w.narrow(1, 64, 128)  # inside column blocks: the dequantized slice
    assert isinstance(inside, torch.Tensor) and inside.dtype == torch.float32
    torch.testing.assert_close(inside, w.materialize()[:, 64:192], rtol=0, atol=0)


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_int4_moe_checkpoint_on_gpu_dequantizes_its_experts_at_load(
    tmp_path: Path, method: str, as_on_gpu: None, launched: list[str]
) -> None:
    """GPTQ / AWQ experts: dequantized at load to the model's dtype (dense experts on the kernel), equal
    to the float32 model holding the dequantized weights."""
    qdir, rdir = make_fp8_moe_pair(tmp_path, method)
    quant = load_model(str(qdir), dtype="float32", with_tokenizer=False)
    ref = load_model(str(rdir), dtype="float32", with_tokenizer=False)
    for mq, mr in zip(_experts(quant), _experts(ref), strict=True):
        assert mq.gate_up.kernel_weight is None and mq.gate_up.qweight is None
        torch.testing.assert_close(mq.gate_up.weight, mr.gate_up.weight, rtol=0, atol=1e-7)
        torch.testing.assert_close(mq.down.weight, mr.down.weight, rtol=0, atol=1e-7)
    _on_kernels(quant)
    launched.clear()
    got = logits_of(quant, IDS)
    assert "pagedrs::moe_gate_up<float, 0, 0, 16, false>" in launched
    torch.testing.assert_close(got, logits_of(ref, IDS), rtol=LOGITS_TOL, atol=LOGITS_TOL)


def test_each_rank_keeps_its_fp8_expert_shard(
    tmp_path: Path, as_on_gpu: None, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TP=2 with 16 x 16 blocks: each rank's gate/up rows and down columns are whole blocks, kept fp8 and
    dequantizing to exactly that rank's shard of the dequantized model; 32 x 32 blocks cut the down
    projection's 32 columns inside a block: that rank's down shards are held dequantized (logged), exact."""
    qdir, rdir = make_fp8_moe_pair(tmp_path, "block", (16, 16))
    for rank in range(2):
        tp = TPGroup(rank, 2)
        quant = load_model(str(qdir), dtype="float32", tp=tp, with_tokenizer=False)
        ref = load_model(str(rdir), dtype="float32", tp=tp, with_tokenizer=False)
        for mq, mr in zip(_experts(quant), _experts(ref), strict=True):
            for wq, wr in ((mq.gate_up, mr.gate_up), (mq.down, mr.down)):
                assert wq.kernel_weight is not None and wq.kernel_weight.block == (16, 16)
                torch.testing.assert_close(wq.dense(), wr.weight, rtol=0, atol=0)
    qdir32, rdir32 = make_fp8_moe_pair(tmp_path / "b32", "block", (32, 32))
    monkeypatch.setattr(fp8_block, "_warned", set())  # the warning is logged once per process
    with caplog.at_level(logging.WARNING, logger="pagedrs.loader"):
        quant = load_model(str(qdir32), dtype="float32", tp=TPGroup(1, 2), with_tokenizer=False)
    assert "cut inside their 32x32 scale blocks" in caplog.text
    ref = load_model(str(rdir32), dtype="float32", tp=TPGroup(1, 2), with_tokenizer=False)
    for mq, mr in zip(_experts(quant), _experts(ref), strict=True):
        assert mq.gate_up.kernel_weight is not None and mq.down.kernel_weight is None
        torch.testing.assert_close(mq.gate_up.dense(), mr.gate_up.weight, rtol=0, atol=0)
        torch.testing.assert_close(mq.down.weight, mr.down.weight, rtol=0, atol=0)


def test_experts_mixing_fp8_and_dense_pieces_load_dense() -> None:
    """A weight whose pieces arrive partly fp8, partly float (a mixed checkpoint): all dense, exact."""
    from pagedrs.layers.moe import ExpertWeights
    from pagedrs.quantization.packed_parts import Fp8

    w = ExpertWeights(2, [32, 32], 64, split="column", tp=TPGroup(), dtype=torch.float32, device="cpu")
    g = torch.Generator().manual_seed(0)
    want = torch.randn(2, 64, 64, generator=g)
    for e in range(2):
        for p in range(2):
            piece = want[e, 32 * p : 32 * p + 32]
            if (e, p) != (1, 1):
                q, s = fp8_block_quantize(piece, (32, 64))
                want[e, 32 * p : 32 * p + 32] = q.float() * s
                piece = Fp8(q, s.reshape(-1).expand(32).contiguous())
            w.weight_loader(w.weight, piece, (e, p))
    assert not w.kernel_stackable() and len(w.pending) == 3  # one piece dense: no kernel form
    w.take_dense()
    assert w.kernel_weight is None and not w.pending
    torch.testing.assert_close(w.weight, want, rtol=0, atol=0)
