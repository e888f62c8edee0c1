"""The engine core in a Ray actor (`RayCore`) on a local Ray cluster started here: the same greedy ids as a
core process, a SIGKILLed actor seen as a dead core (in-flight requests fail, the frontend restarts it),
TCP sockets, a tensor-parallel core's ranks placed in its placement group, and nothing left after stop."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pagedrs import SamplingParams
from pagedrs.engine.arg_utils import EngineArgs
from pagedrs.engine.async_engine import AsyncLLMEngine, EngineCoreDiedError
from pagedrs.engine.client.core_handles import EngineStartupError, ProcessCore, connect_ready, wait_ready
from pagedrs.engine.client.ray_core import RayCore, connect_ray, core_bundles
from tests.helpers import make_tiny_llama, make_tokenizer

ray = pytest.importorskip("ray")

NODE_CPUS = 2  # per node of the two-node cluster
NUM_CPUS = 2 * NODE_CPUS
# A 16-token budget chunks the 40-token prompt; three prompts share a 16-token prefix (cache hits).
ENGINE: dict[str, Any] = dict(
    device="cpu",
    dtype="float32",
    block_size=4,
    num_kv_blocks=64,
    max_num_batched_tokens=16,
    disable_log_stats=True,
    seed=0,
)
PREFIX = list(range(100, 116))
PROMPTS = [PREFIX + [1, 2, 3], PREFIX + [7, 8], list(range(10, 50)), PREFIX + [60], [5, 6, 7]]


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    """A two-node Ray cluster on this machine, reached as a user's would be: through RAY_ADDRESS."""
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": NODE_CPUS, "include_dashboard": False}
    )
    try:
        cluster.add_node(num_cpus=NODE_CPUS)
        cluster.wait_for_nodes()
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("RAY_ADDRESS", cluster.address)
            connect_ray()
            assert len(ray.nodes()) == 2
            yield
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("ray-core"), arch="qwen2")


def _engine(make: Callable[[str, int], Any], **kw: Any) -> AsyncLLMEngine:
    return AsyncLLMEngine(tokenizer=make_tokenizer(), _make_handle=make, **kw)


async def _greedy(engine: AsyncLLMEngine, prompts: list[list[int]], max_tokens: int = 8) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    async def one(i: int, prompt: list[int]) -> list[int]:
        outs = [o async for o in engine.generate(f"r{i}-{time.monotonic_ns()}", prompt, params)]
        return list(outs[-1].outputs[0].token_ids)

    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


def _run_greedy(engine: AsyncLLMEngine) -> list[list[int]]:
    async def main() -> list[list[int]]:
        engine.start()
        try:
            return await _greedy(engine, PROMPTS)
        finally:
            engine.shutdown()

    return asyncio.run(main())


def _gone(pid: int, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:  # a zombie (dead, not yet reaped by the raylet) is gone
            with open(f"/proc/{pid}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


def _nothing_left(pids: list[int]) -> None:
    """Every core actor's process has exited, every placement group is removed, every CPU is free."""
    from ray.util.placement_group import placement_group_table

    assert [pid for pid in pids if not _gone(pid)] == []
    assert all(pg["state"] == "REMOVED" for pg in placement_group_table().values())
    deadline = time.monotonic() + 20
    while ray.available_resources().get("CPU", 0) < NUM_CPUS and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.available_resources().get("CPU", 0) == NUM_CPUS


def test_ray_core_equals_process_core(local_ray: None, tiny: Path) -> None:
    args = EngineArgs(model=str(tiny), **ENGINE)
    want = _run_greedy(_engine(lambda d, g: ProcessCore(args.launch_config(), d, g)))
    handles: list[RayCore] = []

    def make(ipc_dir: str, gen: int) -> RayCore:
        handles.append(RayCore(args.launch_config(), ipc_dir, gen))
        return handles[-1]

    got = _run_greedy(_engine(make))
    assert got == want and all(len(ids) == 8 for ids in got)
    (h,) = handles
    assert h.input_addr.startswith("tcp://") and all(a.startswith("tcp://") for a in h.output_addrs)
    assert h.bundles == [{"CPU": 1.0}]
    assert not h.alive() and h.actor is None and h.placement_group is None
    assert h.pid is not None
    _nothing_left([h.pid])


def test_killed_actor_is_a_dead_core_and_is_restarted(local_ray: None, tiny: Path) -> None:
    args = EngineArgs(model=str(tiny), **ENGINE)
    handles: list[RayCore] = []

    def make(ipc_dir: str, gen: int) -> RayCore:
        handles.append(RayCore(args.launch_config(), ipc_dir, gen))
        return handles[-1]

    async def main() -> None:
        engine = _engine(make, max_restarts=1)
        engine.start()
        try:
            before = await _greedy(engine, PROMPTS[:2])
            long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
            stream = await engine.add_request("long", PROMPTS[2], long)
            await stream.__anext__()
            pid = engine.core_pid
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            start = time.monotonic()
            with pytest.raises(EngineCoreDiedError, match=r"Ray actor \(pid \d+ on .*\) died"):
                async for _ in stream:
                    pass
            assert time.monotonic() - start < 30
            assert not handles[0].alive() and "died" in handles[0].exit_description()
            deadline = time.monotonic() + 120
            while not (engine.is_running and engine.num_restarts == 1) and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert engine.is_running and engine.core_pid not in (None, pid)
            assert await _greedy(engine, PROMPTS[:2]) == before
        finally:
            engine.shutdown()

    asyncio.run(main())
    assert len(handles) == 2
    _nothing_left([h.pid for h in handles if h.pid is not None])


def test_tensor_parallel_core_is_packed_and_stop_leaves_nothing(local_ray: None, tiny: Path) -> None:
    args = EngineArgs(
        model=str(tiny),
        tensor_parallel_size=2,
        distributed_executor_backend="ray",
        **ENGINE,
    )
    handle = RayCore(args.launch_config())
    handle.start()
    try:
        assert handle.bundles == [{"CPU": 1.0}, {"CPU": 1.0}]
        ready = wait_ready(handle, 120)  # every rank has joined
        assert ready.num_blocks > 0 and handle.alive()
        # The group holds 2 CPUs and the rank actor (1 CPU) took none outside it: it runs in its bundle.
        assert ray.available_resources().get("CPU", 0) == NUM_CPUS - 2
        from ray.util.placement_group import placement_group_table

        pg = placement_group_table(handle.placement_group)
        assert pg["strategy"] == "STRICT_PACK" and len(set(pg["bundles_to_node_id"].values())) == 1
    finally:
        handle.stop(10)
    assert not handle.alive()
    assert handle.pid is not None
    _nothing_left([handle.pid])


def test_replicas_spread_over_the_nodes(local_ray: None, tiny: Path) -> None:
    # Each core asks a whole node's CPUs: the two must land on different nodes, each answering.
    args = EngineArgs(model=str(tiny), num_threads=NODE_CPUS, **ENGINE)
    # The second also announces Ready on a status socket, as a supervisor's core does (read first).
    handles = [RayCore(args.launch_config(), "", 0), RayCore(args.launch_config(), "", 1, status=True)]
    try:
        for h in handles:
            h.start()
        assert handles[1].status_addr is not None and handles[1].status_addr.startswith("tcp://")
        status, sock = connect_ready(handles[1], 120, address=handles[1].status_addr)
        sock.close(linger=0)
        assert status.num_blocks > 0
        for h in handles:
            assert wait_ready(h, 120).num_blocks > 0
        from ray.util.placement_group import placement_group_table

        nodes = {placement_group_table(h.placement_group)["bundles_to_node_id"][0] for h in handles}
        assert len(nodes) == 2
    finally:
        for h in handles:
            h.stop(10)
    _nothing_left([h.pid for h in handles if h.pid is not None])


def test_data_parallel_ray_equals_one_replica(local_ray: None, tiny: Path) -> None:
    want = _run_greedy(AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny), **ENGINE)))
    args = EngineArgs(
        model=str(tiny),
        data_parallel_size=2,
        data_parallel_backend="ray",
        dp_routing="round_robin",  # both replicas take requests
        **ENGINE,
    )
    engine = AsyncLLMEngine.from_engine_args(args)
    pids = [pid for pid in engine.core_pids if pid is not None]
    assert len(set(pids)) == 2 and engine.num_replicas == 2
    got = _run_greedy(engine)
    assert got == want
    assert all(stats is not None for stats in engine.get_replica_stats())  # each replica stepped
    _nothing_left(pids)


def test_bundles_for_gpus_and_threads() -> None:
    def bundles(use_gpu: bool, **kw: Any) -> list[dict[str, float]]:
        return core_bundles(EngineArgs(**kw).launch_config(), use_gpu)

    assert bundles(False, num_threads=4) == [{"CPU": 4.0}]
    # mp ranks are the core's children: one bundle; Ray ranks get one bundle each.
    assert bundles(False, num_threads=2, tensor_parallel_size=2) == [{"CPU": 4.0}]
    assert bundles(True, tensor_parallel_size=2) == [{"CPU": 1.0, "GPU": 2.0}]
    assert bundles(True, tensor_parallel_size=3, distributed_executor_backend="ray") == [
        {"CPU": 1.0, "GPU": 1.0},
        {"GPU": 1.0},
        {"GPU": 1.0},
    ]


def test_no_room_in_the_cluster_is_a_clear_error(local_ray: None, tiny: Path) -> None:
    # The cluster has 4 CPUs, but no node has 3.
    args = EngineArgs(model=str(tiny), num_threads=NODE_CPUS + 1, **ENGINE)
    handle = RayCore(args.launch_config(), placement_timeout_s=1.0)
    with pytest.raises(EngineStartupError, match=r"no node of the Ray cluster has \[\{'CPU': 3.0\}\] free"):
        handle.start()
    assert handle.placement_group is None and not handle.alive()
    from ray.util.placement_group import placement_group_table

    assert all(pg["state"] == "REMOVED" for pg in placement_group_table().values())
