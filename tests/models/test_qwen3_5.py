"""Qwen3.5 text (Gated DeltaNet linear attention interleaved with gated full attention) against HF transformers,
float32: logits without a cache, the delta rule's chunked and recurrent forms, and greedy ids through the engine
with the recurrent state in a KV-cache group (chunked prefill, preemption, `n > 1` forks)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from pagedrs.layers.attention import ForwardContext
from pagedrs.layers.delta_rule import (
    CHUNK,
    causal_conv1d,
    causal_conv1d_update,
    chunk_gated_delta_rule,
    chunk_gated_delta_rule_states,
    recurrent_gated_delta_rule,
)
from pagedrs.loader import load_model
from pagedrs.models.qwen3_5 import Qwen3_5ForCausalLM
from pagedrs.models.qwen3_5_moe import Qwen3_5MoeForCausalLM
from pagedrs.models.qwen3_vl import Qwen3_5ForConditionalGeneration
from pagedrs.sampling_params import SamplingParams
from tests.engine.conftest import HFReference, greedy, make_engine, run_all
from tests.helpers import load_hf_model, make_tiny_model
from tests.models.helpers_families import hf_reference
from tests.models.helpers_hf import ATOL, random_prompts
from tests.models.helpers_qwen3_5 import (
    assert_hybrid_greedy_matches_hf,
    assert_second_turn_resumes_from_snapshot,
    qwen3_5_config,
    qwen3_5_moe_config,
)


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("qwen3_5") / "m", qwen3_5_config())


def test_qwen3_5_logits_match_hf(qwen3_5: Path) -> None:
    hf = load_hf_model(qwen3_5)
    model = load_model(str(qwen3_5), dtype="float32").model
    assert isinstance(model, Qwen3_5ForCausalLM)
    assert model.num_layers == 1  # paged KV for the one full-attention layer only
    # per slot: 3 linear layers x (conv 64 channels x 3 + state 4 heads x 8 x 8) float32
    assert model.recurrent_shape.bytes_per_slot == 3 * (64 * 3 + 4 * 8 * 8) * 4 == 5376
    for seq in random_prompts([20, 70]):  # 70: more than one chunk of the delta rule
        ids = torch.tensor(seq)
        with torch.no_grad():
            ref = hf(ids[None]).logits[0].float()
            got = model.compute_logits(model(ids, torch.arange(len(seq)), ForwardContext(None, [])))
        torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


def _rule_inputs(n: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(1, n, 2, 8, generator=gen) for _ in range(2))
    v = torch.randn(1, n, 4, 8, generator=gen)
    g = -torch.rand(1, n, 4, generator=gen)
    beta = torch.rand(1, n, 4, generator=gen)
    return q, k, v, g, beta


def test_delta_rule_chunked_equals_recurrent_and_carries_state() -> None:
    n = CHUNK + 13
    q, k, v, g, beta = _rule_inputs(n)
    init = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    out_r, s_r = recurrent_gated_delta_rule(q, k, v, g, beta, init)
    out_c, s_c = chunk_gated_delta_rule(q, k, v, g, beta, init)
    torch.testing.assert_close(out_c, out_r, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(s_c, s_r, atol=1e-4, rtol=1e-4)
    # Two chunks of a prefill, the state carried between them, equal one pass.
    cut = 30
    a_out, a_s = chunk_gated_delta_rule(*(x[:, :cut] for x in (q, k, v, g, beta)), init)
    b_out, b_s = chunk_gated_delta_rule(*(x[:, cut:] for x in (q, k, v, g, beta)), a_s)
    torch.testing.assert_close(torch.cat([a_out, b_out], 1), out_c, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(b_s, s_c, atol=1e-4, rtol=1e-4)
    # The states taken inside the chunks (at block boundaries) equal the recurrent form stopped there.
    capture = [0, 15, CHUNK - 1, CHUNK + 3]
    _, _, states = chunk_gated_delta_rule_states(q, k, v, g, beta, init, capture)
    for t, got in zip(capture, states, strict=True):
        want = recurrent_gated_delta_rule(*(x[:, : t + 1] for x in (q, k, v, g, beta)), init)[1]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # The one-token update runs a batch of sequences at once, each from its own state, as each alone.
    qb, kb, vb, gb, bb = (torch.cat([x[:, :1], x[:, 5:6], x[:, 9:10]]) for x in (q, k, v, g, beta))
    inits = torch.randn(3, 4, 8, 8, generator=torch.Generator().manual_seed(2))
    out_b, s_b = recurrent_gated_delta_rule(qb, kb, vb, gb, bb, inits)
    for r in range(3):
        one = recurrent_gated_delta_rule(*(x[r : r + 1] for x in (qb, kb, vb, gb, bb)), inits[r : r + 1])
        torch.testing.assert_close(out_b[r : r + 1], one[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(s_b[r : r + 1], one[1], atol=1e-5, rtol=1e-5)


def test_causal_conv1d_state_carries_across_calls() -> None:
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(9, 6, generator=gen), torch.randn(6, 4, generator=gen)
    whole = causal_conv1d(x, w, None)
    state = torch.zeros(6, 3)
    parts = [causal_conv1d(x[:2], w, state), causal_conv1d(x[2:3], w, state), causal_conv1d(x[3:], w, state)]
    torch.testing.assert_close(torch.cat(parts), whole)
    torch.testing.assert_close(state, x[-3:].t())
    # The one-token form over a batch of windows: row r steps x[r + 3] after its window x[r : r + 3].
    windows = torch.stack([x[r : r + 3].t() for r in range(6)])
    torch.testing.assert_close(causal_conv1d_update(x[3:], w, windows), whole[3:])
    torch.testing.assert_close(windows, torch.stack([x[r + 1 : r + 4].t() for r in range(6)]))


def test_qwen3_5_engine_greedy_matches_hf(qwen3_5: Path) -> None:
    assert_hybrid_greedy_matches_hf(qwen3_5, hf_reference(qwen3_5))


def test_qwen3_5_second_turn_resumes_from_the_last_shared_block_boundary(qwen3_5: Path) -> None:
    assert_second_turn_resumes_from_snapshot(qwen3_5, hf_reference(qwen3_5))


def test_qwen3_5_fork_copies_state_and_children_are_independent(qwen3_5: Path) -> None:
    """`n = 3` sampled children fork from the parent's state after its last prompt chunk: each child's
    logprob of every token it sampled equals HF's log-softmax over the prompt and that child's own tokens
    (a child reading the parent's or a sibling's state would not)."""
    engine = make_engine(qwen3_5, dtype="float32", block_size=4, max_num_batched_tokens=8)
    prompt = random_prompts([13], seed=5)[0]
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True, logprobs=0)
    engine.add_request("r", prompt, params)
    outs = run_all(engine)["r"].outputs
    assert len({tuple(o.token_ids) for o in outs}) > 1, "the children did not diverge"
    hf = load_hf_model(qwen3_5)
    for o in outs:
        ids = torch.tensor([prompt + list(o.token_ids)])
        with torch.no_grad():
            logp = torch.log_softmax(hf(ids).logits[0].float(), -1)
        want = [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(o.token_ids)]
        got = [lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids, strict=True)]
        assert got == pytest.approx(want, abs=1e-3), o.token_ids


@pytest.fixture(scope="module")
def qwen3_5_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("qwen3_5_moe") / "m", qwen3_5_moe_config())


def test_qwen3_5_moe_logits_and_engine_greedy_match_hf(qwen3_5_moe: Path) -> None:
    hf = load_hf_model(qwen3_5_moe)
    model = load_model(str(qwen3_5_moe), dtype="float32").model
    assert isinstance(model, Qwen3_5MoeForCausalLM)
    ids = torch.tensor(random_prompts([23])[0])
    with torch.no_grad():
        ref = hf(ids[None]).logits[0].float()
        got = model.compute_logits(model(ids, torch.arange(len(ids)), ForwardContext(None, [])))
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
    ref = hf_reference(qwen3_5_moe)
    assert_hybrid_greedy_matches_hf(qwen3_5_moe, ref)
    assert_second_turn_resumes_from_snapshot(qwen3_5_moe, ref)


def test_qwen3_5_conditional_generation_checkpoint_runs_text_prompts(tmp_path: Path) -> None:
    """A Qwen3_5ForConditionalGeneration folder (vision tower, `model.language_model.` weights): the engine
    builds the text model from `text_config` with the tower beside it and gives HF's greedy ids on text
    prompts (images: tests/models/test_qwen_vl_qwen3_5.py)."""
    config = transformers.Qwen3_5Config(
        text_config=qwen3_5_config().to_dict(),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64),
    )
    torch.manual_seed(0)
    hf = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(0.0, 0.2 if p.dim() > 1 else 0.1)
            if "norm" in name and name.endswith("weight"):
                p.add_(1.0)
    hf.save_pretrained(str(tmp_path))
    loaded = load_model(str(tmp_path), dtype="float32", with_tokenizer=False)
    assert isinstance(loaded.model, Qwen3_5ForConditionalGeneration)
    assert isinstance(loaded.model, Qwen3_5ForCausalLM)
    assert loaded.hf_config.architectures == ["Qwen3_5ForConditionalGeneration"]
    ref = HFReference(hf)
    engine = make_engine(
        tmp_path, dtype="float32", block_size=4, max_num_batched_tokens=8, skip_tokenizer_init=True
    )
    prompts = random_prompts([11, 19], seed=4)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, greedy(8))
    outs = run_all(engine)
    for i, prompt in enumerate(prompts):
        assert outs[str(i)].outputs[0].token_ids == ref(prompt, 8)


def test_qwen3_5_snapshot_is_not_served_once_its_kv_blocks_are_evicted(qwen3_5: Path) -> None:
    """After an unrelated request evicted most of the first turn's KV blocks from a 14-block pool (tail
    first), the second turn's hit shrinks to the KV blocks still cached (a snapshot is served only where its
    KV blocks are too), and the second turn gives HF's ids."""
    ref = hf_reference(qwen3_5)
    engine = make_engine(qwen3_5, dtype="float32", block_size=4, num_kv_blocks=14, max_num_batched_tokens=8)
    prompt = random_prompts([13], seed=6)[0]
    engine.add_request("t1", prompt, greedy(10))
    out = list(run_all(engine)["t1"].outputs[0].token_ids)
    other = random_prompts([40], seed=9)[0]
    engine.add_request("other", other, greedy(10))
    assert list(run_all(engine)["other"].outputs[0].token_ids) == ref(other, 10)
    second = prompt + out + [5, 6, 7, 8, 9]
    engine.add_request("t2", second, greedy(6))
    turn = run_all(engine)["t2"]
    assert turn.num_cached_tokens % 4 == 0 and turn.num_cached_tokens < 20, turn.num_cached_tokens
    assert list(turn.outputs[0].token_ids) == ref(second, 6)
