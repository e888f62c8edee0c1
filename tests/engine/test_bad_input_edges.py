"""Bad input at the library edge (LLM.generate / chat, SamplingParams): a ValueError naming the offending
value, never a crash or a half-added request, and the engine serves a normal request afterwards."""

from __future__ import annotations

from typing import Any

import pytest

import pagedrs.engine.frontend.sequence as sequence_mod
from pagedrs import LLM, SamplingParams
from tests.helpers import VOCAB_SIZE, make_tiny_llama

OK = SamplingParams(temperature=0, max_tokens=3)


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    path = make_tiny_llama(tmp_path_factory.mktemp("edges"))
    return LLM(model=str(path), device="cpu", dtype="float32", num_kv_blocks=64, disable_log_stats=True)


def assert_serves(llm: LLM) -> None:
    out = llm.generate(["hello"], OK, use_tqdm=False)
    assert len(out) == 1 and len(out[0].outputs[0].token_ids) == 3
    assert not llm.llm_engine.has_unfinished_requests()


def test_empty_prompt_list_gives_no_outputs(llm: LLM) -> None:
    assert llm.generate([], OK, use_tqdm=False) == []
    assert_serves(llm)


@pytest.mark.parametrize(
    ("prompts", "params", "match"),
    [
        ([""], OK, "empty"),
        ("", OK, "empty"),
        ([{"prompt_token_ids": []}], OK, "empty"),
        ([{"prompt_token_ids": [1, -1, 2]}], OK, "-1"),
        ([{"prompt_token_ids": [1, VOCAB_SIZE]}], OK, str(VOCAB_SIZE)),
        ([[1, 2], [2**40]], OK, str(2**40)),
        ([None], OK, "NoneType"),
        (None, OK, "NoneType"),
        (["a", "b"], [OK, OK, OK], "3 entries"),
        (["a"], [], "0 entries"),
        (["a"], {"max_tokens": 2}, "dict"),
        (["a", "b"], [OK, None], r"sampling_params\[1\]"),
    ],
)
def test_bad_generate_call(llm: LLM, prompts: Any, params: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        llm.generate(prompts, params, use_tqdm=False)
    assert_serves(llm)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_tokens": 0}, "max_tokens.*got 0"),
        ({"max_tokens": 2**70}, f"max_tokens.*{2**70}"),
        ({"min_tokens": 2**70, "max_tokens": None}, f"min_tokens.*{2**70}"),
        ({"n": 0}, "n must.*got 0"),
        ({"temperature": -1}, "temperature.*got -1"),
        ({"stop": [""]}, "stop.*''"),
        ({"stop_token_ids": [-1]}, r"stop_token_ids.*\[-1\]"),
        ({"stop_token_ids": [2**70]}, f"stop_token_ids.*{2**70}"),
        ({"seed": 2**70}, f"seed.*{2**70}"),
    ],
)
def test_bad_sampling_params(llm: LLM, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)
    assert_serves(llm)


def test_largest_seed_and_stop_token_id_are_served(llm: LLM) -> None:
    params = SamplingParams(seed=2**63 - 1, n=2, max_tokens=2, stop_token_ids=[2**32 - 1])
    out = llm.generate(["hi"], params, use_tqdm=False)
    assert [len(c.token_ids) for c in out[0].outputs] == [2, 2]
    with pytest.raises(ValueError, match=str(2**63 - 1)):  # the core keeps token ids below 2**32
        llm.generate(["hi"], SamplingParams(stop_token_ids=[2**63 - 1]), use_tqdm=False)
    assert_serves(llm)


def test_failure_while_building_sequences_leaves_no_request(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise ValueError("sequence setup failed")

    monkeypatch.setattr(sequence_mod, "SampleState", broken)
    with pytest.raises(ValueError, match="sequence setup failed"):
        llm.generate(["hi"], OK, use_tqdm=False)
    monkeypatch.undo()
    assert not llm.llm_engine.has_unfinished_requests()
    assert_serves(llm)


@pytest.mark.parametrize(("messages", "match"), [([], "empty"), ("hello", "str")])
def test_bad_chat_messages(llm: LLM, messages: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        llm.chat(messages, OK, use_tqdm=False)
    assert_serves(llm)


def test_step_failure_aborts_its_requests_and_engine_keeps_serving(tiny_models: dict, hf_refs: dict) -> None:
    """A step that raises between schedule() and update() (e.g. a device error) aborts the requests it
    held and closes its plan; requests added afterwards are served exactly, and the pool ends free."""
    from tests.engine.conftest import assert_pool_free, greedy, make_engine, random_prompts, run_all

    engine = make_engine(tiny_models["llama"], num_kv_blocks=64)
    prompts = random_prompts([12, 30], seed=11)
    engine.add_request("a", prompts[0], greedy(8))
    engine.step()
    inner = engine.runner.execute

    def boom(*args, **kwargs):
        raise RuntimeError("injected device fault")

    engine.runner.execute = boom
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    engine.runner.execute = inner
    assert not engine.has_unfinished_requests()
    engine.add_request("b", prompts[1], greedy(10))
    outs = run_all(engine)
    assert outs["b"].outputs[0].token_ids == hf_refs["llama"](prompts[1], 10)
    assert_pool_free(engine)
