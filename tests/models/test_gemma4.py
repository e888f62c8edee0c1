"""Gemma 4 text against HF transformers, float32, with prompts longer than the sliding window: global layers
with their own head size and KV heads (k is v), proportional RoPE, shared-KV layers, per-layer input
embeddings, double-wide MLPs and per-layer scalars; logits plain and paged, greedy ids through the engine
with chunked prefill, prefix hits and preemption, and the KV pool holding no byte for shared-KV layers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding

from pagedrs.layers.attention import ForwardContext
from pagedrs.loader import load_model
from pagedrs.models.gemma4 import Gemma4ForCausalLM, Gemma4ForConditionalGeneration, kv_sharing
from pagedrs.runner.kv_cache import KVCachePool, block_bytes, model_block_bytes
from pagedrs.runner.kv_groups import max_live_blocks
from tests.engine.conftest import PlanSpy, assert_pool_free, greedy, make_engine, run_all
from tests.models.helpers_families import WINDOW, assert_engine_greedy_matches_hf, hf_reference
from tests.models.helpers_gemma4 import (
    gemma4_config,
    gemma4_moe_config,
    gemma4_multimodal_config,
    make_gemma4_model,
)
from tests.models.helpers_hf import assert_load_errors, assert_matches_hf, random_prompts


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_gemma4_model(tmp_path_factory.mktemp("gemma4") / "m", gemma4_config())


@pytest.fixture(scope="module")
def gemma4_mm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_gemma4_model(tmp_path_factory.mktemp("gemma4mm") / "m", gemma4_multimodal_config())


def test_gemma4_logits_match_hf(gemma4: Path) -> None:
    prompts = random_prompts([20, 10, 17])
    assert min(len(p) for p in prompts) > WINDOW
    assert_matches_hf(gemma4, prompts, chunk=5)


def test_gemma4_engine_greedy_matches_hf(gemma4: Path) -> None:
    assert_engine_greedy_matches_hf(gemma4, hf_reference(gemma4))


def test_gemma4_conditional_generation_text_matches_hf(gemma4_mm: Path) -> None:
    """The text part of Gemma4ForConditionalGeneration (`text_config`, tensors under
    `model.language_model.`): logits and greedy ids equal HF's multimodal class on text; the towers' tensors
    are not read."""
    assert json.loads((gemma4_mm / "config.json").read_text())["architectures"] == [
        "Gemma4ForConditionalGeneration"
    ]
    assert_matches_hf(gemma4_mm, random_prompts([20, 11]), chunk=5)
    assert_engine_greedy_matches_hf(gemma4_mm, hf_reference(gemma4_mm))
    file = gemma4_mm / "model.safetensors"
    state = load_file(str(file))
    state["model.vision_tower.encoder.layers.0.mlp.up_proj.linear.weight"] = torch.ones(2, 2)
    state["model.embed_audio.embedding_projection.weight"] = torch.ones(2, 2)
    save_file(state, str(file), metadata={"format": "pt"})
    model = load_model(str(gemma4_mm), dtype="float32").model
    assert isinstance(model, Gemma4ForConditionalGeneration) and model.final_logit_softcapping == 8.0


@pytest.fixture(scope="module")
def gemma4_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_gemma4_model(tmp_path_factory.mktemp("gemma4moe") / "m", gemma4_moe_config())


def test_gemma4_moe_matches_hf(gemma4_moe: Path) -> None:
    """The MoE block beside the dense MLP, with no per-layer input embeddings: logits (every expert routed
    to) and greedy ids equal HF's."""
    prompts = random_prompts([20, 10, 17])
    model = load_model(str(gemma4_moe), dtype="float32").model
    routed: set[int] = set()
    hooks = [
        layer.router.register_forward_hook(lambda _m, _i, out: routed.update(out[1].flatten().tolist()))
        for layer in model.model.layers
    ]
    for p in prompts:
        model(torch.tensor(p), torch.arange(len(p)), ForwardContext(None, []))
    for h in hooks:
        h.remove()
    assert routed == {0, 1, 2, 3}
    assert_matches_hf(gemma4_moe, prompts, chunk=5)
    assert_engine_greedy_matches_hf(gemma4_moe, hf_reference(gemma4_moe))


def test_gemma4_window_layers_keep_only_live_blocks_past_the_window(gemma4: Path) -> None:
    """The sliding layers, a shared-KV one among them, form one window group whose pool holds at most one
    sequence's live blocks while a request generates far past the window; its ids are HF's."""
    engine = make_engine(gemma4, dtype="float32", block_size=4, num_kv_blocks=40, max_num_batched_tokens=8)
    runner = engine.engine_core.executor.runner
    assert [(g.window, g.layers) for g in runner.kv_groups] == [(WINDOW, (0, 1, 3, 4))]
    assert [int(kv.shape[3]) for kv in runner.kv_pool.kv_caches] == [2, 2, 1, 2, 0, 0]
    prompt = random_prompts([30], seed=7)[0]
    engine.add_request("long", prompt, greedy(40))
    used = []
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o if o.finished else out
        ((_, _, n, free),) = engine.scheduler.kv_group_pools()
        used.append(n - free)
    assert out is not None and list(out.outputs[0].token_ids) == hf_reference(gemma4)(prompt, 40)
    assert max(used) <= max_live_blocks(WINDOW, 4, 8) < (30 + 40) // 4, used


def test_gemma4_swap_preemption_matches_hf(gemma4: Path) -> None:
    """Preemption by swap (swap space given: every layer keeps its blocks in one pool): the swap pool has
    each layer's shape, none for shared-KV layers, and the ids are HF's."""
    engine = make_engine(
        gemma4, dtype="float32", block_size=4, num_kv_blocks=14, max_num_batched_tokens=8, swap_space=0.002
    )
    pool = engine.engine_core.executor.runner.kv_pool
    assert [int(kv.shape[3]) for kv in pool.swap_caches] == [2, 2, 1, 2, 0, 0]
    spy = PlanSpy().attach(engine)
    prompts = random_prompts([19, 21, 12], seed=4)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, greedy(10))
    outs = run_all(engine)
    ref = hf_reference(gemma4)
    for i, p in enumerate(prompts):
        assert outs[str(i)].outputs[0].token_ids == ref(p, 10), i
    assert spy.swap_outs > 0 and spy.swap_ins > 0
    assert_pool_free(engine)


def test_gemma4_layers() -> None:
    """Head sizes, KV heads, windows, shared KV and RoPE per layer type, as HF's config resolves them."""
    config = gemma4_config()
    model = Gemma4ForCausalLM(config, dtype=torch.float32, device="cpu")
    attns = [layer.self_attn for layer in model.model.layers]
    assert kv_sharing(config) == [None, None, None, None, 3, 2]
    assert config.kv_sharing_modes == [None, None, "store", "store", "reuse", "reuse"]
    assert [a.attn.kv_layer for a in attns] == [0, 1, 2, 3, 3, 2]
    assert [a.stores_kv for a in attns] == [False, False, True, True, False, False]
    assert [a.attn.sliding_window for a in attns] == [WINDOW, WINDOW, None, WINDOW, WINDOW, None]
    assert model.kv_cache_shapes == [(2, 16), (2, 16), (1, 32), (2, 16), (0, 16), (0, 32)]
    assert attns[2].v_proj is None and attns[0].v_proj is not None and attns[4].k_proj is None
    assert all(a.attn.scale == 1.0 for a in attns)
    widths = [layer.mlp.down_proj.input_size for layer in model.model.layers]
    assert widths == [128, 128, 128, 128, 256, 256]
    local, full = attns[0].rotary_emb, attns[2].rotary_emb
    assert local.rotary_dim == 16 and full.rotary_dim == 32
    # proportional: 4 of the 16 frequency pairs of the 32-wide head rotate, over the head's exponents
    expected = torch.cat([1.0 / 1e6 ** (torch.arange(0, 8, 2).float() / 32), torch.zeros(12)])
    torch.testing.assert_close(full.inv_freq, expected)
    torch.testing.assert_close(local.inv_freq, 1.0 / 1e4 ** (torch.arange(0, 16, 2).float() / 16))
    hf_rope = Gemma4TextRotaryEmbedding(config)
    torch.testing.assert_close(full.inv_freq, hf_rope.full_attention_inv_freq)
    torch.testing.assert_close(local.inv_freq, hf_rope.sliding_attention_inv_freq)


def test_gemma4_kv_sharing_needs_an_owner_of_each_type() -> None:
    config = gemma4_config(num_kv_shared_layers=2)
    config.layer_types = [
        "sliding_attention",
        "sliding_attention",
        "sliding_attention",
        "sliding_attention",
        "full_attention",
        "full_attention",
    ]
    with pytest.raises(ValueError, match="layer 4 .full_attention. shares KV but no earlier layer"):
        kv_sharing(config)


def test_gemma4_pool_holds_no_bytes_for_shared_kv_layers() -> None:
    model = Gemma4ForCausalLM(gemma4_config(), dtype=torch.float32, device="cpu")
    pool = KVCachePool.for_model(
        model, block_size=4, num_blocks=3, dtype=torch.float32, device=torch.device("cpu")
    )
    shapes = [tuple(kv.shape) for kv in pool.kv_caches]
    assert shapes[2] == (2, 3, 4, 1, 32) and shapes[0] == (2, 3, 4, 2, 16)
    assert [kv.numel() for kv in pool.kv_caches[4:]] == [0, 0]
    owners = 3 * block_bytes(1, 4, 2, 16, torch.float32) + block_bytes(1, 4, 1, 32, torch.float32)
    assert pool.bytes_per_block == owners == model_block_bytes(model, 4, torch.float32)


def test_gemma4_load_errors(tmp_path: Path) -> None:
    folder = make_gemma4_model(tmp_path / "g4", gemma4_config())
    assert_load_errors(folder, "model.layers.3.layer_scalar", "Gemma4ForCausalLM")
