"""The default model (SmolLM2-135M-Instruct GGUF through pagedrs' loader) against HF transformers reading
the same GGUF file with its own dequantizer: identical greedy token ids in float32, in each scheduler
setting (few, short requests: this is the slow model of the suite)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engine.conftest import (
    HFReference,
    PlanSpy,
    assert_pool_free,
    engine_from_loaded,
    greedy,
    run_all,
)

TEXTS = [
    "Hi",
    "Write a short poem about the sea, the wind and the sailors who cross it every night.",
    "Explain, step by step, how a bicycle works, from the pedals to the wheels, for a child of ten.",
    "The history of the printing press begins long before Gutenberg. " * 10,
]
MAX_TOKENS = [24, 16, 12, 8]


@pytest.fixture(scope="module")
def loaded() -> Any:
    from pagedrs.loader import load_model, resolve_model_path

    try:
        resolve_model_path(None)
    except ValueError as e:
        pytest.skip(f"default model not installed: {e}")

    return load_model(None, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def hf_ref(loaded: Any) -> HFReference:
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = Path(loaded.model_path)
    try:  # transformers' GGUF loading (it wants `accelerate`)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
    except (ImportError, ValueError):  # without accelerate: the same dequantizer, called directly
        cfg = transformers.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
        missing, unexpected = model.load_state_dict(
            {k: torch.as_tensor(v) for k, v in tensors.items()}, strict=False
        )
        assert not unexpected and set(missing) <= {"lm_head.weight"}
        model.tie_weights()
    return HFReference(model.eval())


@pytest.fixture(scope="module")
def prompts(loaded: Any) -> list[list[int]]:
    ids = [loaded.tokenizer.encode(t) for t in TEXTS]
    assert len(ids[0]) == 1 and len(ids[-1]) > 100
    return ids


def check(final: dict, prompts: list[list[int]], hf_ref: HFReference, n: int = 1) -> None:
    for i, p in enumerate(prompts):
        expected = hf_ref(p, MAX_TOKENS[i])
        assert [c.token_ids for c in final[str(i)].outputs] == [expected] * n, f"prompt {i}"


def test_recompute_chunked_prefill_and_step_loop(
    loaded: Any, hf_ref: HFReference, prompts: list[list[int]]
) -> None:
    """A 12-block pool (preemption by recompute), a 32-token budget (chunked prefill), one request added every
    other step (the step loop)."""
    engine = engine_from_loaded(loaded, max_model_len=512, num_kv_blocks=12, max_num_batched_tokens=32)
    spy = PlanSpy().attach(engine)
    final: dict = {}
    for i in range(len(prompts)):
        engine.add_request(str(i), prompts[i], greedy(MAX_TOKENS[i]))
        for _ in range(2):
            final.update({o.request_id: o for o in engine.step() if o.finished})
    final.update(run_all(engine))
    check(final, prompts, hf_ref)
    assert final["1"].outputs[0].text == loaded.tokenizer.decode(
        final["1"].outputs[0].token_ids, skip_special_tokens=True
    )
    assert spy.preemptions > 0 and spy.swap_outs == 0
    assert spy.chunked_prefills >= 3
    assert any(1 in p.num_scheduled and max(p.num_scheduled) > 1 for p in spy.plans)
    assert_pool_free(engine)


def test_swap_and_n2(loaded: Any, hf_ref: HFReference, prompts: list[list[int]]) -> None:
    """A 12-block pool with a CPU swap pool (preemption by swap), every request with n=2."""
    engine = engine_from_loaded(loaded, max_model_len=512, num_kv_blocks=12, swap_space=0.05)
    spy = PlanSpy().attach(engine)
    for i in range(len(prompts)):
        engine.add_request(str(i), prompts[i], greedy(MAX_TOKENS[i], n=2))
    check(run_all(engine), prompts, hf_ref, n=2)
    assert spy.swap_outs > 0 and spy.swap_ins > 0
    assert any(len(p.logits_indices) > len(set(p.logits_indices)) for p in spy.plans)
    assert spy.copies > 0
    assert_pool_free(engine)


def test_default_model_prefix_cache_and_chat(loaded: Any, hf_ref: HFReference) -> None:
    engine = engine_from_loaded(loaded, max_model_len=512, num_kv_blocks=64)
    system = {"role": "system", "content": "You are a concise assistant. " * 6}
    convs = [[system, {"role": "user", "content": q}] for q in ("What is 2+2?", "Name a color.", "Say hi.")]
    ids = [engine.apply_chat_template(c) for c in convs]
    engine.add_request("0", ids[0], greedy(8))
    outs = run_all(engine)
    for i in (1, 2):
        engine.add_request(str(i), ids[i], greedy(8))
    outs.update(run_all(engine))
    for i in (1, 2):
        assert outs[str(i)].num_cached_tokens >= 32  # the system prompt's full blocks
        assert outs[str(i)].outputs[0].token_ids == hf_ref(ids[i], 8)
    assert engine.get_stats().prefix_cache_hits > 0
    assert_pool_free(engine)
    # vLLM's reset_prefix_cache: the same prompt again computes every token
    assert engine.reset_prefix_cache()
    engine.add_request("3", ids[1], greedy(8))
    again = run_all(engine)["3"]
    assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == outs["1"].outputs[0].token_ids
