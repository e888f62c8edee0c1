"""The public API: LLM.generate / chat, LLMEngine requests, aborts, bad input, stats and logs."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from pagedrs import LLM, CompletionOutput, EngineArgs, LLMEngine, RequestOutput, SamplingParams
from tests.engine.conftest import assert_pool_free, greedy, make_engine, random_prompts, run_all
from tests.helpers_vllm_logs import HIT_RATE_LINE, STATS_LINE


@pytest.fixture(scope="module")
def llm(tiny_models: dict[str, Path]) -> LLM:
    return LLM(str(tiny_models["llama"]), device="cpu", num_kv_blocks=128, disable_log_stats=True)


def test_generate_accepts_every_prompt_form(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    ids = tok.encode("hello")
    p = greedy(5)
    one = llm.generate("hello", p, use_tqdm=False)
    assert len(one) == 1 and isinstance(one[0], RequestOutput) and one[0].prompt == "hello"
    assert one[0].prompt_token_ids == ids and isinstance(one[0].outputs[0], CompletionOutput)
    same = [
        llm.generate(ids, p, use_tqdm=False)[0],
        llm.generate({"prompt_token_ids": ids}, p, use_tqdm=False)[0],
        llm.generate({"prompt": "hello"}, p, use_tqdm=False)[0],
    ]
    assert all(o.outputs[0].token_ids == one[0].outputs[0].token_ids for o in same)
    many = llm.generate(
        ["a", "bb", [3, 4, 5], "dddd"], [greedy(2), greedy(3), greedy(4), greedy(5)], use_tqdm=True
    )
    assert [len(o.outputs[0].token_ids) for o in many] == [2, 3, 4, 5]  # prompt order
    assert [o.prompt for o in many] == ["a", "bb", None, "dddd"]
    assert all(o.finished and o.metrics is not None and o.metrics.finished_time for o in many)
    with pytest.raises(ValueError, match="sampling_params has 2 entries"):
        llm.generate(["a", "b", "c"], [greedy(1), greedy(1)], use_tqdm=False)
    assert_pool_free(llm.llm_engine)


def test_generate_default_params_and_metrics(llm: LLM) -> None:
    out = llm.generate("x", use_tqdm=False)[0]
    comp = out.outputs[0]
    assert len(comp.token_ids) <= 16 and comp.finish_reason in ("length", "stop")
    m = out.metrics
    assert m is not None and m.first_scheduled_time is not None and m.first_token_time is not None
    assert (
        m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time <= m.finished_time
    )


def test_chat_uses_the_template(llm: LLM) -> None:
    conv = [{"role": "user", "content": "hi"}]
    outs = llm.chat(conv, greedy(4), use_tqdm=False)
    expected = llm.get_tokenizer().encode("<s>user\nhi</s>\n<s>assistant\n", add_special_tokens=False)
    assert outs[0].prompt_token_ids == expected
    two = llm.chat([conv, conv + [{"role": "assistant", "content": "yo"}]], greedy(4), use_tqdm=False)
    assert len(two) == 2 and two[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    assert_pool_free(llm.llm_engine)


def test_llm_rejects_unknown_argument() -> None:
    with pytest.raises(ValueError, match="unknown LLM argument.*bogus"):
        LLM(None, bogus=1)


def test_unknown_model_path() -> None:
    with pytest.raises(ValueError, match="/no/such/model"):
        LLMEngine.from_engine_args(EngineArgs(model="/no/such/model", device="cpu"))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"block_size": 12}, "block_size"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"swap_space": -1}, "swap_space"),
        ({"device": "tpu"}, "device"),
        ({"attention_backend": "flash"}, "attention_backend"),
        ({"max_model_len": 100_000}, "max_model_len"),
        ({"enable_chunked_prefill": False, "max_num_batched_tokens": 64}, "max_num_batched_tokens"),
    ],
)
def test_bad_engine_args(kwargs: dict, field: str, tiny_models: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match=field):
        make_engine(tiny_models["llama"], **kwargs)


def test_bad_requests_then_normal_service(tiny_models: dict[str, Path]) -> None:
    engine = make_engine(tiny_models["llama"], num_kv_blocks=64, max_model_len=128)
    ok = greedy(4)
    bad = [
        ("long", list(range(128)), ok, "max_model_len"),
        ("empty", [], ok, "empty"),
        ("vocab", [1, 2, 100_000], ok, "out of vocabulary"),
        ("type", 3.5, ok, "prompt"),
        ("params", [1, 2], {"temperature": 0}, "SamplingParams"),
        ("lp", [1, 2], greedy(4, logprobs=50), "max_logprobs"),
        ("dict", {"text": "x"}, ok, "prompt_token_ids"),
    ]
    for rid, prompt, params, match in bad:
        with pytest.raises(ValueError, match=match):
            engine.add_request(rid, prompt, params)  # type: ignore[arg-type]
        assert not engine.has_unfinished_requests()
    for field, value in [("temperature", -1.0), ("top_p", 0.0), ("max_tokens", 0), ("n", 0)]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**{field: value})
    engine.add_request("dup", [1, 2, 3], greedy(3))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", [1, 2, 3], greedy(3))
    engine.add_request("fine", list(range(100)), greedy(8))
    outs = run_all(engine)
    assert len(outs["fine"].outputs[0].token_ids) == 8 and len(outs["dup"].outputs[0].token_ids) == 3
    assert_pool_free(engine)


def test_max_tokens_clipped_to_max_model_len(tiny_models: dict[str, Path]) -> None:
    engine = make_engine(tiny_models["llama"], num_kv_blocks=64, max_model_len=40)
    engine.add_request("a", list(range(30)), greedy(100))
    engine.add_request("b", list(range(30)), SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
    outs = run_all(engine)
    assert len(outs["a"].outputs[0].token_ids) == 10 and outs["a"].outputs[0].finish_reason == "length"
    assert len(outs["b"].outputs[0].token_ids) == 10
    assert_pool_free(engine)


def test_abort_frees_everything(tiny_models: dict[str, Path]) -> None:
    engine = make_engine(tiny_models["qwen2"], num_kv_blocks=64)
    for i, p in enumerate(random_prompts([50, 80, 20], seed=3)):
        engine.add_request(str(i), p, greedy(40, n=2 if i == 1 else 1))
    for _ in range(3):
        engine.step()
    outs = engine.abort_request(["0", "1", "missing"])
    assert [o.request_id for o in outs] == ["0", "1"]
    assert all(c.finish_reason == "abort" for o in outs for c in o.outputs) and all(o.finished for o in outs)
    assert engine.get_num_unfinished_requests() == 1
    engine.abort_request("2")
    assert_pool_free(engine)
    engine.add_request("after", [1, 2, 3], greedy(5))
    assert len(run_all(engine)["after"].outputs[0].token_ids) == 5
    assert_pool_free(engine)


def test_step_outputs_are_cumulative(tiny_models: dict[str, Path]) -> None:
    engine = make_engine(tiny_models["llama"], num_kv_blocks=64)
    engine.add_request("r", [5, 6, 7], greedy(6))
    lengths = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            lengths.append(len(out.outputs[0].token_ids))
    assert lengths == [1, 2, 3, 4, 5, 6]
    assert_pool_free(engine)


def test_stats_log_line_and_batch_picture(
    tiny_models: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    engine = make_engine(
        tiny_models["llama"],
        num_kv_blocks=64,
        disable_log_stats=False,
        stats_log_interval=1e-6,
        enable_log_batch_visualization=True,
        batch_visualization_style="bar",  # the one-line variant (the default is the token boxes)
        max_num_batched_tokens=16,
    )
    logger = logging.getLogger("pagedrs")
    logger.propagate = True
    try:
        with caplog.at_level(logging.INFO, logger="pagedrs"):
            engine.add_request("a", list(range(40)), greedy(3))
            engine.add_request("b", [1, 2], greedy(3))
            for _ in range(3):
                engine.step()
            engine.add_request("c", list(range(20)), greedy(3))  # prefilled beside the decodes
            run_all(engine)
    finally:
        logger.propagate = False
    lines = list(dict.fromkeys(r.getMessage() for r in caplog.records))
    stats = [m for m in lines if m.startswith("Avg prompt throughput")]
    pics = [m for m in lines if m.startswith("step ")]
    assert stats and all(STATS_LINE.match(m) for m in stats), stats  # vLLM 0.4's line, nothing else on it
    assert any(HIT_RATE_LINE.match(m) for m in lines)
    assert pics and any("prefill" in p and "decode" in p for p in pics)
    st = engine.get_stats()
    assert (
        st.prompt_tokens_total + st.prefix_cache_hits == 62
        and st.generation_tokens_total == 9
        and st.num_steps == len(pics)
    )
    assert_pool_free(engine)


def test_steady_decode_steps_skip_the_per_request_bookkeeping(tiny_models: dict[str, Path]) -> None:
    """The core tracks which requests await their first schedule and which collect prompt logprobs; once
    every request is scheduled and its prompt done, a step loops over neither (and an aborted request that
    never ran leaves both sets). The outputs still carry first_scheduled_time and prompt logprobs."""
    engine = make_engine(tiny_models["llama"], max_num_seqs=2)
    core = engine.engine_core
    prompts = random_prompts([5, 7, 9], seed=3)
    engine.add_request("a", prompts[0], greedy(6, prompt_logprobs=1))
    engine.add_request("b", prompts[1], greedy(6))
    engine.add_request("c", prompts[2], greedy(6))  # waits: max_num_seqs=2
    engine.add_request("d", prompts[2], greedy(6, prompt_logprobs=2))
    engine.abort_request("d")
    assert core._unscheduled == {"a", "b", "c"} and core._wanting_prompt_logprobs == {"a"}
    engine.step()
    assert core._unscheduled == {"c"} and core._wanting_prompt_logprobs == set()
    outs = run_all(engine)
    assert not core._unscheduled
    assert outs["a"].prompt_logprobs is not None and len(outs["a"].prompt_logprobs) == 5
    assert all(outs[r].metrics.first_scheduled_time is not None for r in "abc")
    assert_pool_free(engine)
