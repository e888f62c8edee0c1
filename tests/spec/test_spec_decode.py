"""Speculative decoding end to end: greedy token ids with speculation (n-gram, self-draft and a draft
model) equal those
without it, for tiny random models of every architecture, under forced preemption, chunked prefill,
prefix-cache hits and n=2 (each checked to have fired, and drafts checked to have been accepted); stop
tokens, stop strings and max_tokens stay exact; seeded sampling is reproducible; requests the verifier
cannot serve decode one token a step; the batch-size cut-off pauses speculation; the settings are
validated, on `LLM` and on the serve command line; n-gram speculation under tensor parallelism equals
one process."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from pagedrs import LLM, SamplingParams
from pagedrs.config import SpeculativeConfig
from pagedrs.engine.arg_utils import EngineArgs
from tests.distributed.helpers_tp import (
    ENGINE,
    ENGINE_FOR,
    MODELS,
    PROMPTS,
    check_forced,
    run_workload,
    tp_engine,
)
from tests.engine.conftest import assert_pool_free, run_all
from tests.helpers import make_tiny_llama

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
SELF_DRAFT = {"method": "self_draft", "num_speculative_tokens": 3, "draft_layers": 1}
DRAFT_ITSELF = {"method": "draft_model"}  # the test's model folder is its own draft (see _draft)
DRAFT_LAZY = {"method": "draft_model", "disable_by_batch_size": 2}  # paused while 3+ run: backlogs


# Random tiny models whose greedy outputs never repeat a token pair, so prompt lookup proposes but no draft
# matches (their acceptance path is covered by self_draft; the others accept n-gram drafts).
NGRAM_NEVER_ACCEPTS = {"smollm2-kv1-tied", "phi3"}


def _spec(cfg: dict[str, Any]) -> dict[str, Any]:
    # Speculate at every batch size the workload reaches, with the most drafts every step.
    return {**cfg, "disable_by_batch_size": 64, "adaptive": False}


def _echo_prompts(want: dict) -> list[list[int]]:
    """Prompts that contain a model's own greedy continuation, then its start again: the n-gram lookup
    then proposes what the model is likely to say (random tiny models rarely repeat themselves)."""
    out = []
    for rid in ("0", "3"):
        cont = want[rid][0]
        out.append([*PROMPTS[int(rid)], *cont, *PROMPTS[int(rid)], *cont[:2]])
    return out


def _run_echo(engine: Any, prompts: list[list[int]]) -> list[list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(f"echo{i}", p, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True))
    outs = run_all(engine)
    return [list(outs[f"echo{i}"].outputs[0].token_ids) for i in range(len(prompts))]


@pytest.fixture(scope="module", params=list(MODELS))
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, Any]:
    folder = MODELS[request.param](tmp_path_factory.mktemp(request.param))
    engine = tp_engine(folder, 1, **ENGINE_FOR.get(request.param, {}))
    want, _ = run_workload(engine)
    echo = _echo_prompts(want)
    return folder, want, (echo, _run_echo(engine, echo), request.param)


@pytest.mark.parametrize(
    "method",
    [NGRAM, SELF_DRAFT, DRAFT_ITSELF, DRAFT_LAZY],
    ids=["ngram", "self_draft", "draft_model", "draft_model_lazy"],
)
def test_greedy_ids_equal_without_speculation(model: tuple[Path, dict, Any], method: dict) -> None:
    """draft_model: the target as its own draft model, whose KV pool follows the target's blocks
    exactly: every draft is accepted (up to float near-ties). draft_model_lazy: the same, paused while
    more than two sequences run, so the draft skips steps and catches its KV up from the backlogs when
    speculation resumes (under the forced preemption and prefix hits too): still every draft."""
    folder, want, (echo, want_echo, name) = model
    drafting = method is DRAFT_ITSELF or method is DRAFT_LAZY
    if method is DRAFT_LAZY:
        spec = {**_draft(folder), "disable_by_batch_size": 2}
    else:
        spec = _draft(folder) if drafting else _spec(method)
    # Every method keeps a window model's KV-cache group (its smaller pool). A draft model's own pool holds
    # every block of its layers (the full-attention tables): with the target's layers all windowed, the
    # blocks of the default budget (20) are shared out between it and the window pool.
    kw = ENGINE_FOR.get(name, {}) if method is NGRAM or method is SELF_DRAFT else {}
    engine = tp_engine(folder, 1, speculative_config=spec, **kw)
    if name in ENGINE_FOR:
        assert [g[:2] for g in engine.scheduler.kv_group_pools()] == [("window:6", 6)]
    got, spy = run_workload(engine)
    check_forced(engine, spy)
    assert got == want
    assert _run_echo(engine, echo) == want_echo
    stats = engine.get_stats()
    assert stats.spec_num_draft_tokens > 0, stats
    assert stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens
    if drafting:
        # Every draft, up to a float near-tie between the draft's decode-shaped rows and the verifying
        # forward's (other batch shapes may round differently on another CPU). A draft KV with a hole
        # (the last draft's KV not written) accepts 35-60% here.
        assert stats.spec_num_accepted_tokens >= 0.9 * stats.spec_num_draft_tokens, stats
    if method is DRAFT_LAZY:
        drafter = engine.runner.drafter
        assert drafter.num_skipped_steps > 0 and drafter.num_catch_up_tokens > 0, vars(drafter)
    if method is not NGRAM or name not in NGRAM_NEVER_ACCEPTS:
        # Early exit agrees with these models often; n-gram lookup only where the random model's greedy
        # output repeats itself.
        assert stats.spec_num_accepted_tokens > 0, stats
    assert_pool_free(engine)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("spec-llama"))


def _llm(folder: Path, spec: dict | None, **kw: Any) -> LLM:
    return LLM(str(folder), **{**ENGINE, "speculative_config": spec, **kw})


@pytest.mark.parametrize("method", [NGRAM, SELF_DRAFT], ids=["ngram", "self_draft"])
def test_stops_and_lengths_are_exact(llama: Path, method: dict) -> None:
    """A stop token id, a stop string and max_tokens cut the output where they would without drafts
    (the drafts after a stop are dropped), with the same finish reasons and text."""
    prompts = ["abcabcabcabc", "hello hello hello", "xyz"]
    plain = _llm(llama, None)
    base = plain.generate(
        prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False
    )
    params = []
    for o in base:
        ids, text = o.outputs[0].token_ids, o.outputs[0].text
        params.append(SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[ids[9]]))
        cut = text[len(text) // 2 : len(text) // 2 + 2]
        params.append(
            SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[cut] if cut else None)
        )
        params.append(SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))
    many = [p for p in prompts for _ in range(3)]
    want = plain.generate(many, params, use_tqdm=False)
    spec = _llm(llama, _spec(method))
    got = spec.generate(many, params, use_tqdm=False)
    assert spec.llm_engine.get_stats().spec_num_accepted_tokens > 0
    for a, b in zip(want, got, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].text == b.outputs[0].text
        assert (a.outputs[0].finish_reason, a.outputs[0].stop_reason) == (
            b.outputs[0].finish_reason,
            b.outputs[0].stop_reason,
        )


@pytest.mark.parametrize("method", [NGRAM, SELF_DRAFT], ids=["ngram", "self_draft"])
def test_seeded_sampling_is_reproducible(llama: Path, method: dict) -> None:
    """temperature > 0 with a seed: the same tokens on every run and whatever else is in the batch."""
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=7, max_tokens=20, ignore_eos=True)
    llm = _llm(llama, _spec(method))
    alone = llm.generate(["abcabcabcabc"], params, use_tqdm=False)[0].outputs[0].token_ids
    again = llm.generate(["abcabcabcabc"], params, use_tqdm=False)[0].outputs[0].token_ids
    other = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    batch = llm.generate(["zzz zzz", "abcabcabcabc", "qq"], [other, params, other], use_tqdm=False)
    assert alone == again == batch[1].outputs[0].token_ids
    assert len(alone) == 20
    assert llm.llm_engine.get_stats().spec_num_draft_tokens > 0


def test_requests_the_verifier_cannot_serve_decode_plainly(llama: Path) -> None:
    """Penalties and min_tokens keep per-token state: such requests never get drafts, and their outputs
    equal the run without speculation."""
    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0, max_tokens=12, min_tokens=5),
    ]
    prompts = ["abcabcabcabc"] * 2
    want = _llm(llama, None).generate(prompts, params, use_tqdm=False)
    llm = _llm(llama, _spec(NGRAM))
    got = llm.generate(prompts, params, use_tqdm=False)
    assert llm.llm_engine.get_stats().spec_num_drafts == 0
    for a, b in zip(want, got, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


@pytest.mark.parametrize("method", [NGRAM, SELF_DRAFT], ids=["ngram", "self_draft"])
def test_logprobs_of_speculating_requests_equal_decoding_without(llama: Path, method: dict) -> None:
    """A request with logprobs speculates; each emitted token's logprobs (the token's, its rank, the top
    3) come from its verification row and equal those of decoding without speculation, next to a request
    without logprobs and one with prompt logprobs."""
    params = [
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0, prompt_logprobs=2),
    ]
    prompts = ["abcabcabcabc", "hello hello hello", "abcabcab"]
    want = _llm(llama, None).generate(prompts, params, use_tqdm=False)
    alone = _llm(llama, _spec(method))  # the logprobs request by itself gets drafts (self-draft: accepted)
    got0 = alone.generate(prompts[:1], params[:1], use_tqdm=False)[0].outputs[0]
    stats = alone.llm_engine.get_stats()
    assert stats.spec_num_draft_tokens > 0, stats
    assert method is NGRAM or stats.spec_num_accepted_tokens > 0, stats
    assert got0.token_ids == want[0].outputs[0].token_ids
    llm = _llm(llama, _spec(method))
    got = llm.generate(prompts, params, use_tqdm=False)
    assert llm.llm_engine.get_stats().spec_num_accepted_tokens > 0
    for a, b in zip(want, got, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].cumulative_logprob == pytest.approx(b.outputs[0].cumulative_logprob, abs=1e-4)
    for wa, ga in [
        (want[0].outputs[0].logprobs, got[0].outputs[0].logprobs),
        (want[2].outputs[0].logprobs, got[2].outputs[0].logprobs),
        (want[0].outputs[0].logprobs, got0.logprobs),
    ]:
        assert wa is not None and ga is not None and len(wa) == len(ga) == 16
        for pos_w, pos_g in zip(wa, ga, strict=True):
            assert set(pos_w) == set(pos_g)
            for tok, lw in pos_w.items():
                assert lw.rank == pos_g[tok].rank
                assert lw.logprob == pytest.approx(pos_g[tok].logprob, abs=1e-4)
    assert got[1].outputs[0].logprobs is None


def test_speculation_pauses_above_the_batch_size(llama: Path) -> None:
    """disable_by_batch_size=1: no plan with drafts while two or more sequences run; drafts once one is left."""
    engine = tp_engine(llama, 1, speculative_config={**NGRAM, "disable_by_batch_size": 1})
    seen: list[tuple[int, bool]] = []
    executor = engine.engine_core.executor
    inner = executor.execute

    def execute(plan: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append((int(engine.engine_core.scheduler.stats().num_running), bool(plan.has_drafts)))
        return inner(plan, *args, **kwargs)

    executor.execute = execute  # type: ignore[method-assign]
    for i, n in enumerate([4, 30]):
        engine.add_request(
            str(i), [5, 6, 7, 5, 6, 7, 5, 6], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        )
    run_all(engine)
    assert not any(drafts for running, drafts in seen if running > 1)
    assert any(drafts for running, drafts in seen if running == 1)


def test_speculation_measured_slower_pauses_engine_wide(llama: Path) -> None:
    """With `adaptive` (the default), steps with drafts that cost more per emitted token than steps
    without them pause every sequence's proposals (the engine's governor): here each step with drafts is
    made 40 ms slower, far more than its accepted drafts can save on a tiny model. After the first
    losing window no drafts for at least 64 steps, the pause counted in the stats; the ids stay those
    of decoding without speculation."""
    prompt = [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    room = {"num_kv_blocks": 128}  # the whole answer fits
    want = _llm(llama, None, **room).generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert len(want[0].outputs[0].token_ids) == 400
    engine = tp_engine(llama, 1, speculative_config=NGRAM, **room)
    executor = engine.engine_core.executor
    inner = executor.execute
    drafted: list[bool] = []

    def execute(plan: Any, *args: Any, **kwargs: Any) -> Any:
        drafted.append(bool(plan.has_drafts))
        if plan.has_drafts:
            time.sleep(0.04)
        return inner(plan, *args, **kwargs)

    executor.execute = execute  # type: ignore[method-assign]
    engine.add_request("0", {"prompt_token_ids": prompt}, params)
    outs = run_all(engine)
    assert outs["0"].outputs[0].token_ids == want[0].outputs[0].token_ids
    stats = engine.get_stats()
    assert stats.spec_num_pauses >= 1, stats
    longest, run = 0, 0
    for d in drafted:
        run = 0 if d else run + 1
        longest = max(longest, run)
    assert longest >= 64, drafted  # a sequence's own pause after rejections is at most 32 steps
    # Up to 8 drafting steps before any plain rate exists, then windows of 8 between pauses of 64, 128,
    # 256: at most 4 windows fit in 400 steps. Without the governor nearly every step could draft.
    assert sum(drafted) <= 8 + 4 * 8, f"{sum(drafted)} steps with drafts in {len(drafted)}"


def test_config_is_validated() -> None:
    assert SpeculativeConfig.from_dict(
        '{"method": "ngram", "num_speculative_tokens": 2}'
    ) == SpeculativeConfig("ngram", 2)
    assert SpeculativeConfig.from_dict({"method": "[ngram]", "num_speculative_tokens": 2}).method == "ngram"
    # vLLM 0.6's speculative_model="[ngram]", and one side of the lookup range given alone
    assert SpeculativeConfig.from_dict(
        {"model": "[ngram]", "num_speculative_tokens": 2}
    ) == SpeculativeConfig("ngram", 2)
    one_sided = [
        ({"prompt_lookup_min": 5}, (5, 5)),
        ({"prompt_lookup_max": 1}, (1, 1)),
        ({"prompt_lookup_max": 6}, (2, 6)),
    ]
    for given, (lo, hi) in one_sided:
        spec = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2, **given})
        assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (lo, hi), given
    draft_tp1 = {"model": "x", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}
    assert SpeculativeConfig.from_dict(draft_tp1).draft_tensor_parallel_size == 1
    for bad, match in [
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 4},
            "prompt_lookup_min",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 5}, "unknown keys.*lookahead"),
        ({"method": "magic", "num_speculative_tokens": 2}, "magic"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "model.*must name the draft model"),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "only for method 'draft_model'"),
        ({"method": "eagle", "model": "x", "num_speculative_tokens": 2}, "'eagle' is not implemented"),
        (
            {"model": "x", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2},
            "draft_tensor_parallel_size",
        ),
        ({"num_speculative_tokens": 2}, "needs 'method'"),
        ("{not json", "not valid JSON"),
    ]:
        with pytest.raises(ValueError, match=match):
            SpeculativeConfig.from_dict(bad)
    # vLLM's form: a model alone is a draft model
    draft = SpeculativeConfig.from_dict({"model": "some/draft", "num_speculative_tokens": 2})
    assert draft == SpeculativeConfig("draft_model", 2, model="some/draft")
    with pytest.raises(ValueError, match="self_draft.*tensor_parallel_size"):
        EngineArgs(tensor_parallel_size=2, speculative_config=SELF_DRAFT).speculative()
    draft_tp = EngineArgs(
        tensor_parallel_size=2, speculative_config={"model": "x", "num_speculative_tokens": 2}
    )
    assert draft_tp.speculative() == SpeculativeConfig("draft_model", 2, model="x")
    with pytest.raises(ValueError, match="draft_model.*liquid scaling"):
        EngineArgs(
            liquid_gpu_range=(1, 2), speculative_config={"model": "x", "num_speculative_tokens": 2}
        ).speculative()


def _draft(model: Path) -> dict[str, Any]:
    return _spec({"method": "draft_model", "model": str(model), "num_speculative_tokens": 3})


def test_a_smaller_draft_model(llama: Path, tmp_path: Path) -> None:
    """A different, smaller model over the same vocabulary proposes; the target decides (greedy ids as
    without speculation); a draft with a larger vocabulary is refused."""
    small = make_tiny_llama(tmp_path, num_hidden_layers=1, seed=5, subdir="draft")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["abcabcabcabc", "hello hello hello", "xyz"]
    want = [o.outputs[0].token_ids for o in _llm(llama, None).generate(prompts, params, use_tqdm=False)]
    spec = _llm(llama, _draft(small))
    runner = spec.llm_engine.runner
    built: list[list[Any]] = []  # per step: the plans the runner built attention metadata for
    inner_meta, inner_execute = runner._attn_metadata, runner.execute_model

    def attn_metadata(plan: Any, *args: Any, **kwargs: Any) -> Any:
        built[-1].append(plan)
        return inner_meta(plan, *args, **kwargs)

    def execute_model(plan: Any, *args: Any, **kwargs: Any) -> Any:
        built.append([])
        return inner_execute(plan, *args, **kwargs)

    runner._attn_metadata = attn_metadata  # type: ignore[method-assign]
    runner.execute_model = execute_model  # type: ignore[method-assign]
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    assert got == want
    # the draft's forward over a step and the target's share one metadata (sub-steps build their own)
    twice = [s for s in built if any(sum(p is q for q in s) > 1 for p in s)]
    assert not twice and any(len(s) > 1 for s in built), f"{len(twice)} of {len(built)} steps built one twice"
    stats = spec.llm_engine.get_stats()
    assert stats.spec_num_draft_tokens > 0 and stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens
    big = make_tiny_llama(tmp_path, vocab_size=400, subdir="big-vocab")
    with pytest.raises(ValueError, match="vocabulary of 400 tokens.*share the target's tokenizer"):
        _llm(llama, _draft(big))


def test_serve_flag_reaches_the_engine_args() -> None:
    import argparse

    from pagedrs.entrypoints.cli_args import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}'])
    kwargs = engine_kwargs(args)
    assert kwargs["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 4}
    assert EngineArgs(**kwargs).speculative() == SpeculativeConfig("ngram", 4)


def test_draft_model_under_tensor_parallelism_equals_one_process(llama: Path) -> None:
    """The draft runs whole on rank 0 and broadcasts its drafts: TP=2 gives TP=1's greedy ids under forced
    preemption, chunking and prefix hits, with as many drafts accepted as one process accepts. The draft
    is the target itself, so that most drafts are accepted: a rank verifying other tokens than rank 0's
    drafts would change the accepted count or the ids."""
    want, _ = run_workload(tp_engine(llama, 1))
    one = tp_engine(llama, 1, speculative_config=_draft(llama))
    try:
        got_one, _ = run_workload(one)
        one_stats = one.get_stats()
    finally:
        one.shutdown()
    engine = tp_engine(llama, 2, speculative_config=_draft(llama))
    try:
        got, spy = run_workload(engine)
        check_forced(engine, spy)
        stats = engine.get_stats()
        assert stats.spec_num_draft_tokens > 0 and stats.spec_num_accepted_tokens > 0
        assert got == want == got_one
        assert stats.spec_num_accepted_tokens == one_stats.spec_num_accepted_tokens
    finally:
        engine.shutdown()


def test_ngram_under_tensor_parallelism_equals_one_process(llama: Path) -> None:
    want, _ = run_workload(tp_engine(llama, 1))
    engine = tp_engine(llama, 2, speculative_config=_spec(NGRAM))
    try:
        got, spy = run_workload(engine)
        check_forced(engine, spy)
        assert engine.get_stats().spec_num_accepted_tokens > 0
        assert got == want
    finally:
        engine.shutdown()


def test_structured_outputs_speculate_and_stay_valid() -> None:
    """Default model (float32), JSON schemas whose keys the prompt repeats (so prompt lookup proposes
    them): with n-gram speculation the greedy outputs equal the plain run and validate; a sampled one is
    valid too; drafts were proposed and some accepted, and the grammar cut the ones it rejects."""
    import json

    import jsonschema

    from pagedrs.structured_outputs import StructuredOutputsParams

    schema = {
        "type": "object",
        "properties": {
            "first_name": {"type": "string", "maxLength": 12},
            "last_name": {"type": "string", "maxLength": 12},
            "favourite_colour": {"enum": ["red", "green", "blue"]},
            "lucky_numbers": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 99},
                "minItems": 3,
                "maxItems": 3,
            },
        },
        "required": ["first_name", "last_name", "favourite_colour", "lucky_numbers"],
        "additionalProperties": False,
    }
    prompts = [
        'Fill in {"first_name": ..., "last_name": ..., "favourite_colour": ..., "lucky_numbers": [...]} for Ada:',
        'JSON with first_name, last_name, favourite_colour and lucky_numbers for "Grace Hopper":',
    ]
    so = StructuredOutputsParams(json=schema)
    greedy_p = SamplingParams(temperature=0.0, max_tokens=200, structured_outputs=so)
    small = {"device": "cpu", "dtype": "float32", "max_model_len": 512, "cpu_kv_cache_gb": 0.25}
    plain = LLM(**small, disable_log_stats=True)
    want = [o.outputs[0].text for o in plain.generate(prompts, greedy_p, use_tqdm=False)]
    plain.shutdown()
    llm = LLM(**small, disable_log_stats=True, speculative_config=_spec(NGRAM))
    got = [o.outputs[0].text for o in llm.generate(prompts, greedy_p, use_tqdm=False)]
    sampled = SamplingParams(temperature=0.7, seed=5, max_tokens=200, structured_outputs=so)
    got_sampled = llm.generate(prompts[:1], sampled, use_tqdm=False)[0].outputs[0].text
    stats = llm.llm_engine.get_stats()
    llm.shutdown()
    assert got == want
    for text in [*got, got_sampled]:
        jsonschema.validate(json.loads(text), schema)  # finished inside max_tokens, and valid
    assert stats.spec_num_accepted_tokens > 0
    assert stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens


@pytest.mark.parametrize("method", [NGRAM, SELF_DRAFT], ids=["ngram", "self_draft"])
def test_default_model_quantized_greedy_is_lossless(method: dict) -> None:
    """The main job's model as served (GGUF kept quantized, 8-bit activations): greedy ids with speculation
    equal those without, on a copy-heavy chat prompt (the quantized matmul gives a row the same bits
    whatever the batch, and a verification attends as token-by-token decodes do)."""
    prompt = (
        "<|im_start|>user\nRepeat exactly: The library opens at nine in the morning and closes at six in the "
        "evening on weekdays. On Saturdays it opens at ten and closes at four.<|im_end|>\n<|im_start|>assistant\n"
    )
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    small = {"cpu_kv_cache_gb": 0.25, "disable_log_stats": True}
    want = LLM(**small).generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    method = {**_spec(method), "draft_layers": 24} if method is SELF_DRAFT else _spec(method)
    llm = LLM(**small, speculative_config=method)
    got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    stats = llm.llm_engine.get_stats()
    assert got == want
    assert stats.spec_num_accepted_tokens > 0, stats


def test_draft_model_samples_the_drafts_of_sampling_requests(llama: Path) -> None:
    """A request that samples (temperature 1, top-p 0.9, seeded) gets drafts sampled from the draft's
    own distribution under its parameters, which the verifier takes as q: with the target as its own
    draft q is p up to rounding, so nearly every draft is accepted (argmax drafts from the tiny random
    model's flat distributions are accepted at p(argmax): under a third here). The same seeds give the
    same tokens again; a greedy request in the same batch still gets the ids of decoding without
    speculation."""
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = _llm(llama, None).generate([{"prompt_token_ids": prompts[0]}], greedy, use_tqdm=False)
    spec = _llm(llama, _draft(llama))
    params = [greedy] + [
        SamplingParams(temperature=1.0, top_p=0.9, seed=s, max_tokens=24, ignore_eos=True) for s in (1, 2)
    ]
    inputs = [{"prompt_token_ids": p} for p in prompts]
    first = [o.outputs[0].token_ids for o in spec.generate(inputs, params, use_tqdm=False)]
    assert first[0] == want[0].outputs[0].token_ids
    stats = spec.llm_engine.get_stats()
    assert stats.spec_num_draft_tokens > 30, stats
    assert stats.spec_num_accepted_tokens >= 0.9 * stats.spec_num_draft_tokens, stats
    again = [o.outputs[0].token_ids for o in spec.generate(inputs, params, use_tqdm=False)]
    assert again == first
    assert first[1] != first[2]  # two seeds, two samples
