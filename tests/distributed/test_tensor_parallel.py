"""Tensor parallelism on CPU (gloo): TP=2 and TP=4 give the same greedy token ids as TP=1 (float32) for
tiny random models of every architecture, with preemption, chunked prefill, prefix-cache hits and n=2
in the same run (each checked to have happened); start-up errors name the numbers; a worker that dies
or raises fails the step with an error naming its rank, and no process is left behind."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedrs import LLM, SamplingParams
from pagedrs.engine.arg_utils import EngineArgs
from pagedrs.executor import ExecutorDeadError, TPExecutor
from pagedrs.executor.rank_processes import rank_devices
from tests.distributed.helpers_tp import (
    ENGINE,
    ENGINE_FOR,
    MODELS,
    check_forced,
    run_workload,
    run_workload_logprobs,
    tp_engine,
)
from tests.engine.conftest import assert_pool_free, run_all
from tests.helpers import FP8_SAME_CACHE_TOL, greedy_agreement, make_tiny_llama


@pytest.fixture(scope="module", params=list(MODELS))
def model(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict, dict]:
    folder = MODELS[request.param](tmp_path_factory.mktemp(request.param))
    kw = ENGINE_FOR.get(request.param, {})
    engine = tp_engine(folder, 1, **kw)
    want, spy = run_workload(engine)
    check_forced(engine, spy)
    return folder, want, kw


def test_tp2_equals_tp1(model: tuple[Path, dict, dict]) -> None:
    folder, want, kw = model
    engine = tp_engine(folder, 2, **kw)
    try:
        assert isinstance(engine.engine_core.executor, TPExecutor)
        got, spy = run_workload(engine)
        check_forced(engine, spy)
        assert got == want
        assert len(got["1"]) == 2
        assert_pool_free(engine)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("arch", ["llama", "smollm2"])
def test_tp4_equals_tp1_with_replicated_kv_heads(tmp_path: Path, arch: str) -> None:
    """4 ranks over 2 KV heads (llama) or 1 (smollm2): every KV head lives on 2 or 4 ranks."""
    folder = make_tiny_llama(tmp_path, arch=arch)
    want, _ = run_workload(tp_engine(folder, 1))
    engine = tp_engine(folder, 4)
    try:
        core = engine.engine_core
        assert core.executor.runner.model.num_kv_heads == 1  # this rank's share
        got, spy = run_workload(engine)
        check_forced(engine, spy)
        assert got == want
    finally:
        engine.shutdown()


def test_llm_api_and_prompt_logprobs(tmp_path: Path) -> None:
    """`LLM(tensor_parallel_size=2)`: text and sample/prompt logprobs as with one rank."""
    folder = make_tiny_llama(tmp_path)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    prompts = ["hello tensor parallel", "abc"]
    one = LLM(str(folder), **ENGINE).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(folder), tensor_parallel_size=2, **ENGINE)
    try:
        two = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    for a, b in zip(one, two, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].text == b.outputs[0].text
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert la.keys() == lb.keys()
            for tok in la:
                assert abs(la[tok].logprob - lb[tok].logprob) < 1e-4
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs)
        for la, lb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True):
            assert la.keys() == lb.keys()
            for tok in la:
                assert abs(la[tok].logprob - lb[tok].logprob) < 1e-4


def test_pool_resize_applies_on_every_rank(tmp_path: Path) -> None:
    """Shrink then grow the pool between requests: the plan's block moves run on both ranks."""
    folder = make_tiny_llama(tmp_path)
    want, _ = run_workload(tp_engine(folder, 1, num_kv_blocks=40))
    engine = tp_engine(folder, 2, num_kv_blocks=40)
    try:
        engine.engine_core.resize(24)
        got, _ = run_workload(engine)
        assert got == want
        assert engine.get_stats().num_blocks == 24
        engine.engine_core.resize(48)
        got, _ = run_workload(engine)
        assert got == want
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    ("overrides", "tp", "numbers"),
    [
        (
            {"num_attention_heads": 6, "num_key_value_heads": 6, "hidden_size": 48},
            4,
            ["4", "6 attention heads"],
        ),
        ({"num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 48}, 2, ["2", "3 KV heads"]),
        ({"num_attention_heads": 8, "num_key_value_heads": 3, "hidden_size": 64}, 4, ["4", "3 KV heads"]),
    ],
)
def test_heads_that_do_not_split_are_rejected_before_any_worker(
    tmp_path: Path, overrides: dict, tp: int, numbers: list[str]
) -> None:
    folder = make_tiny_llama(tmp_path, **overrides)
    start = time.monotonic()
    with pytest.raises(ValueError) as info:
        LLM(str(folder), tensor_parallel_size=tp, **ENGINE)
    for n in numbers:
        assert n in str(info.value)
    assert time.monotonic() - start < 30


def test_too_few_devices_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 needs 2 CUDA devices.*only 1"):
        rank_devices(torch.device("cuda", 0), 2)


def test_bad_parallel_arguments() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineArgs(tensor_parallel_size=0).early_configs()
    with pytest.raises(ValueError, match="distributed_executor_backend"):
        EngineArgs(distributed_executor_backend="threads").early_configs()


def _gone(proc: Any) -> bool:
    return proc.poll() is not None


def test_killed_worker_fails_the_step_naming_the_rank(tmp_path: Path) -> None:
    folder = make_tiny_llama(tmp_path)
    engine = tp_engine(folder, 2, num_kv_blocks=200)
    executor = engine.engine_core.executor
    assert isinstance(executor, TPExecutor)
    procs = list(executor.ranks.procs.values())  # type: ignore[attr-defined]
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    engine.add_request("a", [1, 2, 3], params)
    for _ in range(3):
        engine.step()
    os.kill(procs[0].pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(ExecutorDeadError, match="tensor-parallel rank 1 failed") as info:
        for _ in range(1000):
            engine.step()
    assert info.value.rank == 1
    assert time.monotonic() - start < 10
    assert all(_gone(p) for p in procs)
    engine.add_request("b", [4, 5], params)
    with pytest.raises(ExecutorDeadError, match="rank 1"):  # dead for good: no hang, the same error
        engine.step()


def test_worker_that_raises_is_reported_with_its_error(tmp_path: Path) -> None:
    """Rank 1 gets a message it cannot handle (an unknown opcode): it raises, reports through the
    store and exits; rank 0's next step fails with that error and stops the group."""
    from pagedrs.executor.step_packet import HEADER_LEN

    folder = make_tiny_llama(tmp_path)
    engine = tp_engine(folder, 2)
    executor = engine.engine_core.executor
    assert isinstance(executor, TPExecutor)
    procs = list(executor.ranks.procs.values())  # type: ignore[attr-defined]
    bogus = torch.zeros(HEADER_LEN, dtype=torch.int64)
    bogus[0] = 99
    executor.tp.broadcast_cpu(bogus)
    engine.add_request("a", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4))
    with pytest.raises(ExecutorDeadError, match="rank 1 failed: RuntimeError: unknown step opcode 99"):
        run_all(engine)
    assert all(p.wait(10) is not None for p in procs)


def test_shutdown_stops_every_worker(tmp_path: Path) -> None:
    folder = make_tiny_llama(tmp_path)
    engine = tp_engine(folder, 2)
    executor = engine.engine_core.executor
    procs = list(executor.ranks.procs.values())  # type: ignore[attr-defined]
    engine.shutdown()
    assert all(p.wait(10) == 0 for p in procs)  # a clean exit, not a kill


def test_embeddings_and_structured_outputs_under_tp(tmp_path: Path) -> None:
    """Rank 0 holds the full hidden states (pooling) and the full logits (grammar masks): both features
    give what one rank gives."""
    from pagedrs import PoolingParams
    from pagedrs.structured_outputs import StructuredOutputsParams

    folder = make_tiny_llama(tmp_path)
    prompts = [{"prompt_token_ids": list(range(3, 40))}, {"prompt_token_ids": [5, 6, 7]}]
    so = SamplingParams(
        temperature=0.0, max_tokens=12, structured_outputs=StructuredOutputsParams(regex="[a-f]{3,6}")
    )
    one = LLM(str(folder), **ENGINE)
    want_emb = [
        o.outputs.embedding for o in one.embed(prompts, PoolingParams(pooling_type="mean"), use_tqdm=False)
    ]
    want_txt = [o.outputs[0].text for o in one.generate(["abc", "hello"], so, use_tqdm=False)]
    two = LLM(str(folder), tensor_parallel_size=2, **ENGINE)
    try:
        got_emb = [
            o.outputs.embedding
            for o in two.embed(prompts, PoolingParams(pooling_type="mean"), use_tqdm=False)
        ]
        got_txt = [o.outputs[0].text for o in two.generate(["abc", "hello"], so, use_tqdm=False)]
    finally:
        two.shutdown()
    for a, b in zip(want_emb, got_emb, strict=True):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5)
    assert got_txt == want_txt and all(3 <= len(t) <= 6 and set(t) <= set("abcdef") for t in got_txt)


def test_tp2_equals_tp1_with_fp8_cache(tmp_path: Path) -> None:
    """kv_cache_dtype="fp8": each rank rounds its own KV heads; the greedy run agrees with one process's
    as an fp8 cache can across machines (`greedy_agreement`: the all-reduce changes float32 last bits,
    which fp8 rounding may turn into a flipped near tie)."""
    folder = make_tiny_llama(tmp_path, arch="llama")
    want = run_workload_logprobs(tp_engine(folder, 1, kv_cache_dtype="fp8"))
    engine = tp_engine(folder, 2, kv_cache_dtype="fp8")
    try:
        got = run_workload_logprobs(engine)
        assert got.keys() == want.keys()
        common = [
            greedy_agreement(a, b, FP8_SAME_CACHE_TOL)
            for rid in want
            for a, b in zip(want[rid], got[rid], strict=True)
        ]
        assert sum(common) >= sum(len(ids) for w in want.values() for ids, _ in w) // 2, common
        assert_pool_free(engine)
    finally:
        engine.shutdown()
