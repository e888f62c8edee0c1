"""gpt-oss against HF transformers, float32: router with bias (top-k then softmax), experts with biases and
the clamped SwiGLU, attention sinks, sliding-window and full layers alternating, YaRN rope, q/k/v/o
biases. Logits plain and paged, every expert used; greedy ids through the engine with preemption,
chunked prefill and prefix caching forced on (prompts longer than the window); an MXFP4 checkpoint
(written here from the float weights) matches HF run on the same dequantized weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from pagedrs.engine.llm_engine import LLMEngine
from pagedrs.layers.attention import Attention, causal_attention
from pagedrs.layers.attention.selector import kernel_takes, route_layer, routes_to_reference
from pagedrs.layers.attention.torch_ref import TorchAttentionBackend
from pagedrs.layers.rotary import get_rope
from pagedrs.loader import load_model
from pagedrs.models.gpt_oss import GptOssForCausalLM
from pagedrs.quantization.mxfp4 import dequantize_mxfp4, mxfp4_checkpoint
from tests.engine.conftest import HFReference, PlanSpy, assert_pool_free, greedy, make_engine, run_all
from tests.engine.conftest import random_prompts as engine_prompts
from tests.helpers import load_hf_model
from tests.models.helpers_gpt_oss import (
    SLIDING_WINDOW,
    dequantize_reference,
    gpt_oss_config,
    make_tiny_gpt_oss,
    quantize_mxfp4,
    write_mxfp4_pair,
)
from tests.models.helpers_hf import assert_matches_hf, random_prompts
from tests.models.helpers_moe import expert_usage


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_gpt_oss(tmp_path_factory.mktemp("gpt_oss") / "model")


def test_matches_hf_and_uses_every_expert(tiny: Path) -> None:
    seqs = random_prompts([20, 10, 17])  # longer than the window (6)
    assert_matches_hf(tiny, seqs)
    model = load_model(str(tiny), dtype="float32").model
    assert isinstance(model, GptOssForCausalLM)
    layers = model.model.layers
    assert [layer.self_attn.attn.sliding_window for layer in layers] == [SLIDING_WINDOW, None]
    assert all(layer.self_attn.attn.sinks is not None for layer in layers)
    assert torch.equal(
        layers[0].self_attn.attn.sinks,
        load_hf_model(tiny).model.layers[0].self_attn.sinks.detach(),
    )
    usage = expert_usage(model, seqs)
    assert usage and all(len(c) == 8 for c in usage), usage


@pytest.mark.parametrize(
    "params",
    [
        None,  # GptOssConfig's own: factor 32 over 4096, truncate False
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "rope_theta": 1e4},
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 5e5,
            "beta_fast": 16.0,
            "beta_slow": 2.0,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
        },
        {
            "rope_type": "yarn",
            "factor": 2.0,
            "original_max_position_embeddings": 128,
            "attention_factor": 1.1,
        },
    ],
)
def test_yarn_matches_hf_rope_init(params: dict[str, object] | None) -> None:
    config = gpt_oss_config(**({"rope_parameters": params} if params else {"rope_parameters": None}))
    inv_freq, attention = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    rope = get_rope(config, config.head_dim)
    assert rope.rope_type == "yarn"
    torch.testing.assert_close(rope.inv_freq, inv_freq, rtol=0, atol=0)
    assert rope.attention_scaling == pytest.approx(attention, rel=1e-12)
    t = torch.arange(256, dtype=torch.float32)[:, None] * inv_freq
    expected = torch.cat([t.cos() * attention, t.sin() * attention], dim=-1)
    torch.testing.assert_close(rope.cos_sin_cache, expected)


def test_sinks_route_to_the_torch_reference() -> None:
    class Named:
        name = "cupy"

    assert kernel_takes("cpu_decode", head_size=64, logits_soft_cap=None, sinks=True)  # the Rust kernel
    assert not kernel_takes("cupy", head_size=64, logits_soft_cap=None, sinks=True)
    layer = Attention(4, 64, 2, 0, scale=0.125, sinks=True)
    cupy_like, torch_ref = Named(), TorchAttentionBackend()
    assert isinstance(route_layer(cupy_like, 64, None, sinks=True), TorchAttentionBackend)  # type: ignore[arg-type]
    assert route_layer(torch_ref, 64, None, sinks=True) is torch_ref
    assert routes_to_reference(torch.nn.Sequential(layer), cupy_like)  # type: ignore[arg-type]


def test_sinks_take_part_of_each_softmax() -> None:
    """A sink of -inf is no sink; a large sink draws the weight off every key (output toward 0)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(5, h, 8, generator=gen) for h in (4, 2, 2))
    plain = causal_attention(q, k, v, scale=0.3, sliding_window=None)
    none = causal_attention(q, k, v, scale=0.3, sliding_window=None, sinks=torch.full((4,), -torch.inf))
    torch.testing.assert_close(none, plain)
    big = causal_attention(q, k, v, scale=0.3, sliding_window=None, sinks=torch.full((4,), 30.0))
    assert big.abs().max() < 1e-6


@pytest.mark.parametrize("rows", [1, 7, 32])
def test_expert_kernel_takes_biases_and_clamped_swiglu(rows: int) -> None:
    """The Rust fused experts step with gpt-oss's biases and clamped SwiGLU equals the torch step."""
    from pagedrs.distributed.group import TPGroup
    from pagedrs.layers.moe import CpuExperts, ExpertActivation, FusedExperts, TorchExperts
    from pagedrs.layers.moe.cpu import cpu_fused_experts

    torch.manual_seed(0)
    act = ExpertActivation(swiglu_limit=0.7, swiglu_alpha=1.702)
    experts = FusedExperts(
        6, 48, 24, tp=TPGroup(), dtype=torch.float32, device="cpu", bias=True, activation=act
    )
    for p in experts.parameters():
        p.data.normal_(0.0, 0.3)
    x = torch.randn(rows, 48)
    ids = torch.stack([torch.randperm(6)[:3] for _ in range(rows)])
    weights = torch.softmax(torch.randn(rows, 3), dim=-1)
    assert experts.gate_up_bias is not None and experts.down_bias is not None
    kernel = cpu_fused_experts(
        x,
        experts.gate_up,
        experts.down,
        weights,
        ids,
        gate_up_bias=experts.gate_up_bias,
        down_bias=experts.down_bias,
        swiglu=(1.702, 0.7),
    )
    assert isinstance(experts.method, CpuExperts)  # float32 on a CPU: the Rust kernel's method
    torch.testing.assert_close(experts(x, weights, ids), kernel, rtol=0, atol=0)
    experts.use_method(TorchExperts)
    torch.testing.assert_close(kernel, experts(x, weights, ids), rtol=1e-5, atol=1e-5)


def test_mxfp4_dequantizer_matches_hand_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, size=(3, 5, 2, 16), dtype=np.uint8)
    scales = rng.integers(118, 136, size=(3, 5, 2), dtype=np.uint8)
    got = dequantize_mxfp4(torch.from_numpy(blocks), torch.from_numpy(scales))
    assert got.shape == (3, 5, 64) and got.dtype == torch.float32
    np.testing.assert_array_equal(got.numpy(), dequantize_reference(blocks, scales))
    monkeypatch.setattr("pagedrs.quantization.mxfp4._CHUNK", 7)  # blocks in uneven chunks: the same
    chunked = dequantize_mxfp4(torch.from_numpy(blocks), torch.from_numpy(scales))
    np.testing.assert_array_equal(chunked.numpy(), got.numpy())
    # low nibble first: byte 0x21 with scale 127 is (code 1, code 2) = (0.5, 1.0)
    one = torch.zeros(1, 16, dtype=torch.uint8)
    one[0, 0] = 0x21
    assert dequantize_mxfp4(one, torch.tensor([127], dtype=torch.uint8))[:2].tolist() == [0.5, 1.0]
    w = rng.normal(size=(4, 64)).astype(np.float32)
    b, s = quantize_mxfp4(w)
    err = np.abs(dequantize_mxfp4(torch.from_numpy(b), torch.from_numpy(s)).numpy() - w).max()
    assert err < 0.5 * np.abs(w).max()  # FP4 rounding, nothing worse (the layout is right)
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mxfp4(torch.from_numpy(blocks), torch.from_numpy(scales[..., :1]))
    pairs = mxfp4_checkpoint(iter([("x.w_blocks", torch.from_numpy(blocks))]))
    with pytest.raises(ValueError, match="x.w: MXFP4 weight without its x.w_scales"):
        list(pairs)


def test_mxfp4_checkpoint_matches_hf_on_dequantized_weights(tiny: Path, tmp_path: Path) -> None:
    quantized, dequantized = tmp_path / "mxfp4", tmp_path / "dequantized"
    write_mxfp4_pair(tiny, quantized, dequantized)
    loaded = load_model(str(quantized), dtype="float32")
    assert loaded.quantization == "mxfp4"
    seqs = random_prompts([12, 9], seed=2)
    hf = load_hf_model(dequantized)
    # HF reads the MXFP4 folder itself (dequantizing) into the same weights: the layout written is HF's
    hf_mxfp4 = load_hf_model(quantized, quantization_config=transformers.Mxfp4Config(dequantize=True))
    hf_experts = hf_mxfp4.model.layers[1].mlp.experts
    torch.testing.assert_close(hf_experts.gate_up_proj, hf.model.layers[1].mlp.experts.gate_up_proj)
    torch.testing.assert_close(hf_experts.down_proj, hf.model.layers[1].mlp.experts.down_proj)
    from pagedrs.layers.attention import ForwardContext
    from tests.models.helpers_hf import ATOL

    for seq in seqs:
        ids = torch.tensor(seq)
        with torch.no_grad():
            ref = hf(ids[None]).logits[0]
            got = loaded.model.compute_logits(
                loaded.model(ids, torch.arange(len(seq)), ForwardContext(None, []))
            )
        torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
    assert_matches_hf(dequantized, seqs)  # the dequantized float folder loads too (no quantization)


def test_bfloat16_checkpoint_loads(tiny: Path, tmp_path: Path) -> None:
    """A bfloat16 checkpoint loads (as float32: the float weights rounded once) and runs in bfloat16."""
    from pagedrs.layers.attention import ForwardContext
    from tests.helpers import save_tokenizer

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.bfloat16)
    hf.save_pretrained(str(tmp_path / "bf16"))
    save_tokenizer(tmp_path / "bf16")
    model = load_model(str(tmp_path / "bf16"), dtype="float32").model
    ref = load_model(str(tiny), dtype="float32").model
    for (name, a), (_, b) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        torch.testing.assert_close(a, b.to(torch.bfloat16).float(), rtol=0, atol=0, msg=name)
    half = load_model(str(tmp_path / "bf16"), dtype="bfloat16").model
    ids = torch.arange(3, 15)
    with torch.no_grad():
        logits = half.compute_logits(half(ids, torch.arange(12), ForwardContext(None, [])))
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


MAX_TOKENS = 10


def test_engine_greedy_matches_hf_under_preemption_chunking_and_prefix_hits(tiny: Path) -> None:
    hf = load_hf_model(tiny)
    hf.generation_config.eos_token_id = None
    ref = HFReference(hf)

    def check(engine: LLMEngine, prompts: list[list[int]]) -> None:
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, greedy(MAX_TOKENS))
        outs = run_all(engine)
        for i, p in enumerate(prompts):
            assert outs[str(i)].outputs[0].token_ids == ref(p, MAX_TOKENS), f"request {i}"

    engine = make_engine(
        tiny,
        dtype="float32",
        block_size=4,
        num_kv_blocks=10,
        max_num_batched_tokens=8,
        enable_prefix_caching=False,
    )
    spy = PlanSpy().attach(engine)
    check(engine, engine_prompts([18, 11, 15], seed=1))
    assert spy.chunked_prefills > 0 and spy.preemptions > 0
    assert_pool_free(engine)
    prefix = engine_prompts([17], seed=3)[0]
    prompts = [prefix + tail for tail in engine_prompts([3, 5], seed=4)]
    engine = make_engine(tiny, dtype="float32", block_size=4, enable_prefix_caching=True)
    check(engine, prompts[:1])
    check(engine, prompts[1:])
    assert engine.get_stats().prefix_cache_hits >= 16
    assert_pool_free(engine)


def test_tensor_parallel_2_equals_1(tiny: Path) -> None:
    """Heads (and their sinks) and every expert's intermediate dimension split over 2 ranks, the experts'
    down bias added once: greedy ids equal one rank's under forced preemption, chunking and prefix hits."""
    from tests.distributed.helpers_tp import check_forced, run_workload, tp_engine

    ids1, _ = run_workload(tp_engine(tiny, 1))
    engine = tp_engine(tiny, 2)
    try:
        ids2, spy = run_workload(engine)
        check_forced(engine, spy)
    finally:
        engine.shutdown()
    assert ids2 == ids1
