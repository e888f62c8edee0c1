"""Data parallelism behind one engine: N core processes, each request routed to one (by prefix cache,
least load or round robin), greedy ids as with one core, a killed replica failing only its requests and
coming back, nothing left after shutdown; offline `LLM(data_parallel_size=2)`; the settings' checks."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from pagedrs import LLM, SamplingParams
from pagedrs.engine.arg_utils import EngineArgs
from pagedrs.engine.async_engine import AsyncLLMEngine, EngineCoreDiedError
from pagedrs.engine.factory import replica_config
from pagedrs.entrypoints.cli_args import ServerArgs
from pagedrs.entrypoints.openai.server.api_server import resolve_server_args
from tests.engine.helpers_dp import DISTINCT, ENGINE, GREEDY, PREFIXED, gone, greedy_ids, routed
from tests.helpers import make_tiny_llama

pytest.importorskip("pagedrs._core")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("dp"), arch="qwen2")


@pytest.fixture(scope="module")
def want(tiny: Path) -> list[list[int]]:
    """Greedy ids of one in-process engine (DP=1)."""
    llm = LLM(str(tiny), **ENGINE)
    outs = llm.generate([{"prompt_token_ids": p} for p in PREFIXED + DISTINCT], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_bad_settings_name_the_value() -> None:
    for kw, name in (
        ({"data_parallel_size": 0}, "data_parallel_size"),
        ({"dp_routing": "random"}, "dp_routing"),
        ({"data_parallel_backend": "k8s"}, "data_parallel_backend"),
        ({"dp_router_config": '{"load_penalty": -1}'}, "load_penalty"),
        ({"dp_router_config": {"penalty": 1}}, "'penalty'"),
        ({"dp_router_config": "[1, 2]"}, "dp_router_config"),
        ({"dp_router_config": "{load_penalty: 1"}, "dp_router_config"),
    ):
        with pytest.raises(ValueError, match=name):
            EngineArgs(**kw).early_configs()  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="--api-server-count 2 with --data-parallel-backend 'ray'"):
        resolve_server_args(
            ServerArgs(api_server_count=2), EngineArgs(data_parallel_size=2, data_parallel_backend="ray")
        )
    assert resolve_server_args(ServerArgs(api_server_count=2), EngineArgs(data_parallel_size=2))


def test_threads_are_shared_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    args = EngineArgs(data_parallel_size=2, tensor_parallel_size=2)
    assert replica_config(args.launch_config(), 1).device.num_threads == 2  # 8 CPUs / (2 replicas x 2 ranks)
    assert replica_config(EngineArgs(data_parallel_size=16).launch_config(), 0).device.num_threads == 1
    three = EngineArgs(data_parallel_size=2, num_threads=3).launch_config()
    assert replica_config(three, 0).device.num_threads == 3


def test_offline_dp2_equals_dp1(tiny: Path, want: list[list[int]]) -> None:
    llm = LLM(str(tiny), data_parallel_size=2, dp_routing="round_robin", **ENGINE)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PREFIXED + DISTINCT], GREEDY, use_tqdm=False)
        engine = llm.llm_engine.engine
        pids = [p for p in engine.core_pids if p is not None]
        assert [list(o.outputs[0].token_ids) for o in outs] == want
        assert [o.request_id for o in outs] == sorted((o.request_id for o in outs), key=int)  # input order
        assert routed(engine) == [6, 6]  # both replicas served
    finally:
        llm.shutdown()
    assert len(pids) == 2 and all(gone(p) for p in pids)


def test_cache_routing_kill_and_restart(tiny: Path, want: list[list[int]]) -> None:
    """Cache routing: a prefix-sharing sequence stays on one replica, concurrent distinct prompts use both,
    ids as DP=1. A SIGKILLed replica fails its in-flight requests only; later requests succeed; it returns;
    shutdown leaves no process."""
    tuning = '{"request_tokens": 24, "balance_abs_tokens": 2048}'
    args = EngineArgs(model=str(tiny), data_parallel_size=2, dp_router_config=tuning, **ENGINE)  # type: ignore[arg-type]
    engine = AsyncLLMEngine.from_engine_args(args, max_restarts=1)
    assert engine.router is not None  # the knobs reached the router
    assert (engine.router.tuning["request_tokens"], engine.router.tuning["balance_abs_tokens"]) == (24, 2048)
    assert engine.router.tuning["load_penalty"] == 0.25  # the rest keep their defaults

    async def main() -> list[int]:
        engine.start()
        got = await greedy_ids(engine, PREFIXED, concurrent=False)
        counts = routed(engine)
        assert sorted(counts) == [0, len(PREFIXED)], counts  # all where the prefix is cached
        assert engine.router is not None
        home = counts.index(len(PREFIXED))
        # The cores' reported prefix-cache changes reached the router: the shared prefix's blocks are held.
        assert engine.router.snapshot()[home].num_cached_blocks >= len(PREFIXED[0]) // ENGINE["block_size"]
        got += await greedy_ids(engine, DISTINCT)
        assert got == want
        assert min(routed(engine)) > 0, routed(engine)  # concurrent distinct prompts: both replicas
        # SIGKILL replica 0 while each replica runs a long request.
        long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        streams = [await engine.add_request(f"long{i}", p, long) for i, p in enumerate(DISTINCT[:4])]
        for s in streams:
            await s.__anext__()
        owners = [engine.replica_of(s.request_id) for s in streams]
        assert set(owners) == {0, 1}, owners
        victim = engine.core_pids[0]
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        results: list[str] = []
        for s in streams:
            try:
                async for _ in s:
                    pass
                results.append("ok")
            except EngineCoreDiedError as exc:
                assert "data-parallel replica 0" in str(exc)
                results.append("died")
            finally:
                engine.release(s)
        assert results == ["died" if o == 0 else "ok" for o in owners]
        assert engine.is_healthy  # replica 1 serves
        assert await greedy_ids(engine, DISTINCT[:3], tag="after") == want[len(PREFIXED) : len(PREFIXED) + 3]
        deadline = time.monotonic() + 60
        while engine.replica_states()[0]["state"] != "up" and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        states = engine.replica_states()
        assert [s["state"] for s in states] == ["up", "up"] and states[0]["restarts"] == 1
        assert engine.core_pids[0] not in (None, victim)
        return [victim] + [p for p in engine.core_pids if p is not None]

    try:
        pids = asyncio.run(main())
    finally:
        engine.shutdown()
    assert all(gone(p) for p in pids)


def test_ray_backend_equals_dp1(tiny: Path, want: list[list[int]]) -> None:
    """`data_parallel_backend="ray"`: each replica a Ray actor on a local Ray instance; ids as DP=1."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        args = EngineArgs(
            model=str(tiny),
            data_parallel_size=2,
            data_parallel_backend="ray",
            dp_routing="round_robin",
            **ENGINE,  # type: ignore[arg-type]
        )
        engine = AsyncLLMEngine.from_engine_args(args)

        async def main() -> list[list[int]]:
            engine.start()
            try:
                return await greedy_ids(engine, PREFIXED + DISTINCT)
            finally:
                engine.shutdown()

        assert asyncio.run(main()) == want
        assert routed(engine) == [6, 6]
        assert all(r["state"] == "stopped" for r in engine.replica_states())
    finally:
        ray.shutdown()
