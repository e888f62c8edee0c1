"""`LLM.beam_search` (pagedrs.beam_search): vLLM's algorithm above the engine. The beams equal HF
transformers' `generate(num_beams=...)` on tiny random models in float32 where the two are the same
algorithm (no EOS: every beam runs max_tokens tokens; see helpers_beam_search.hf_beam_search); EOS and
length_penalty follow vLLM's rule, checked on hand-made step logprobs; beams share prefix blocks."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagedrs import LLM, BeamSearchParams, SamplingParams
from pagedrs.beam_search import BeamSearch, get_beam_search_score
from pagedrs.outputs import CompletionOutput, Logprob, RequestOutput
from tests.engine.conftest import TINY_ARCHS, assert_pool_free, random_prompts
from tests.engine.helpers_beam_search import hf_beam_search
from tests.helpers import load_hf_model

PROMPTS = random_prompts([5, 21, 40], seed=11)


@pytest.fixture(scope="module")
def llms(tiny_models: dict[str, Path]) -> Iterator[dict[str, LLM]]:
    made: dict[str, LLM] = {}

    def get(arch: str, **kwargs: object) -> LLM:
        key = f"{arch}{sorted(kwargs.items())}"
        if key not in made:
            made[key] = LLM(
                str(tiny_models[arch]), device="cpu", disable_log_stats=True, num_kv_blocks=128, **kwargs
            )
        return made[key]

    yield get  # type: ignore[misc]
    for llm in made.values():
        llm.shutdown()


def _tokens(out, prompt: list[int]) -> list[list[int]]:
    return [seq.tokens[len(prompt) :] for seq in out.sequences]


@pytest.mark.parametrize(
    "arch,beam_width,max_tokens,length_penalty",
    [(arch, 3, 10, 1.0) for arch in TINY_ARCHS] + [("llama", 4, 8, 2.0), ("llama", 2, 12, 0.0)],
)
def test_equals_hf_beam_search(
    llms, tiny_models: dict[str, Path], arch: str, beam_width: int, max_tokens: int, length_penalty: float
) -> None:
    llm = llms(arch)
    params = BeamSearchParams(
        beam_width=beam_width, max_tokens=max_tokens, ignore_eos=True, length_penalty=length_penalty
    )
    # All prompts in one call: each round runs every prompt's beams in one batch.
    outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    hf = load_hf_model(tiny_models[arch])
    assert len(outs) == len(PROMPTS)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        expected = hf_beam_search(hf, prompt, beam_width, max_tokens, length_penalty)
        assert _tokens(out, prompt) == [ids for ids, _ in expected]
        for seq, (_, cum) in zip(out.sequences, expected, strict=True):
            assert seq.tokens[: len(prompt)] == prompt  # vLLM's shape: tokens include the prompt
            assert len(seq.logprobs) == max_tokens and seq.finish_reason == "length"
            assert seq.cum_logprob == pytest.approx(cum, abs=1e-3)
            assert seq.text == llm.get_tokenizer().decode(seq.tokens[len(prompt) :], skip_special_tokens=True)
    assert_pool_free(llm.llm_engine)


def test_beam_width_one_is_greedy(llms) -> None:
    llm = llms("qwen2")
    outs = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=1, max_tokens=16, ignore_eos=True))
    greedy = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS],
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
        use_tqdm=False,
    )
    for out, ref in zip(outs, greedy, strict=True):
        (seq,) = out.sequences
        assert seq.tokens[len(ref.prompt_token_ids) :] == ref.outputs[0].token_ids
        assert seq.cum_logprob == pytest.approx(ref.outputs[0].cumulative_logprob, abs=1e-4)


def test_text_prompt_is_tokenized_as_generate_does(llms) -> None:
    llm = llms("llama")
    params = BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True)
    (by_text,) = llm.beam_search("hello beams", params)
    ids = llm.get_tokenizer().encode("hello beams")
    (by_ids,) = llm.beam_search([{"prompt_token_ids": ids}], params)
    assert [s.tokens for s in by_text.sequences] == [s.tokens for s in by_ids.sequences]


def test_beams_share_prefix_blocks(llms) -> None:
    """Each round's beams extend the previous round's: the prefix cache serves their full blocks (16
    tokens each); with prefix caching off the beams are the same, every round recomputed."""
    prompt = random_prompts([40], seed=3)[0]
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    llm = llms("mistral")
    before = llm.llm_engine.get_stats().prefix_cache_hits
    (shared,) = llm.beam_search([{"prompt_token_ids": prompt}], params)
    hits = llm.llm_engine.get_stats().prefix_cache_hits - before
    # Rounds 2..6 run 3 beams each, each beam at least its prompt's 2 full blocks (32 tokens) cached.
    assert hits >= 5 * 3 * 32
    assert_pool_free(llm.llm_engine)
    off = llms("mistral", enable_prefix_caching=False)
    (alone,) = off.beam_search([{"prompt_token_ids": prompt}], params)
    assert off.llm_engine.get_stats().prefix_cache_hits == 0
    assert [s.tokens for s in alone.sequences] == [s.tokens for s in shared.sequences]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(beam_width=0, max_tokens=4), r"beam_width must be an int >= 1, got 0"),
        (dict(beam_width=True, max_tokens=4), r"beam_width must be an int >= 1, got True"),
        (dict(beam_width=2, max_tokens=0), r"max_tokens must be an int >= 1 \(64-bit\), got 0"),
        (dict(beam_width=2, max_tokens=4, length_penalty=math.nan), r"length_penalty must be a finite"),
        (dict(beam_width=2, max_tokens=4, temperature=-1.0), r"temperature must be a non-negative"),
        (dict(beam_width=2, max_tokens=4, ignore_eos=1), r"ignore_eos must be a bool, got 1"),
    ],
)
def test_bad_params_name_the_value(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        BeamSearchParams(**kwargs)


def test_bad_calls(llms) -> None:
    llm = llms("llama")
    with pytest.raises(ValueError, match=r"beam_width must be at most 10 .* got 11"):
        llm.beam_search([[1, 2, 3]], BeamSearchParams(beam_width=11, max_tokens=2))
    with pytest.raises(ValueError, match="params must be a BeamSearchParams, got SamplingParams"):
        llm.beam_search([[1, 2, 3]], SamplingParams())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="out of vocabulary"):
        llm.beam_search([[1, 2, 100_000]], BeamSearchParams(beam_width=2, max_tokens=2))
    assert not llm.llm_engine.has_unfinished_requests()


# ---- vLLM's rule for EOS and length_penalty, on hand-made step logprobs -------------------------------
EOS = 9


def _step(search: BeamSearch, table: dict[tuple[int, ...], dict[int, float]]) -> None:
    """Runs one round whose step logprobs for each beam (by its last tokens) come from `table`."""
    beams = search.next_prompts()
    outs = []
    for i, tokens in enumerate(beams):
        top = {t: Logprob(lp) for t, lp in table[tuple(tokens[2:])].items()}
        completion = CompletionOutput(0, "", [next(iter(top))], None, [top], "length")
        outs.append(RequestOutput(str(i), None, tokens, None, [completion], True))
    search.update(outs)


ROUNDS = [
    {(): {EOS: -0.1, 5: -1.0, 6: -2.0, 7: -3.0}},
    {
        (5,): {5: -0.5, 6: -0.6, EOS: -5.0, 7: -7.0},
        (6,): {5: -0.1, 7: -0.2, EOS: -0.3, 6: -9.0},
        (7,): {5: -0.1, 6: -0.2, 7: -0.3, EOS: -0.4},
    },
]


def _decode(ids: list[int]) -> str:
    return ",".join(map(str, ids))


def test_eos_sets_a_beam_aside() -> None:
    search = BeamSearch([[1, 2]], BeamSearchParams(beam_width=2, max_tokens=2), [EOS])
    _step(search, ROUNDS[0])
    assert [b.tokens for b in search.instances[0].beams] == [[1, 2, 5], [1, 2, 6]]  # EOS is not live
    _step(search, ROUNDS[1])
    assert search.next_prompts() == []  # max_tokens reached
    (out,) = search.outputs(_decode)
    # By cum / len: [1,2,EOS] -0.1/2 (the EOS is not counted), [1,2,6,EOS] -2.3/3, [1,2,5,5] -1.5/4.
    assert [(s.tokens, s.finish_reason, s.text) for s in out.sequences] == [
        ([1, 2, EOS], "stop", ""),
        ([1, 2, 5, 5], "length", "5,5"),
    ]
    assert out.sequences[0].cum_logprob == pytest.approx(-0.1)
    assert get_beam_search_score([1, 2, EOS], -0.1, EOS, 1.0) == pytest.approx(-0.05)


def test_length_penalty_ranks_finished_beams() -> None:
    def best(length_penalty: float) -> list[list[int]]:
        params = BeamSearchParams(beam_width=3, max_tokens=2, length_penalty=length_penalty)
        search = BeamSearch([[1, 2]], params, [EOS])
        _step(search, ROUNDS[0])
        _step(search, ROUNDS[1])
        return [s.tokens for s in search.outputs()[0].sequences]

    # length_penalty 0 ranks by cum_logprob alone; a large one favours the longer beams.
    assert best(0.0) == [[1, 2, EOS], [1, 2, 5, 5], [1, 2, 5, 6]]
    assert best(8.0) == [[1, 2, 5, 5], [1, 2, 5, 6], [1, 2, 6, 5]]


def test_ignore_eos_keeps_eos_beams_live() -> None:
    search = BeamSearch([[1, 2]], BeamSearchParams(beam_width=2, max_tokens=2, ignore_eos=True), [EOS])
    _step(search, ROUNDS[0])
    assert [b.tokens for b in search.instances[0].beams] == [[1, 2, EOS], [1, 2, 5]]
    with pytest.raises(ValueError, match="expected 2 outputs, got 0"):
        search.next_prompts()
        search.update([])
