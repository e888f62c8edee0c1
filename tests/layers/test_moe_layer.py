"""The MoE layer: routing against HF's routers (ties, an expert with no tokens, all tokens to one expert,
top-k equal to the number of experts), the fused experts step (torch and the Rust kernels, float32 and
GGUF-quantized) against HF's experts, and the stacked weights' loaders."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.models.mixtral.modeling_mixtral import MixtralExperts, MixtralTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from pagedrs import _core
from pagedrs.distributed.group import TPGroup
from pagedrs.layers.moe import (
    ExpertWeights,
    FusedExperts,
    RoutingConfig,
    expert_tensor_name,
    fused_experts_torch,
    route,
)
from pagedrs.quantization.gguf_blocks import GGUFWeight
from tests.models.helpers_moe import mixtral_config, qwen3_moe_config


def _hf_router(kind: str, experts: int, top_k: int, norm: bool = True) -> torch.nn.Module:
    if kind == "mixtral":
        cfg = mixtral_config(num_local_experts=experts, num_experts_per_tok=top_k)
        return MixtralTopKRouter(cfg)
    cfg = qwen3_moe_config(num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=norm)
    return Qwen3MoeTopKRouter(cfg)


@pytest.mark.parametrize(
    ("kind", "experts", "top_k", "norm"),
    [("mixtral", 8, 2, True), ("qwen3", 16, 4, True), ("qwen3", 16, 4, False), ("qwen3", 6, 6, False)],
)
def test_routing_matches_hf_routers_with_ties(kind: str, experts: int, top_k: int, norm: bool) -> None:
    """Router rows repeated (experts 1 and 5 identical, 2 and 3 identical), so many tokens see exact ties
    in their logits: the same experts in the same order as HF, and the same weights."""
    torch.manual_seed(0)
    hf = _hf_router(kind, experts, top_k, norm)
    with torch.no_grad():
        hf.weight.normal_()
        hf.weight[5] = hf.weight[1]
        hf.weight[3] = hf.weight[2]
        hf.weight[4] = 0.0  # ties with every other zero row... and gives logit 0 for all tokens
    x = torch.randn(64, hf.weight.shape[1])
    x[:8] = 0.0  # all logits equal: every expert ties
    _, hf_w, hf_ids = hf(x)
    cfg = RoutingConfig(experts, top_k, renormalize=norm)
    w, ids = route(torch.nn.functional.linear(x, hf.weight), cfg)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(w, hf_w, rtol=0, atol=0)
    if top_k < experts:
        assert (ids[:8] == hf_ids[:8]).all() and len(set(ids[:8, 0].tolist())) == 1  # tie order is HF's


def test_topk_then_softmax_and_config_checks() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    w, ids = route(logits, RoutingConfig(4, 2, softmax_before_topk=False, router_bias=True))
    assert ids.tolist() == [[1, 2]]
    torch.testing.assert_close(w, torch.softmax(torch.tensor([[3.0, 2.0]]), -1))
    with pytest.raises(ValueError, match="top_k must be in 1..num_experts \\(4\\), got 5"):
        RoutingConfig(4, 5)
    with pytest.raises(ValueError, match="num_experts must be > 0, got 0"):
        RoutingConfig(0, 1)
    with pytest.raises(ValueError, match="shared_expert_gate needs a shared expert"):
        RoutingConfig(4, 2, shared_expert_gate=True)
    with pytest.raises(ValueError, match="router logits have 3 experts, expected 4"):
        route(torch.zeros(2, 3), RoutingConfig(4, 2))


def _hf_experts(experts: int, hidden: int, inter: int) -> MixtralExperts:
    cfg = mixtral_config(num_local_experts=experts, hidden_size=hidden, intermediate_size=inter)
    cfg._experts_implementation = "eager"
    torch.manual_seed(1)
    mod = MixtralExperts(cfg)
    with torch.no_grad():
        mod.gate_up_proj.normal_(0, 0.2)
        mod.down_proj.normal_(0, 0.2)
    return mod


ID_CASES = {
    "random": None,
    "one-expert-idle": "idle",
    "all-to-one": "one",
    "topk-all": "all",
}


@pytest.mark.parametrize("case", list(ID_CASES))
def test_fused_experts_match_hf_experts(case: str) -> None:
    """torch path and the Rust kernel (float32, 1 and 2 threads) against HF's eager MixtralExperts."""
    experts, hidden, inter, tokens = 6, 32, 24, 19
    hf = _hf_experts(experts, hidden, inter)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(tokens, hidden, generator=gen)
    top_k = experts if case == "topk-all" else 2
    logits = torch.randn(tokens, experts, generator=gen)
    if case == "idle":
        logits[:, 3] = -1e9  # expert 3 gets no token
    if case == "one":
        top_k = 1
        logits[:, 4] = 1e9
    w, ids = route(logits, RoutingConfig(experts, top_k))
    if case == "idle":
        assert 3 not in ids.tolist()
    with torch.no_grad():
        ref = hf(x, ids, w)
        got = fused_experts_torch(x, hf.gate_up_proj, hf.down_proj, w, ids)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    for threads in (1, 2):
        out = np.full((tokens, hidden), np.nan, dtype=np.float32)
        _core.moe_experts(
            x.numpy(),
            hf.gate_up_proj.detach().numpy(),
            hf.down_proj.detach().numpy(),
            ids.numpy(),
            w.numpy(),
            out,
            num_threads=threads,
        )
        torch.testing.assert_close(torch.from_numpy(out), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("gu_type", "dn_type"), [("Q8_0", "Q8_0"), ("Q4_1", "Q5_0"), ("Q4_0", "Q8_0")])
def test_quantized_experts_binding_matches_dequantized_torch(gu_type: str, dn_type: str) -> None:
    """GGUF-quantized stacked experts (gate_up and down may differ in type, as in Q4_K_M files; the K types are covered by cargo test):
    the kernel against the torch step over the dequantized weights, within the 8-bit activations' error."""
    import gguf

    experts, hidden, inter, tokens, top_k = 4, 256, 256, 9, 2
    gen = torch.Generator().manual_seed(3)
    qts = getattr(gguf.GGMLQuantizationType, gu_type), getattr(gguf.GGMLQuantizationType, dn_type)
    gu = gguf.quants.quantize(torch.randn(experts * 2 * inter, hidden, generator=gen).numpy() * 0.1, qts[0])
    dn = gguf.quants.quantize(torch.randn(experts * hidden, inter, generator=gen).numpy() * 0.1, qts[1])
    gu_f = torch.from_numpy(gguf.quants.dequantize(gu, qts[0]).reshape(experts, 2 * inter, hidden).copy())
    dn_f = torch.from_numpy(gguf.quants.dequantize(dn, qts[1]).reshape(experts, hidden, inter).copy())
    x = torch.randn(tokens, hidden, generator=gen)
    w, ids = route(torch.randn(tokens, experts, generator=gen), RoutingConfig(experts, top_k))
    ref = fused_experts_torch(x, gu_f, dn_f, w, ids)
    out = np.empty((tokens, hidden), dtype=np.float32)
    _core.moe_experts(
        x.numpy(),
        gu.reshape(experts, 2 * inter, -1),
        dn.reshape(experts, hidden, -1),
        ids.numpy(),
        w.numpy(),
        out,
        gate_up_type=int(qts[0]),
        down_type=int(qts[1]),
        num_threads=2,
    )
    err = (torch.from_numpy(out) - ref).abs().max() / ref.abs().max()
    assert err < 0.03, f"relative error {err:.4f}"


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_packed_quantized_experts_equal_the_unpacked_ones(qtype: str) -> None:
    """Stacked experts repacked 8 rows at a time at load (`StackedQuantWeight`, `quant_pack_x8`) give the
    unpacked kernel's step, both packed or one; they dequantize to the same weights; a type without the
    layout is a ValueError."""
    import gguf

    from pagedrs.layers.moe.stacked_quant import StackedQuantWeight

    experts, hidden, inter, tokens, top_k = 4, 64, 32, 11, 2
    gen = torch.Generator().manual_seed(5)
    qt = int(getattr(gguf.GGMLQuantizationType, qtype))
    gu = gguf.quants.quantize(torch.randn(experts * 2 * inter, hidden, generator=gen).numpy() * 0.1, qt)
    dn = gguf.quants.quantize(torch.randn(experts * hidden, inter, generator=gen).numpy() * 0.1, qt)
    x = torch.randn(tokens, hidden, generator=gen)
    w, ids = route(torch.randn(tokens, experts, generator=gen), RoutingConfig(experts, top_k))
    plain = [
        StackedQuantWeight(qt, a.reshape(experts, r, -1), c, pack=False)
        for a, r, c in ((gu, 2 * inter, hidden), (dn, hidden, inter))
    ]
    packed = [
        StackedQuantWeight(qt, a.reshape(experts, r, -1), c)
        for a, r, c in ((gu, 2 * inter, hidden), (dn, hidden, inter))
    ]
    assert all(p.packed for p in packed) and not any(p.packed for p in plain)
    assert not np.array_equal(packed[0].data, plain[0].data)
    for p, q in zip(packed, plain, strict=True):
        torch.testing.assert_close(p.dequantized(), q.dequantized(), atol=0, rtol=0)

    def run(g: StackedQuantWeight, d: StackedQuantWeight) -> np.ndarray:
        out = np.full((tokens, hidden), np.nan, dtype=np.float32)
        _core.moe_experts(
            x.numpy(),
            g.data,
            d.data,
            ids.numpy(),
            w.numpy(),
            out,
            gate_up_type=qt,
            down_type=qt,
            num_threads=2,
            gate_up_packed=g.packed,
            down_packed=d.packed,
        )
        return out

    want = run(*plain)
    for g, d in ((packed[0], packed[1]), (packed[0], plain[1]), (plain[0], packed[1])):
        np.testing.assert_allclose(run(g, d), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    with pytest.raises(ValueError, match="MXFP4"):
        _core.moe_experts(
            np.zeros((tokens, 256), np.float32),
            np.zeros((experts, 2 * inter, 136), np.uint8),  # 256-wide MXFP4 rows
            np.zeros((experts, 256, inter), np.float32),
            ids.numpy(),
            w.numpy(),
            np.zeros((tokens, 256), np.float32),
            gate_up_type=int(gguf.GGMLQuantizationType.MXFP4),
            gate_up_packed=True,
        )


def test_binding_rejects_bad_arguments() -> None:
    x = np.zeros((2, 8), np.float32)
    gu, dn = np.zeros((3, 8, 8), np.float32), np.zeros((3, 8, 4), np.float32)
    ids, w, out = (
        np.array([[0, 1], [2, 3]], np.int64),
        np.ones((2, 2), np.float32),
        np.zeros((2, 8), np.float32),
    )
    with pytest.raises(ValueError, match=r"ids\[3\] = 3 is outside 0..3"):
        _core.moe_experts(x, gu, dn, ids, w, out)
    with pytest.raises(
        ValueError, match=r"moe_experts needs .*got x \[2, 8\], gate_up \[3, 8, 8\], down \[3, 8, 5\]"
    ):
        _core.moe_experts(x, gu, np.zeros((3, 8, 5), np.float32), ids, w, out)
    with pytest.raises(ValueError, match="topk_ids must be int64"):
        _core.moe_experts(x, gu, dn, ids.astype(np.int32), w, out)
    with pytest.raises(ValueError, match="GGML type 99 has no quantized CPU kernel"):
        _core.moe_experts(x, gu.view(np.uint8), dn, ids, w, out, gate_up_type=99)


def test_expert_names_and_stacked_loading_agree() -> None:
    """Per-expert tensors (Mixtral's w1/w3/w2, Qwen's gate/up/down) and HF v5's stacked gate_up_proj /
    down_proj load the same stacked weights; a tensor-parallel rank takes its slice of every expert."""
    assert expert_tensor_name("model.layers.0.mlp.experts.12.w3.weight") == (
        "model.layers.0.mlp.experts.gate_up.weight",
        (12, 1),
    )
    assert expert_tensor_name("m.mlp.experts.1.down_proj.weight") == ("m.mlp.experts.down.weight", (1, 0))
    assert expert_tensor_name("m.mlp.experts.gate_up_proj") == ("m.mlp.experts.gate_up.weight", None)
    assert expert_tensor_name("m.mlp.shared_expert.gate_proj.weight") is None
    hf = _hf_experts(3, 16, 8)
    a = FusedExperts(3, 16, 8, tp=TPGroup(), dtype=torch.float32, device="cpu")
    b = FusedExperts(3, 16, 8, tp=TPGroup(), dtype=torch.float32, device="cpu")
    a.gate_up.weight_loader(a.gate_up.weight, hf.gate_up_proj.detach())
    a.down.weight_loader(a.down.weight, hf.down_proj.detach())
    for e in range(3):
        gate, up = hf.gate_up_proj[e].detach().chunk(2)
        b.gate_up.weight_loader(b.gate_up.weight, gate, (e, 0))
        b.gate_up.weight_loader(b.gate_up.weight, up, (e, 1))
        b.down.weight_loader(b.down.weight, hf.down_proj[e].detach(), (e, 0))
    assert torch.equal(a.gate_up.weight, hf.gate_up_proj) and torch.equal(b.gate_up.weight, a.gate_up.weight)
    assert torch.equal(b.down.weight, hf.down_proj)
    with pytest.raises(ValueError, match=r"shape mismatch \(expert 1\): expected \(8, 16\), got \(7, 16\)"):
        b.gate_up.weight_loader(b.gate_up.weight, gate[:7], (1, 0))
    # rank 1 of 2: rows 4..8 of each piece of gate_up, columns 4..8 of down
    r1 = ExpertWeights(3, [8, 8], 16, split="column", tp=TPGroup(1, 2), dtype=torch.float32, device="cpu")
    r1.weight_loader(r1.weight, hf.gate_up_proj.detach())
    g, u = hf.gate_up_proj[2].detach().chunk(2)
    assert torch.equal(r1.weight[2], torch.cat([g[4:], u[4:]]))
    d1 = ExpertWeights(3, [16], 8, split="row", tp=TPGroup(1, 2), dtype=torch.float32, device="cpu")
    d1.weight_loader(d1.weight, hf.down_proj.detach())
    assert torch.equal(d1.weight, hf.down_proj.detach()[:, :, 4:])


def test_quantized_pieces_are_kept_stacked() -> None:
    import gguf

    q8 = gguf.GGMLQuantizationType.Q8_0
    w = torch.randn(2 * 64, 32).numpy()
    data = gguf.quants.quantize(w, q8)
    ew = ExpertWeights(2, [32, 32], 32, split="column", tp=TPGroup(), dtype=torch.float32, device="cpu")
    for e in range(2):
        for p in range(2):
            rows = slice((2 * e + p) * 32, (2 * e + p + 1) * 32)
            ew.weight_loader(ew.weight, GGUFWeight(int(q8), (32, 32), data[rows]), (e, p))
    assert len(ew.pending) == 4 and ew.qweight is None  # loading holds the pieces as they came
    assert ew.gguf_stackable() and ew.take_gguf()  # the GGUF CPU method's after-load stacks them
    assert ew.qweight is not None and ew.weight.numel() == 0 and not ew.pending
    torch.testing.assert_close(ew.dense().reshape(-1, 32), torch.from_numpy(gguf.quants.dequantize(data, q8)))
