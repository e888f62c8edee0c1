"""Mixtral, Qwen2-MoE (shared expert, sigmoid gate) and Qwen3-MoE (q/k norm, norm_topk_prob, sparse step,
mlp_only_layers) against HF transformers, float32: logits plain and paged, every expert used; per-expert
and stacked (transformers >= 5) checkpoints; greedy ids through the engine with preemption, chunked
prefill and prefix caching forced on and checked to have fired."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedrs.layers.moe import SparseMoeBlock
from pagedrs.loader import load_model
from pagedrs.models.registry import get_model_class
from tests.engine.conftest import HFReference, PlanSpy, assert_pool_free, greedy, make_engine, run_all
from tests.engine.conftest import random_prompts as engine_prompts
from tests.helpers import load_hf_model, make_tiny_model
from tests.models.helpers_hf import assert_load_errors, assert_matches_hf, random_prompts
from tests.models.helpers_moe import MOE_CONFIGS, expert_usage, write_stacked_checkpoint


@pytest.mark.parametrize("name", list(MOE_CONFIGS))
def test_moe_matches_hf_and_uses_every_expert(tmp_path: Path, name: str) -> None:
    config = MOE_CONFIGS[name]()
    folder = make_tiny_model(tmp_path / name, config)
    seqs = random_prompts([20, 10, 17])
    assert_matches_hf(folder, seqs)
    model = load_model(str(folder), dtype="float32").model
    assert type(model) is get_model_class(config)
    usage = expert_usage(model, seqs)
    num_experts = getattr(config, "num_local_experts", None) or config.num_experts
    assert usage and all(len(c) == num_experts for c in usage), usage


def test_sparse_layers_and_shared_expert_follow_the_config(tmp_path: Path) -> None:
    q3 = load_model(str(make_tiny_model(tmp_path / "q3", MOE_CONFIGS["qwen3_moe"]())), dtype="float32").model
    kinds = [isinstance(layer.mlp, SparseMoeBlock) for layer in q3.model.layers]
    assert kinds == [True, False, True]  # mlp_only_layers=[1]
    assert q3.model.layers[0].self_attn.q_norm is not None
    step = MOE_CONFIGS["qwen3_moe-sparse-step"]()
    q3s = load_model(str(make_tiny_model(tmp_path / "q3s", step)), dtype="float32").model
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in q3s.model.layers] == [False, True, False]
    q2 = load_model(str(make_tiny_model(tmp_path / "q2", MOE_CONFIGS["qwen2_moe"]())), dtype="float32").model
    block = q2.model.layers[0].mlp
    assert block.shared_expert is not None and block.shared_expert_gate is not None
    assert q2.model.layers[0].self_attn.qkv_proj.bias is not None
    assert q2.model.layers[0].self_attn.o_proj.bias is None


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_stacked_checkpoint_loads_the_same(tmp_path: Path, name: str) -> None:
    folder = make_tiny_model(tmp_path / name, MOE_CONFIGS[name]())
    per_expert = load_model(str(folder), dtype="float32").model
    write_stacked_checkpoint(folder)
    stacked = load_model(str(folder), dtype="float32").model
    for (n, a), (_, b) in zip(per_expert.named_parameters(), stacked.named_parameters(), strict=True):
        assert torch.equal(a, b), n


def test_moe_load_errors(tmp_path: Path) -> None:
    qwen = make_tiny_model(tmp_path / "qwen2_moe", MOE_CONFIGS["qwen2_moe"]())
    assert_load_errors(qwen, "model.layers.1.mlp.shared_expert_gate.weight", "Qwen2MoeForCausalLM")
    folder = make_tiny_model(tmp_path / "mixtral", MOE_CONFIGS["mixtral"]())
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    state = load_file(str(path))
    del state["model.layers.0.block_sparse_moe.experts.5.w3.weight"]
    save_file(state, str(path))
    with pytest.raises(
        ValueError, match=r"missing.*model.layers.0.mlp.experts.gate_up.weight \(shard \(5, 1\)\)"
    ):
        load_model(str(folder), dtype="float32")


BLOCK_SIZE = 4
MAX_TOKENS = 10


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe", "qwen3_moe"])
def engine_model(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, HFReference]:
    folder = make_tiny_model(tmp_path_factory.mktemp(request.param), MOE_CONFIGS[request.param]())
    hf = load_hf_model(folder)
    hf.generation_config.eos_token_id = None
    return folder, HFReference(hf)


def _check(engine, prompts: list[list[int]], ref: HFReference) -> None:
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, greedy(MAX_TOKENS))
    outs = run_all(engine)
    for i, p in enumerate(prompts):
        assert outs[str(i)].outputs[0].token_ids == ref(p, MAX_TOKENS), f"request {i}"


def test_engine_greedy_matches_hf_under_preemption_chunking_and_prefix_hits(
    engine_model: tuple[Path, HFReference],
) -> None:
    folder, ref = engine_model
    # a 10-block pool and an 8-token budget: long prompts are chunked and requests preempted
    engine = make_engine(
        folder,
        dtype="float32",
        block_size=BLOCK_SIZE,
        num_kv_blocks=10,
        max_num_batched_tokens=8,
        enable_prefix_caching=False,
    )
    spy = PlanSpy().attach(engine)
    _check(engine, engine_prompts([18, 11, 15], seed=1), ref)
    assert spy.chunked_prefills > 0 and spy.preemptions > 0
    assert_pool_free(engine)
    prefix = engine_prompts([17], seed=3)[0]
    prompts = [prefix + tail for tail in engine_prompts([3, 5], seed=4)]
    engine = make_engine(folder, dtype="float32", block_size=BLOCK_SIZE, enable_prefix_caching=True)
    _check(engine, prompts[:1], ref)
    _check(engine, prompts[1:], ref)
    assert engine.get_stats().prefix_cache_hits >= 16
    assert_pool_free(engine)


@pytest.mark.parametrize("name", ["qwen2_moe", "mixtral"])
def test_tensor_parallel_2_equals_1(tmp_path: Path, name: str) -> None:
    """Every expert's intermediate dimension (and the shared expert's) split over 2 ranks, one all-reduce
    per MoE layer: greedy ids equal one rank's under forced preemption, chunking and prefix hits."""
    from tests.distributed.helpers_tp import check_forced, run_workload, tp_engine

    folder = make_tiny_model(tmp_path / name, MOE_CONFIGS[name]())
    ids1, _ = run_workload(tp_engine(folder, 1))
    engine = tp_engine(folder, 2)
    try:
        ids2, spy = run_workload(engine)
        check_forced(engine, spy)
    finally:
        engine.shutdown()
    assert ids2 == ids1


def test_bfloat16_forward(tmp_path: Path) -> None:
    """A half-precision MoE model runs (the torch experts step: the kernels take float32 only)."""
    from pagedrs.layers.attention import ForwardContext

    folder = make_tiny_model(tmp_path / "q2", MOE_CONFIGS["qwen2_moe"]())
    model = load_model(str(folder), dtype="bfloat16").model
    assert model.model.layers[0].mlp.experts.gate_up.weight.dtype == torch.bfloat16
    ids = torch.arange(3, 12)
    with torch.no_grad():
        logits = model.compute_logits(model(ids, torch.arange(9), ForwardContext(None, [])))
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
