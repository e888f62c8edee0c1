"""CUDA graphs captured at start-up: every (batch size, context bucket) graph exists before the first
request and the first pass captures nothing; the graphs' memory is kept out of the KV pool and covers
what the capture took; enforce_eager turns them off; a model that cannot be captured runs eagerly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pagedrs import EngineArgs, LLMEngine
from pagedrs.models.llama import LlamaForCausalLM
from pagedrs.runner import kv_setup
from pagedrs.runner.cuda_graphs import context_buckets, default_capture_sizes
from pagedrs.runner.model_runner import ModelRunner
from tests.engine.conftest import greedy, random_prompts, run_all
from tests.helpers import make_tiny_llama

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

MAX_LEN = 1024
MAX_SEQS = 16
MiB = 1 << 20


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("graph_startup"), "llama")


def _engine(path: Path, **kwargs: Any) -> LLMEngine:
    kwargs.setdefault("gpu_memory_utilization", 0.3)
    return LLMEngine.from_engine_args(
        EngineArgs(
            model=str(path),
            device="cuda",
            dtype="float32",
            attention_backend="cupy",
            max_model_len=MAX_LEN,
            max_num_seqs=MAX_SEQS,
            max_num_batched_tokens=256,
            disable_log_stats=True,
            **kwargs,
        )
    )


def _free(engine: LLMEngine) -> None:
    engine.engine_core.shutdown()
    torch.cuda.empty_cache()


def _run(engine: LLMEngine, prompts: list[list[int]]) -> dict[str, Any]:
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, greedy(30 + 7 * i, logprobs=1))
    return run_all(engine)


# Decode batches of several sizes (1..9 running), contexts in both buckets (512, 1024).
PROMPTS = random_prompts([3, 20, 600, 9, 100, 45, 700, 1, 33], seed=5)


def test_every_graph_is_captured_before_the_first_request(model_path: Path) -> None:
    engine = _engine(model_path)
    graphs = engine.runner.cuda_graphs
    assert graphs is not None and graphs.enabled
    sizes, buckets = default_capture_sizes(MAX_SEQS), context_buckets(MAX_LEN)
    assert sizes == [1, 2, 4, 8, 16] and buckets == [512, 1024]
    assert set(graphs._graphs) == set(graphs.pairs) and len(graphs.pairs) == len(sizes) * len(buckets)
    captured = graphs.num_captures
    assert captured == len(graphs.pairs)
    outs = _run(engine, PROMPTS)
    assert graphs.num_captures == captured  # the first pass captured nothing
    assert graphs.num_replays > 0
    _free(engine)
    eager = _engine(model_path, enforce_eager=True)
    assert eager.runner.cuda_graphs is None
    ref = _run(eager, PROMPTS)
    _free(eager)
    for rid, out in ref.items():
        a, b = out.outputs[0], outs[rid].outputs[0]
        assert a.token_ids == b.token_ids, rid
        assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=1e-3)


def test_graph_memory_is_kept_out_of_the_pool(model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    estimates: list[int] = []
    reserved: list[int] = []
    profile = ModelRunner.profile_cudagraph_memory
    sizing = kv_setup.profile_num_gpu_blocks

    def spy_profile(self: ModelRunner) -> int:
        estimates.append(profile(self))
        return estimates[-1]

    def spy_sizing(*args: Any, **kwargs: Any) -> int:
        reserved.append(kwargs.get("reserved_bytes", 0))
        return sizing(*args, **kwargs)

    monkeypatch.setattr(ModelRunner, "profile_cudagraph_memory", spy_profile)
    monkeypatch.setattr(kv_setup, "profile_num_gpu_blocks", spy_sizing)
    engine = _engine(model_path)
    graphs = engine.runner.cuda_graphs
    assert graphs is not None
    assert len(estimates) == 1 and estimates[0] >= (len(graphs.pairs) - 1) * MiB
    assert reserved == estimates
    # The reservation covers what the capture took.
    assert graphs.captured_bytes <= 1.1 * estimates[0] + 32 * MiB, (graphs.captured_bytes, estimates[0])
    _free(engine)
    eager = _engine(model_path, enforce_eager=True)
    assert estimates[-1] == 0 and reserved[-1] == 0  # enforce_eager: nothing captured, nothing kept
    _free(eager)


def test_a_model_that_cannot_be_captured_runs_eagerly(
    model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    forward = LlamaForCausalLM.forward

    def syncing_forward(self: Any, input_ids: Any, positions: Any, ctx: Any) -> Any:
        hidden = forward(self, input_ids, positions, ctx)
        if torch.cuda.is_current_stream_capturing():
            hidden.sum().item()  # a host sync: illegal inside a capture
        return hidden

    monkeypatch.setattr(LlamaForCausalLM, "forward", syncing_forward)
    engine = _engine(model_path)
    assert engine.runner.cuda_graphs is None and not engine.runner.uses_cuda_graphs
    outs = _run(engine, PROMPTS[:4])
    _free(engine)
    monkeypatch.undo()
    eager = _engine(model_path, enforce_eager=True)
    ref = _run(eager, PROMPTS[:4])
    _free(eager)
    assert {k: v.outputs[0].token_ids for k, v in outs.items()} == {
        k: v.outputs[0].token_ids for k, v in ref.items()
    }
