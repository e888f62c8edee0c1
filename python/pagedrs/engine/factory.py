"""Which engine runs and where its cores run, decided in this one place from the resolved config (as vLLM's
`EngineCoreClient.make_client` picks its client from the config): the core called in this process (the
offline `LLM`), one core in its own process (the server), one core in a Ray actor, or several cores, each
a whole replica of the model, behind a router (data parallelism).

Each core runs with its own config (`core_configs`), which crosses to its process as JSON: the engine's
config itself for one local core process, else the replica's (`LaunchConfig.for_replica`: its rank, its
share of this machine's CPU threads, its prefix-cache changes reported when the router routes by cache)."""

from __future__ import annotations

import enum
import os
from collections.abc import Callable

from pagedrs.engine.client.core_handles import CoreHandle, ProcessCore
from pagedrs.launch_config import LaunchConfig

__all__ = [
    "EngineKind",
    "MakeHandle",
    "core_configs",
    "core_makers",
    "engine_kind",
    "make_core_handle",
    "replica_config",
]

# (ipc_dir, generation) -> the handle of that generation of one core
MakeHandle = Callable[[str, int], CoreHandle]


class EngineKind(enum.Enum):
    IN_PROCESS = "in-process"  # the core called directly in this process (`LLMEngine`)
    CORE_PROCESS = "core-process"  # one core in its own local process (`ProcessCore`)
    RAY = "ray"  # one core in a Ray actor placed on the cluster (`RayCore`)
    DATA_PARALLEL = "data-parallel"  # several cores (processes or Ray actors) behind a router


def engine_kind(config: LaunchConfig, *, in_process: bool = False) -> EngineKind:
    """The kind of engine `config` runs as. `in_process`: the caller runs a single core itself when it can
    (the offline `LLM`); a server never does (its core runs beside the event loop, in its own process)."""
    dp = config.data_parallel
    if dp.size > 1:
        return EngineKind.DATA_PARALLEL
    if in_process:
        return EngineKind.IN_PROCESS
    return EngineKind.RAY if dp.backend == "ray" else EngineKind.CORE_PROCESS


def _thread_budget() -> int:
    """CPUs the replicas share: OMP_NUM_THREADS when set, else this process's affinity mask."""
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) >= 1:
        return int(omp)
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def replica_config(config: LaunchConfig, rank: int) -> LaunchConfig:
    """The config replica `rank` of `data_parallel.size` runs with: this machine's CPU threads shared out
    among local replicas (each of its tensor-parallel ranks gets budget // (replicas x ranks), at least 1,
    unless `num_threads` sets them; a Ray replica gets the CPUs of its bundle), its rank, and its
    prefix-cache changes reported when the router routes by cache."""
    dp, threads = config.data_parallel, config.device.num_threads
    if threads is None and dp.backend == "mp":  # Ray: per bundle
        threads = max(1, _thread_budget() // (dp.size * config.parallel.tensor_parallel_size))
    return config.for_replica(rank, threads)


def core_configs(config: LaunchConfig) -> list[LaunchConfig]:
    """The config of each engine core a frontend (or a supervisor) starts: `config` as it is for one
    local core process, else each replica's."""
    if engine_kind(config) is EngineKind.CORE_PROCESS:
        return [config]
    return [replica_config(config, i) for i in range(config.data_parallel.size)]


def make_core_handle(
    config: LaunchConfig, ipc_dir: str, gen: int, num_clients: int = 1, *, status: bool = False
) -> CoreHandle:
    """The handle of one engine core: a local process, or a Ray actor placed on the cluster when
    `data_parallel.backend` is "ray"."""
    if config.data_parallel.backend == "ray":
        from pagedrs.engine.client.ray_core import RayCore

        return RayCore(config, ipc_dir, gen, num_clients, status=status)
    return ProcessCore(config, ipc_dir, gen, num_clients, status=status)


def core_makers(config: LaunchConfig) -> list[MakeHandle]:
    """How to start each engine core of a frontend that runs them (`AsyncLLMEngine.from_config`)."""
    return [_maker(c) for c in core_configs(config)]


def _maker(config: LaunchConfig) -> MakeHandle:
    return lambda ipc_dir, gen: make_core_handle(config, ipc_dir, gen)
