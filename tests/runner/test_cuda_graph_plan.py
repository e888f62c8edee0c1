"""What CUDA-graph start-up decides without a GPU: which (batch size, context bucket) graphs are captured
and in which order, the memory estimate and how it shrinks the KV budget, when graphs are used at all;
and the runner's graph step (inputs packed into the graphs' static buffers, padded, the block table
gathered into the graph's own) through a stand-in graph runner that replays eagerly on a CPU."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pagedrs.layers.attention import AttentionMetadata, ForwardContext
from pagedrs.runner import kv_setup
from pagedrs.runner.cuda_graphs import (
    capture_order,
    context_buckets,
    default_capture_sizes,
    estimate_graph_memory,
)
from pagedrs.runner.kv_cache import kv_budget_bytes
from tests.engine.conftest import greedy, make_engine, random_prompts, run_all
from tests.helpers import make_tiny_llama

MiB, GiB = 1 << 20, 1 << 30


def test_graphs_planned_at_start_up() -> None:
    sizes = default_capture_sizes(256)  # max_num_seqs 256 (the default)
    assert len(sizes) == 20
    assert context_buckets(4096) == [512, 2048, 4096]
    assert context_buckets(8192) == [512, 2048, 8192]
    assert context_buckets(32768) == [512, 2048, 8192, 32768]
    assert context_buckets(300) == [300]
    assert len(capture_order(sizes, context_buckets(4096))) == 60
    assert len(capture_order(sizes, context_buckets(8192))) == 60
    assert len(capture_order(sizes, context_buckets(32768))) == 80
    order = capture_order(sizes, context_buckets(4096))
    assert len(set(order)) == len(order) == len(sizes) * 3
    assert order[0] == (256, 4096) and order[1] == (240, 4096) and order[-1] == (1, 512)
    # largest first: buckets never grow, and within a bucket sizes never grow
    assert all((b1, s1) >= (b2, s2) for (s1, b1), (s2, b2) in zip(order, order[1:], strict=False))


def test_graph_memory_estimate() -> None:
    assert estimate_graph_memory(100 * MiB, 3 * MiB, 60) == 100 * MiB + 59 * 3 * MiB
    assert estimate_graph_memory(100 * MiB, 1000, 3) == 100 * MiB + 2 * MiB  # at least 1 MiB a graph
    assert estimate_graph_memory(100 * MiB, None, 1) == 100 * MiB
    assert estimate_graph_memory(100 * MiB, 3 * MiB, 0) == 0


def test_kv_budget_keeps_the_graph_memory_out() -> None:
    kw: dict[str, Any] = dict(total=80 * GiB, gpu_memory_utilization=0.9, peak=20 * GiB, used_by_others=GiB)
    base = kv_budget_bytes(**kw)
    assert base == 0.9 * 80 * GiB - 21 * GiB
    assert kv_budget_bytes(**kw, reserved=3 * GiB) == base - 3 * GiB
    assert kv_budget_bytes(**{**kw, "used_by_others": -5}) == 0.9 * 80 * GiB - 20 * GiB


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("graph_plan"), "llama")


def test_when_graphs_are_used_and_the_reserve_reaches_the_sizing(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(tiny_llama, max_num_seqs=4, max_model_len=256)
    runner = engine.runner
    assert not runner.uses_cuda_graphs and runner.cuda_graphs is None  # a CPU
    assert runner.profile_cudagraph_memory() == 0
    # The same runner as it would be on a GPU with the cupy backend (nothing runs on a device here).
    monkeypatch.setattr(runner, "device", torch.device("cuda"))
    monkeypatch.setattr(runner, "backend", SimpleNamespace(name="cupy"))
    assert runner.uses_cuda_graphs
    cfg = runner.config
    monkeypatch.setattr(
        runner, "config", dataclasses.replace(cfg, device=dataclasses.replace(cfg.device, enforce_eager=True))
    )
    assert not runner.uses_cuda_graphs
    par = dataclasses.replace(cfg.parallel, liquid_gpu_range=(0, 1), liquid_total_num_shards=2)
    monkeypatch.setattr(runner, "config", dataclasses.replace(cfg, parallel=par))
    assert not runner.uses_cuda_graphs
    monkeypatch.setattr(runner, "config", cfg)
    monkeypatch.setattr(runner, "tp", SimpleNamespace(size=2))
    assert not runner.uses_cuda_graphs
    monkeypatch.undo()
    # On CUDA the sizing gets the graphs' estimate.
    seen: dict[str, Any] = {}

    def fake_profile(*args: Any, **kwargs: Any) -> int:
        seen.update(kwargs)
        return 7

    monkeypatch.setattr(kv_setup, "profile_num_gpu_blocks", fake_profile)
    monkeypatch.setattr(runner, "device", torch.device("cuda"))
    monkeypatch.setattr(runner, "profile_cudagraph_memory", lambda: 123 * MiB)
    monkeypatch.setattr(
        runner, "config", dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, num_kv_blocks=None))
    )
    assert runner.determine_num_blocks() == 7
    assert seen["reserved_bytes"] == 123 * MiB


class FakeGraphs:
    """Stands in for CudaGraphRunner on a CPU: `replay` runs the model eagerly on the static inputs the
    runner packed, as a graph would read them (the padding rows must be well formed; they are dropped)."""

    def __init__(self, runner: Any, sizes: list[int]) -> None:
        self.runner = runner
        self.inputs = runner.step_buffers.graph_inputs()
        self.capture_sizes = sizes
        self.block_tables = torch.full((sizes[-1], runner.max_blocks_per_seq), -1, dtype=torch.int32)
        self.padded = 0
        self.replays = 0

    def lookup(self, num_reqs: int, max_query_len: int, max_seq_len: int, kv_caches: Any) -> Any:
        if max_query_len != 1 or not 0 < num_reqs <= self.capture_sizes[-1]:
            return None
        return next(s for s in self.capture_sizes if s >= num_reqs), 512

    def replay(self, key: tuple[int, int]) -> torch.Tensor:
        size = key[0]
        inp = self.inputs
        seq_lens = inp.seq_lens[:size]
        n = int((seq_lens > 0).sum())
        assert seq_lens[:n].gt(0).all() and seq_lens[n:].eq(0).all()
        assert inp.slot_mapping[n:size].eq(-1).all() and inp.input_ids[n:size].eq(0).all()
        assert inp.positions[n:size].eq(0).all()
        assert inp.query_start_loc[: size + 1].tolist() == list(range(size + 1))
        self.padded += size - n
        self.replays += 1
        r = self.runner
        meta = AttentionMetadata(
            slot_mapping=inp.slot_mapping[:n],
            query_start_loc=inp.query_start_loc[: n + 1],
            seq_lens=seq_lens[:n],
            block_tables=self.block_tables[:n],
            query_start_loc_cpu=list(range(n + 1)),
            seq_lens_cpu=seq_lens[:n].tolist(),
            max_query_len=1,
            max_seq_len=int(seq_lens[:n].max()),
            block_size=r.block_size,
            num_decode_tokens=n,
        )
        hidden = r.model(
            inp.input_ids[:n], inp.positions[:n], ForwardContext(meta, r.kv_pool.kv_caches, r.backend)
        )
        out = torch.full((size, hidden.shape[1]), float("nan"))
        out[:n] = hidden
        return out


@pytest.mark.parametrize("mirror", [True, False])
def test_graph_step_path_gives_the_eager_tokens(tiny_llama: Path, mirror: bool) -> None:
    prompts = random_prompts([5, 17, 30, 9, 44, 3], seed=11)
    kwargs = dict(max_num_seqs=8, max_num_batched_tokens=48, num_kv_blocks=40, max_model_len=256)
    outs = []
    fakes = []
    for fake in (False, True):
        engine = make_engine(tiny_llama, **kwargs)
        if mirror:
            engine.runner.attach_block_table(engine.scheduler.block_table_view(), mirror=True)
        if fake:
            fakes.append(FakeGraphs(engine.runner, [1, 2, 4, 8]))
            engine.runner.cuda_graphs = fakes[-1]
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, greedy(12 + 3 * i, logprobs=1))
        outs.append(run_all(engine))
    eager, graphed = outs
    for rid, out in eager.items():
        a, b = out.outputs[0], graphed[rid].outputs[0]
        assert a.token_ids == b.token_ids
        assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=1e-4)
    assert fakes[0].replays > 10 and fakes[0].padded > 0
