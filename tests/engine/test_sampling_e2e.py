"""Sampling through the whole engine: seeded requests, top_k=1, stop strings and stop tokens, logprobs
against HF's log-softmax, prompt logprobs."""

from __future__ import annotations

from pathlib import Path

import torch

from pagedrs import SamplingParams
from tests.engine.conftest import HFReference, assert_pool_free, greedy, make_engine, random_prompts, run_all
from tests.helpers import make_tokenizer

PROMPTS = random_prompts([5, 23, 64, 130], seed=11)


def test_seeded_request_same_alone_and_in_a_crowd(tiny_models: dict[str, Path]) -> None:
    engine = make_engine(tiny_models["llama"], num_kv_blocks=256)
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=42, max_tokens=24, ignore_eos=True)
    engine.add_request("alone", PROMPTS[1], params)
    alone = run_all(engine)["alone"].outputs[0].token_ids
    # now among unseeded random requests, a greedy one and another seed, added in a different order
    engine.add_request("a", PROMPTS[0], SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True))
    engine.add_request("b", PROMPTS[2], greedy(10))
    engine.add_request("crowd", PROMPTS[1], params)
    engine.add_request(
        "c", PROMPTS[3], SamplingParams(temperature=0.7, seed=7, max_tokens=20, ignore_eos=True)
    )
    engine.step()
    engine.add_request("d", PROMPTS[1], SamplingParams(temperature=1.3, max_tokens=12, ignore_eos=True))
    outs = run_all(engine)
    assert outs["crowd"].outputs[0].token_ids == alone
    assert len(set(alone)) > 5  # it really sampled
    assert_pool_free(engine)


def test_n_samples_with_seed_differ_but_repeat(tiny_models: dict[str, Path]) -> None:
    engine = make_engine(tiny_models["qwen2"], num_kv_blocks=256)
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=16, ignore_eos=True)
    engine.add_request("x", PROMPTS[1], params)
    first = [c.token_ids for c in run_all(engine)["x"].outputs]
    engine.add_request("y", PROMPTS[1], params)
    second = [c.token_ids for c in run_all(engine)["y"].outputs]
    assert first == second and first[0] != first[1]
    assert_pool_free(engine)


def test_top_k_1_equals_greedy(tiny_models: dict[str, Path], hf_refs: dict[str, HFReference]) -> None:
    engine = make_engine(tiny_models["mistral"], num_kv_blocks=256)
    for i, p in enumerate(PROMPTS):
        engine.add_request(
            str(i), p, SamplingParams(temperature=0.9, top_k=1, max_tokens=20, ignore_eos=True)
        )
    outs = run_all(engine)
    for i, p in enumerate(PROMPTS):
        assert outs[str(i)].outputs[0].token_ids == hf_refs["mistral"](p, 20)
    assert_pool_free(engine)


_TOK = make_tokenizer()
# Restricts outputs to a-z: readable text from a random model.
LETTERS = {_TOK.encode(c)[0]: 100.0 for c in "abcdefghijklmnopqrstuvwxyz"}


def test_stop_strings_cut_text_and_set_reasons(tiny_models: dict[str, Path]) -> None:
    engine = make_engine(tiny_models["llama"], num_kv_blocks=256)
    tok = engine.get_tokenizer()
    prompt = tok.encode("The quick brown fox")
    engine.add_request("full", prompt, greedy(64, logit_bias=LETTERS))
    full = run_all(engine)["full"].outputs[0]
    assert full.text == tok.decode(full.token_ids) and len(full.text) == 64 and full.text.isalpha()
    stop = full.text[20:23]
    cut = full.text.index(stop)
    engine.add_request("cut", prompt, greedy(64, logit_bias=LETTERS, stop=["never!", stop]))
    engine.add_request(
        "keep", prompt, greedy(64, logit_bias=LETTERS, stop=stop, include_stop_str_in_output=True)
    )
    outs = run_all(engine)
    out = outs["cut"].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (full.text[:cut], "stop", stop)
    assert out.token_ids == full.token_ids[: cut + len(stop)]  # generation stopped on the stop string's end
    keep = outs["keep"].outputs[0]
    assert keep.text == full.text[: cut + len(stop)] and keep.stop_reason == stop
    # a stop token id ends the output with that id and is not in the text
    stop_id = full.token_ids[30]
    first = full.token_ids.index(stop_id)
    engine.add_request("tok", prompt, greedy(64, logit_bias=LETTERS, stop_token_ids=[stop_id]))
    out = run_all(engine)["tok"].outputs[0]
    assert out.token_ids == full.token_ids[: first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)
    assert out.text == full.text[:first]
    assert_pool_free(engine)


def test_streamed_text_holds_back_a_possible_stop_string(tiny_models: dict[str, Path]) -> None:
    engine = make_engine(tiny_models["llama"], num_kv_blocks=256)
    engine.add_request("s", PROMPTS[0], greedy(20, logit_bias=LETTERS, stop=["zzzzzz", "0123"]))
    seen = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.append(out)
    assert [o.finished for o in seen] == [False] * 19 + [True]
    final = seen[-1].outputs[0].text
    assert len(final) == 20 and seen[-1].outputs[0].finish_reason == "length"
    for i, out in enumerate(seen[:-1]):
        # i + 1 characters decoded, the last 5 held back (the longest stop string could be starting)
        assert out.outputs[0].text == final[: max(0, i + 1 - 5)]
    assert_pool_free(engine)


def test_greedy_logprobs_match_hf_log_softmax(
    tiny_models: dict[str, Path], hf_refs: dict[str, HFReference]
) -> None:
    engine = make_engine(tiny_models["qwen2"], num_kv_blocks=256, max_num_batched_tokens=48)
    prompt = PROMPTS[2]
    engine.add_request("lp", prompt, greedy(12, logprobs=3, prompt_logprobs=2))
    out = run_all(engine)["lp"]
    comp = out.outputs[0]
    hf = hf_refs["qwen2"].model
    with torch.inference_mode():
        ref = hf(torch.tensor([prompt + comp.token_ids])).logits[0].float().log_softmax(-1)
    n = len(prompt)
    assert comp.logprobs is not None and len(comp.logprobs) == 12
    total = 0.0
    for j, (tid, entry) in enumerate(zip(comp.token_ids, comp.logprobs, strict=True)):
        row = ref[n - 1 + j]
        assert abs(entry[tid].logprob - float(row[tid])) < 1e-4
        assert entry[tid].rank == 1  # greedy
        top = row.topk(3)
        for lp, t in zip(top.values.tolist(), top.indices.tolist(), strict=True):
            assert abs(entry[t].logprob - lp) < 1e-4
        total += float(row[tid])
    assert abs(comp.cumulative_logprob - total) < 1e-3
    # prompt logprobs (prompt chunked by the 48-token budget): None first, then token p given p's prefix
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == n
    for p in range(1, n):
        entry = out.prompt_logprobs[p]
        assert entry is not None and abs(entry[prompt[p]].logprob - float(ref[p - 1, prompt[p]])) < 1e-4
        assert entry[prompt[p]].rank == int((ref[p - 1] >= ref[p - 1, prompt[p]]).sum())
        assert len(entry) in (2, 3)
    assert_pool_free(engine)


def test_cumulative_logprob_without_logprobs(
    tiny_models: dict[str, Path], hf_refs: dict[str, HFReference]
) -> None:
    """cumulative_logprob is filled when no logprobs are asked for (vLLM 0.4's CompletionOutput):
    greedy (the argmax fast path) equals HF's log_softmax summed over the chosen tokens; a seeded sample
    equals the same request with logprobs=0 (the sum of its sampled tokens' logprobs)."""
    engine = make_engine(tiny_models["qwen2"], num_kv_blocks=256, max_num_batched_tokens=48)
    prompt = PROMPTS[1]
    engine.add_request("g", prompt, greedy(10))
    sample = {"temperature": 0.9, "top_p": 0.9, "seed": 7, "max_tokens": 10, "ignore_eos": True}
    engine.add_request("s", prompt, SamplingParams(**sample))
    engine.add_request("s_lp", prompt, SamplingParams(logprobs=0, **sample))
    outs = run_all(engine)
    comp = outs["g"].outputs[0]
    assert comp.logprobs is None and comp.cumulative_logprob is not None
    with torch.inference_mode():
        ref = (
            hf_refs["qwen2"].model(torch.tensor([prompt + comp.token_ids])).logits[0].float().log_softmax(-1)
        )
    n = len(prompt)
    total = sum(float(ref[n - 1 + j, t]) for j, t in enumerate(comp.token_ids))
    assert abs(comp.cumulative_logprob - total) < 1e-3
    s, s_lp = outs["s"].outputs[0], outs["s_lp"].outputs[0]
    assert s.token_ids == s_lp.token_ids and s.logprobs is None and s_lp.logprobs is not None
    assert s.cumulative_logprob is not None and s_lp.cumulative_logprob is not None
    assert abs(s.cumulative_logprob - s_lp.cumulative_logprob) < 1e-5
    by_hand = sum(e[t].logprob for e, t in zip(s_lp.logprobs, s_lp.token_ids, strict=True))
    assert abs(s_lp.cumulative_logprob - by_hand) < 1e-4
    assert_pool_free(engine)
