"""The fused experts kernels of cuda/moe_ops.cu, run by the CPU emulator, against a float64 reference of
the step (each token's k experts: gate/up, activation, down, weighted sum) on the same (rounded or
dequantized) weights: random routings and the edge cases (experts without rows, every row to one expert,
top-k equal to the number of experts), sizes that are not multiples of the tiles, both row tiles, every
activation with and without biases, float32/float16/bfloat16 with dense weights and the quantized forms
(GGUF Q8_0, fp8 e4m3 with per-row scales); plus the alignment step's layout and the layer's CUDA branch
against its torch path."""

from __future__ import annotations

from collections.abc import Iterator

import gguf
import numpy as np
import pytest
import torch

from pagedrs.distributed.group import TPGroup
from pagedrs.kernels import moe_ops
from pagedrs.kernels._loader import CTYPES, moe_op_names
from pagedrs.kernels.moe_ops import ExpertMatrix
from pagedrs.layers.kernel_switch import use_layer_kernels
from pagedrs.layers.moe import CudaExperts, FusedExperts, TorchExperts, fused_experts_torch, kernel_form
from pagedrs.layers.moe.experts import ExpertActivation
from tests.kernels.emu.emulator import needs_emulator, recording_kernels

pytestmark = needs_emulator

# tolerance on max |kernel - reference| / max |reference|: float32 accumulates in another order; 16-bit
# activations are rounded where a 16-bit torch layer rounds them (gate/up, activation, expert outputs)
TOL = {torch.float32: 2e-6, torch.float16: 3e-3, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module")
def launched() -> Iterator[list[str]]:
    names = [n for ctype in CTYPES.values() for n in moe_op_names(ctype)]
    with recording_kernels(names) as seen:
        yield seen


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _glu64(g: torch.Tensor, u: torch.Tensor, act: str, alpha: float, limit: float) -> torch.Tensor:
    if act == "silu":
        return torch.nn.functional.silu(g) * u
    if act == "gelu":
        return torch.nn.functional.gelu(g) * u
    if act == "gelu_tanh":
        return torch.nn.functional.gelu(g, approximate="tanh") * u
    g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
    return (u + 1) * g * torch.sigmoid(alpha * g)


def _reference(
    x: torch.Tensor,
    wgu: torch.Tensor,
    wd: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    act: str,
    bgu: torch.Tensor | None = None,
    bd: torch.Tensor | None = None,
    alpha: float = 1.702,
    limit: float = 7.0,
) -> torch.Tensor:
    """float64, token by token and slot by slot (no sorting): what the step means."""
    x, wgu, wd, weights = x.double(), wgu.double(), wd.double(), weights.double()
    inter = wd.shape[2]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = wgu[e] @ x[t] + (0 if bgu is None else bgu[e].double())
            h = _glu64(gu[:inter], gu[inter:], act, alpha, limit)
            out[t] += weights[t, j] * (wd[e] @ h + (0 if bd is None else bd[e].double()))
    return out


def _routing(tokens: int, experts: int, k: int, seed: int, *, only: list[int] | None = None) -> tuple:
    """Random distinct top-k ids (from `only` when given) and weights summing to 1."""
    pool = torch.tensor(only if only is not None else list(range(experts)))
    g = _gen(seed)
    ids = torch.stack([pool[torch.randperm(len(pool), generator=g)[:k]] for _ in range(tokens)])
    w = torch.rand(tokens, k, generator=g) + 0.1
    return w / w.sum(-1, keepdim=True), ids.to(torch.int64)


def _check(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    err = (got.double() - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert scale > 0 and err <= TOL[dtype] * scale, f"max error {err:.3g} vs max |ref| {scale:.3g}"


def _dense_case(
    tokens: int, experts: int, k: int, hidden: int, inter: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = _gen(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    wgu = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5).to(dtype)
    wd = (torch.randn(experts, hidden, inter, generator=g) / inter**0.5).to(dtype)
    return x, wgu, wd


CASES = {
    # name: (tokens, experts, top_k, hidden, inter, only these experts)
    "random": (9, 6, 2, 40, 24, [0, 1, 3, 4]),  # experts 2 and 5 get no rows
    "one_expert": (19, 4, 1, 33, 70, [2]),  # every row to expert 2: two 16-row tiles, 3 rows in the 2nd
    "top_k_all": (5, 3, 3, 136, 17, None),  # every expert for every token; 136 = 128 + 8 down columns
}


# (dtype, tensor cores): the fp32-FMA kernels take every dtype, the tensor-core ones the 16-bit types
KERNELS = [
    (torch.float32, False),
    (torch.float16, True),
    (torch.float16, False),
    (torch.bfloat16, True),
    (torch.bfloat16, False),
]
KERNEL_IDS = [f"{str(d).removeprefix('torch.')}-{'mma' if m else 'fma'}" for d, m in KERNELS]


@pytest.mark.parametrize(("dtype", "mma"), KERNELS, ids=KERNEL_IDS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_dense_experts_match_float64_reference(
    case: str, dtype: torch.dtype, mma: bool, launched: list[str]
) -> None:
    tokens, experts, k, hidden, inter, only = CASES[case]
    x, wgu, wd = _dense_case(tokens, experts, k, hidden, inter, dtype, seed=sorted(CASES).index(case))
    weights, ids = _routing(tokens, experts, k, seed=7, only=only)
    launched.clear()
    out = moe_ops.fused_experts(x, ExpertMatrix(wgu), ExpertMatrix(wd), weights, ids, use_tensor_cores=mma)
    assert out.dtype == dtype and out.shape == x.shape
    _check(out, _reference(x, wgu, wd, weights.to(dtype), ids, "silu"), dtype)
    ctype, tc = CTYPES[str(dtype).removeprefix("torch.")], "true" if mma else "false"
    assert launched == [
        "pagedrs::moe_align",
        f"pagedrs::moe_gate_up<{ctype}, 0, 0, 16, {tc}>",
        f"pagedrs::moe_down<{ctype}, 0, 16, {tc}>",
        f"pagedrs::moe_sum<{ctype}>",
    ]


@pytest.mark.parametrize("mma", [True, False], ids=["mma", "fma"])
@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh", "swiglu_oai"])
def test_activations_and_biases_with_64_row_tiles(act: str, mma: bool, launched: list[str]) -> None:
    """70 rows over 2 experts (64-row tiles: a full and a partial tile for the busier one), biases on both
    projections; gpt-oss's clamps act (a small limit, large gate/up values)."""
    dtype, experts = torch.bfloat16, 2
    x, wgu, wd = _dense_case(70, experts, 1, 35, 20, dtype, seed=3)
    x = x * 3
    g = _gen(4)
    bgu = torch.randn(experts, 40, generator=g).to(dtype)
    bd = torch.randn(experts, 35, generator=g).to(dtype)
    weights, ids = _routing(70, experts, 1, seed=5)
    limit = 1.5
    launched.clear()
    out = moe_ops.fused_experts(
        x, ExpertMatrix(wgu), ExpertMatrix(wd), weights, ids, activation=act, swiglu_limit=limit,
        gate_up_bias=bgu, down_bias=bd, block_m=64, use_tensor_cores=mma,
    )  # fmt: skip
    tc = "true" if mma else "false"
    assert f"pagedrs::moe_gate_up<pagedrs::bf16_t, 0, {moe_ops.MOE_ACTIVATIONS[act]}, 64, {tc}>" in launched
    ref = _reference(x, wgu, wd, weights.to(dtype), ids, act, bgu, bd, limit=limit)
    _check(out, ref, dtype)
    if act == "swiglu_oai":  # the clamp changed the result: without it the reference differs
        unclamped = _reference(x, wgu, wd, weights.to(dtype), ids, act, bgu, bd, limit=1e9)
        assert (unclamped - ref).abs().max() > 0.2 * ref.abs().max()


def _q8_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 [E, rows, cols / 32 * 34] GGUF Q8_0 blocks, their float32 dequantization [E, rows, cols])."""
    q8 = gguf.GGMLQuantizationType.Q8_0
    blocks = np.stack([gguf.quants.quantize(w[e].float().numpy(), q8) for e in range(w.shape[0])])
    deq = np.stack([gguf.quants.dequantize(b, q8) for b in blocks])
    return torch.from_numpy(np.ascontiguousarray(blocks)), torch.from_numpy(deq.astype(np.float32))


def _fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp8 e4m3 [E, rows, cols], float32 scale [E, rows], the dequantized float32 weight)."""
    scale = w.float().abs().amax(-1).clamp(min=1e-6) / 448.0
    q = (w.float() / scale[..., None]).to(torch.float8_e4m3fn)
    return q, scale.contiguous(), q.float() * scale[..., None]


@pytest.mark.parametrize(("dtype", "mma"), KERNELS[1:], ids=KERNEL_IDS[1:])
@pytest.mark.parametrize("form", ["q8_0", "fp8"])
def test_quantized_experts_match_reference_on_their_dequantized_weights(
    form: str, dtype: torch.dtype, mma: bool, launched: list[str]
) -> None:
    experts, hidden, inter = 5, 64, 32  # Q8_0: multiples of 32 columns
    x, wgu, wd = _dense_case(11, experts, 2, hidden, inter, torch.float32, seed=11)
    x = x.to(dtype)
    weights, ids = _routing(11, experts, 2, seed=12, only=[0, 2, 3, 4])
    if form == "q8_0":
        (qgu, dgu), (qd, dd) = _q8_0(wgu), _q8_0(wd)
        mgu, md = ExpertMatrix(qgu, "q8_0", cols=hidden), ExpertMatrix(qd, "q8_0", cols=inter)
    else:
        (qgu, sgu, dgu), (qd, sd, dd) = _fp8(wgu), _fp8(wd)
        mgu, md = ExpertMatrix(qgu, "fp8", sgu), ExpertMatrix(qd, "fp8", sd)
    launched.clear()
    out = moe_ops.fused_experts(x, mgu, md, weights, ids, activation="gelu", use_tensor_cores=mma)
    wf, tc = moe_ops.MOE_WEIGHT_FORMS[form], "true" if mma else "false"
    assert any(n.startswith("pagedrs::moe_down<") and f", {wf}, 16, {tc}>" in n for n in launched)
    _check(out, _reference(x, dgu, dd, weights.to(dtype), ids, "gelu"), dtype)
    # the quantization is not a no-op: the reference on the unquantized weights is farther away
    assert (_reference(x, wgu, wd, weights.to(dtype), ids, "gelu") - out.double()).abs().max() > 0


def test_alignment_groups_pairs_by_expert_in_order_with_padded_tiles(launched: list[str]) -> None:
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 1], [0, 3]], dtype=torch.int64)  # expert 2: no rows
    experts, block_m, pairs = 5, 16, ids.numel()
    sorted_ids, tile_expert = moe_ops.align_by_expert(ids, experts, block_m)
    flat = ids.reshape(-1).tolist()
    want_tiles = [e for e in range(experts) if e in flat]  # one 16-row tile each here
    tiles = len(want_tiles)
    assert tile_expert.tolist() == want_tiles + [-1] * (tile_expert.numel() - tiles)
    for i, e in enumerate(want_tiles):
        rows = sorted_ids[i * block_m : (i + 1) * block_m].tolist()
        mine = [p for p, x in enumerate(flat) if x == e]  # pair order kept
        assert rows == mine + [pairs] * (block_m - len(mine))
    assert (sorted_ids[tiles * block_m :] == pairs).all()


def test_alignment_of_many_rows_for_one_expert(launched: list[str]) -> None:
    """40 pairs (two 32-lane passes) all to expert 1 of 3: 3 tiles of 16, pair order, 8 padding rows."""
    ids = torch.ones(20, 2, dtype=torch.int64)
    sorted_ids, tile_expert = moe_ops.align_by_expert(ids, 3, 16)
    assert tile_expert.tolist()[:4] == [1, 1, 1, -1]
    assert sorted_ids[:48].tolist() == list(range(40)) + [40] * 8


def test_bad_inputs_are_refused(launched: list[str]) -> None:
    x, wgu, wd = _dense_case(3, 2, 1, 32, 8, torch.float16, seed=1)
    weights, ids = _routing(3, 2, 1, seed=2)
    with pytest.raises(ValueError, match="down must be"):
        moe_ops.fused_experts(x, ExpertMatrix(wgu), ExpertMatrix(wd[:, :, :4].contiguous()), weights, ids)
    with pytest.raises(ValueError, match="must be torch.float16 like the activations"):
        moe_ops.fused_experts(x, ExpertMatrix(wgu.float()), ExpertMatrix(wd), weights, ids)
    with pytest.raises(ValueError, match="activation must be one of"):
        moe_ops.fused_experts(x, ExpertMatrix(wgu), ExpertMatrix(wd), weights, ids, activation="relu")
    with pytest.raises(ValueError, match="q8_0"):
        moe_ops.fused_experts(x, ExpertMatrix(wgu, "q8_0", cols=32), ExpertMatrix(wd), weights, ids)
    with pytest.raises(ValueError, match="gate_up_bias"):
        moe_ops.fused_experts(
            x, ExpertMatrix(wgu), ExpertMatrix(wd), weights, ids, gate_up_bias=torch.zeros(2, 8)
        )


@pytest.mark.parametrize("gpt_oss", [False, True])
def test_layer_cuda_method_matches_its_torch_path(
    gpt_oss: bool, launched: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """FusedExperts' CUDA method (cuda_fused_experts, here on CPU tensors through the emulator) against the
    torch step on the same bfloat16 weights; a CPU layer never chooses it, and refuses it when asked."""
    act = ExpertActivation(swiglu_limit=2.0) if gpt_oss else ExpertActivation()
    layer = FusedExperts(
        4, 48, 20, tp=TPGroup(), dtype=torch.bfloat16, device="cpu", bias=gpt_oss, activation=act
    )
    g = _gen(21)
    for p in layer.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.3)
    x = torch.randn(6, 48, generator=g).to(torch.bfloat16)
    weights, ids = _routing(6, 4, 2, seed=22)
    weights = weights.to(torch.bfloat16)
    want = fused_experts_torch(
        x, layer.gate_up.weight, layer.down.weight, weights, ids, activation=act,
        b_gate_up=layer.gate_up_bias, b_down=layer.down_bias,
    )  # fmt: skip
    launched.clear()
    assert layer.cuda_kernels is None and use_layer_kernels(layer) == 1 and layer.cuda_kernels
    assert isinstance(layer.method, TorchExperts)  # a CPU layer: the CUDA method is not chosen
    layer(x, weights, ids)
    assert launched == []
    with pytest.raises(ValueError, match="'cuda' cannot run this layer: .* run on a CUDA device"):
        layer.use_method(CudaExperts)
    monkeypatch.setattr(kernel_form, "kernel_device", lambda t: True)  # as on a CUDA device
    layer.use_cuda_kernels(True)
    assert isinstance(layer.method, CudaExperts)
    got = layer(x, weights, ids)
    assert launched[0] == "pagedrs::moe_align"
    err = (got.float() - want.float()).abs().max().item()
    assert err <= 2e-2 * want.float().abs().max().item()
    with pytest.raises(
        ValueError, match=r"gate_up must be contiguous torch.float32 on cpu, got torch.bfloat16"
    ):
        layer(x.float(), weights, ids)  # never a silent fall back to torch
    layer.use_cuda_kernels(False)
    assert isinstance(layer.method, TorchExperts)
