"""The one place that picks the engine's kind and the config and handle of each engine core."""

from __future__ import annotations

from typing import Any

import pytest

from pagedrs import EngineArgs
from pagedrs.engine.client.core_handles import ProcessCore
from pagedrs.engine.client.ray_core import RayCore
from pagedrs.engine.factory import EngineKind, core_configs, core_makers, engine_kind, make_core_handle
from pagedrs.launch_config import LaunchConfig


def _config(**kw: Any) -> LaunchConfig:
    return EngineArgs(device="cpu", **kw).launch_config()


@pytest.mark.parametrize(
    ("kw", "in_process", "kind"),
    [
        ({}, True, EngineKind.IN_PROCESS),
        ({}, False, EngineKind.CORE_PROCESS),
        ({"data_parallel_backend": "ray"}, False, EngineKind.RAY),
        ({"data_parallel_backend": "ray"}, True, EngineKind.IN_PROCESS),
        ({"data_parallel_size": 2}, False, EngineKind.DATA_PARALLEL),
        ({"data_parallel_size": 2}, True, EngineKind.DATA_PARALLEL),
        ({"data_parallel_size": 3, "data_parallel_backend": "ray"}, False, EngineKind.DATA_PARALLEL),
    ],
)
def test_the_kind_follows_the_config(kw: dict, in_process: bool, kind: EngineKind) -> None:
    assert engine_kind(_config(**kw), in_process=in_process) is kind


def test_one_core_process_runs_the_config_as_it_is() -> None:
    config = _config()
    assert core_configs(config) == [config]
    handle = make_core_handle(config, "/tmp/x", 0)
    assert isinstance(handle, ProcessCore) and handle.config is config
    assert handle.input_addr == "ipc:///tmp/x/core0-in" and handle.output_addrs == ["ipc:///tmp/x/core0-out0"]


def test_each_replica_runs_its_own_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "6")
    config = _config(data_parallel_size=3)
    replicas = core_configs(config)
    assert [r.data_parallel.rank for r in replicas] == [0, 1, 2]
    assert [r.kv_events.data_parallel_rank for r in replicas] == [0, 1, 2]
    assert all(r.device.num_threads == 2 and r.kv_events.step_events for r in replicas)  # 6 CPUs / 3
    handles = [make(f"/tmp/dp{i}", 0) for i, make in enumerate(core_makers(config))]
    assert all(isinstance(h, ProcessCore) for h in handles)
    assert [h.config for h in handles if isinstance(h, ProcessCore)] == replicas


def test_a_ray_core_is_a_replica_with_the_threads_of_its_bundle(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "6")
    config = _config(data_parallel_backend="ray")
    (replica,) = core_configs(config)
    assert replica.device.num_threads is None and replica.data_parallel.rank == 0
    handle = make_core_handle(replica, "", 0, 2, status=True)  # not started: nothing is placed
    assert isinstance(handle, RayCore) and handle.config is replica and handle.num_clients == 2
