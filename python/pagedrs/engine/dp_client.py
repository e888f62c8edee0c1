"""Data parallelism in the frontend: N engine cores (`CoreReplica`: a core handle, its channel and its
restart count), each a whole replica of the model, behind one `AsyncLLMEngine`, and the router that picks
the replica of each request (vLLM's `--data-parallel-size` with an internal load balancer; the routing by
exact prefix-cache state is the router's, fed by the `KVCacheEvents` of each replica's step messages).

A replica that dies is restarted alone; its in-flight requests fail, the router takes no request to it
until it is Ready again, and the others go on serving."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from typing import Any

from pagedrs.engine.core_client import CoreClient
from pagedrs.engine.core_handles import CoreHandle, ProcessCore, connect_ready
from pagedrs.engine.dp_router import DPRouter, NoReplicaAvailable
from pagedrs.engine.messages import EngineCoreOutputs, KVCacheEvents, Ready
from pagedrs.metrics import EngineStats

__all__ = [
    "CoreReplica",
    "SESSION_HEADER",
    "NoReplicaAvailable",
    "make_core_handle",
    "make_router",
    "replica_engine_args",
    "session_key",
    "sum_stats",
]

# The session of the request being handled (the server sets it from the request's `user` or its
# X-Session-Id header); with session affinity on, the requests of one session go to one replica.
SESSION_HEADER = "X-Session-Id"
session_key: ContextVar[str | None] = ContextVar("pagedrs_session_key", default=None)


def _thread_budget() -> int:
    """CPUs the replicas share: OMP_NUM_THREADS when set, else this process's affinity mask."""
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) >= 1:
        return int(omp)
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def replica_engine_args(engine_args: Any, rank: int) -> Any:
    """The arguments replica `rank` of `data_parallel_size` runs with: this machine's CPU threads shared out
    among local replicas (each of its tensor-parallel ranks gets budget // (replicas x ranks), at least 1,
    unless `num_threads` sets them; a Ray replica gets the CPUs of its bundle), its rank, and its prefix-cache changes reported when the router routes by cache."""
    size = int(engine_args.data_parallel_size)
    changes: dict[str, Any] = {}
    if engine_args.num_threads is None and engine_args.data_parallel_backend == "mp":  # Ray: per bundle
        changes["num_threads"] = max(1, _thread_budget() // (size * int(engine_args.tensor_parallel_size)))
    changes["data_parallel_rank"] = rank
    if engine_args.dp_routing == "cache":
        changes["kv_cache_events"] = True
    return dataclasses.replace(engine_args, **changes)


def make_core_handle(
    backend: str, engine_args: Any, ipc_dir: str, gen: int, num_clients: int = 1, *, status: bool = False
) -> CoreHandle:
    """The handle of one engine core: a local process (`mp`) or a Ray actor placed on the cluster (`ray`)."""
    if backend == "ray":
        from pagedrs.engine.ray_core import RayCore

        return RayCore(engine_args, ipc_dir, gen, num_clients, status=status)
    if backend != "mp":
        raise ValueError(f"data_parallel_backend must be 'mp' or 'ray', got {backend!r}")
    return ProcessCore(engine_args, ipc_dir, gen, num_clients, status=status)


def make_router(num_replicas: int, policy: str, block_size: int, session_affinity: bool) -> DPRouter:
    return DPRouter(num_replicas, policy, block_size=block_size, sticky=session_affinity)


_SUMMED = (
    "num_running",
    "num_waiting",
    "num_swapped",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "prompt_tokens_total",
    "generation_tokens_total",
    "num_preemptions",
    "num_blocks",
    "num_free_blocks",
    "num_swap_blocks",
    "num_free_swap_blocks",
    "num_steps",
    "batch_size",
    "spec_num_drafts",
    "spec_num_draft_tokens",
    "spec_num_accepted_tokens",
    "spec_num_pauses",
)


def sum_stats(stats: Sequence[EngineStats | None]) -> EngineStats | None:
    """The engine-wide stats of several replicas: queues, pools and counters summed, the cache usage over
    all their blocks, the step times the slowest replica's."""
    known = [s for s in stats if s is not None]
    if not known:
        return None
    if len(known) == 1:
        return known[0]
    out = EngineStats(**{k: sum(getattr(s, k) for s in known) for k in _SUMMED})
    used = sum(s.kv_usage * s.num_blocks for s in known)
    out.kv_usage = used / out.num_blocks if out.num_blocks else max(s.kv_usage for s in known)
    out.step_time_s = max(s.step_time_s for s in known)
    out.send_time_s = max(s.send_time_s for s in known)
    return out


class CoreReplica:
    """One engine core of the frontend: `make_handle(ipc_dir, gen)` starts generation `gen` of it; `start()`
    (blocking: the model loads) waits for its Ready, `connect()` (on the event loop) starts reading its
    step messages, which go to `on_outputs(index, msg, received_at)`."""

    def __init__(
        self,
        index: int,
        make_handle: Callable[[str, int], CoreHandle],
        ipc_dir: str,
        client_index: int,
        on_outputs: Callable[[int, EngineCoreOutputs, float], None],
        max_restarts: int,
    ) -> None:
        self.index = index
        self.ipc_dir = ipc_dir
        self.client_index = client_index
        self.max_restarts = max_restarts
        self.gen = 0
        self.num_restarts = 0
        self.dead: BaseException | None = None  # set while the core is down
        self.restarting = False
        self.stats: EngineStats | None = None
        self.ready: Ready | None = None
        self.handle: CoreHandle | None = None
        self._make_handle = make_handle
        self._ready_sock: Any = None  # the output socket that read Ready (kept: see `connect`)
        self.client = CoreClient(client_index, lambda msg, t: on_outputs(index, msg, t))

    @property
    def pid(self) -> int | None:
        return getattr(self.handle, "pid", None)

    @property
    def serving(self) -> bool:
        return self.dead is None and self.handle is not None and self.handle.alive()

    def state(self) -> str:
        """up | restarting | down (out of restarts) | stopped."""
        if self.dead is None:
            return "up" if self.handle is not None and self.handle.alive() else "stopped"
        return "restarting" if self.restarting or self.num_restarts < self.max_restarts else "down"

    def start(self, timeout: float) -> Ready:
        """Starts generation `self.gen` and waits for its Ready (EngineStartupError: nothing left running)."""
        self.launch()
        return self.wait_ready(timeout)

    def launch(self) -> None:
        """Starts generation `self.gen`'s process, not waiting for it. Call it from a thread that outlives
        the core: a core process is killed when the thread that started it ends (PR_SET_PDEATHSIG)."""
        handle = self._make_handle(self.ipc_dir, self.gen)
        handle.start()
        self.gen = max(self.gen, getattr(handle, "gen", self.gen))  # a supervisor may be ahead
        self.handle = handle

    def wait_ready(self, timeout: float) -> Ready:
        """Waits for the launched core's Ready (any thread); EngineStartupError, the core stopped, if none."""
        assert self.handle is not None
        try:
            self.ready, self._ready_sock = connect_ready(self.handle, timeout, self.client_index)
        except BaseException:
            self.handle.stop(5)
            raise
        return self.ready

    def connect(self) -> None:
        # The socket that read Ready goes on reading: one PULL peer per output address, ever.
        assert self.handle is not None
        self.client.connect(self.handle.input_addr, self._ready_sock)
        self._ready_sock = None  # the client's now

    def disconnect(self) -> None:
        self.client.disconnect()
        if self._ready_sock is not None:  # read Ready, never connected
            self._ready_sock.close(linger=0)
            self._ready_sock = None

    def stop(self, timeout: float) -> None:
        if self.handle is not None:
            self.handle.stop(timeout)
        self.disconnect()


def cleared() -> KVCacheEvents:
    """The events of a replica that restarted: its prefix cache is empty."""
    return KVCacheEvents(cleared=True)
