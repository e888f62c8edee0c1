"""Data parallelism with several API server processes (`--api-server-count N` with `-dp M`), as vLLM runs
them: the server's main process starts the M engine cores, each with N client sockets, and restarts
any that dies (`DPCoreSupervisor`, one `CoreSupervisor` per core); each of the N API servers holds all M
cores (`RemoteCore`s in its `ReplicaSet`) and routes its own requests over them.

Each core sends every step message to every client: the step's stats and prefix-cache changes
(`KVCacheEvents`), and each client's requests in flight there with their prompt tokens still to prefill
(`client_load`). So every frontend's router knows each core's cache exactly, and its load as its own
requests in flight there plus what the core reports of the other frontends' (`FrontendRouter`)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pagedrs.engine.client.core_handles import EngineStartupError
from pagedrs.engine.client.core_supervisor import CoreSupervisor
from pagedrs.engine.core.messages import ClientLoad
from pagedrs.engine.dp.router import DPRouter
from pagedrs.launch_config import LaunchConfig

__all__ = ["DPCoreSupervisor", "FrontendRouter", "replica_ipc_dir"]

logger = logging.getLogger("pagedrs.core_supervisor")


def replica_ipc_dir(ipc_dir: str, index: int, size: int) -> str:
    """Where replica `index` of `size` keeps its sockets and state (the server's ipc dir with one core, as
    `ReplicaSet` lays them out)."""
    return ipc_dir if size == 1 else os.path.join(ipc_dir, f"dp{index}")


class FrontendRouter(DPRouter):
    """The router of one of several frontends: a replica's load is this frontend's requests in flight
    there (as `DPRouter` counts them, at once) plus the other frontends' requests there as the core last
    reported them (`observe_load`), in the same measure: prompt tokens still to prefill plus
    ``request_tokens`` per request."""

    def __init__(self, num_replicas: int, policy: str = "cache", **kwargs: Any) -> None:
        super().__init__(num_replicas, policy, **kwargs)
        self._peer_load = [0] * num_replicas

    def observe_load(self, replica: int, client_load: Sequence[ClientLoad], client_index: int) -> None:
        """A core's report: per client, its requests in flight there and their prompt tokens to prefill."""
        self._check_replica(replica)
        peer = sum(
            c.prefill_tokens + self._request_tokens * c.requests
            for i, c in enumerate(client_load)
            if i != client_index
        )
        with self._lock:
            rep = self._replicas[replica]
            if not rep.up:
                return
            rep.load += peer - self._peer_load[replica]
            self._peer_load[replica] = peer

    def peer_load(self, replica: int) -> int:
        """The other frontends' load on `replica` as its core last reported it."""
        with self._lock:
            return self._peer_load[replica]

    def set_available(self, replica: int, up: bool) -> None:
        super().set_available(replica, up)
        if not up:
            with self._lock:
                self._peer_load[replica] = 0  # the load went with the core (the router zeroed it)


class DPCoreSupervisor:
    """The M engine cores of N API server processes: `start()` launches them all (the models load in
    parallel), `check()` restarts one that died, `stop()` ends them. Core i runs with `configs[i]`
    (replica i's: `factory.core_configs`) in `replica_ipc_dir(ipc_dir, i, M)`."""

    def __init__(
        self, configs: Sequence[LaunchConfig], ipc_dir: str, num_clients: int, max_restarts: int = 3
    ) -> None:
        size = len(configs)
        if size < 1:
            raise ValueError(f"at least one engine core is needed, got {size}")
        self.supervisors = [
            CoreSupervisor(config, replica_ipc_dir(ipc_dir, i, size), num_clients, max_restarts, index=i)
            for i, config in enumerate(configs)
        ]

    @property
    def pids(self) -> list[int | None]:
        return [s.pid for s in self.supervisors]

    def start(self, should_stop: Callable[[], bool] = lambda: False) -> None:
        """Launches every core from this thread (a core dies with the thread that started it), then waits
        for their Ready in parallel; EngineStartupError (every core stopped) when one does not come up."""
        try:
            for s in self.supervisors:
                os.makedirs(s.ipc_dir, mode=0o700, exist_ok=True)
                s.launch()
            if len(self.supervisors) == 1:
                errors = [_error(self.supervisors[0], should_stop)]
            else:
                with ThreadPoolExecutor(len(self.supervisors)) as pool:
                    errors = list(pool.map(lambda s: _error(s, should_stop), self.supervisors))
        except BaseException:
            self.stop(5.0)
            raise
        failed = [(i, e) for i, e in enumerate(errors) if e is not None]
        if failed:
            self.stop(5.0)
            i, exc = failed[0]
            if len(self.supervisors) == 1:
                raise exc
            raise EngineStartupError(f"data-parallel replica {i}: {exc}") from exc

    def check(self, should_stop: Callable[[], bool] = lambda: False) -> bool:
        """Restarts the cores that died; False once every core is down for good."""
        up = [s.check(should_stop) for s in self.supervisors]
        return any(up)

    def stop(self, timeout: float = 10.0) -> None:
        if len(self.supervisors) == 1:
            self.supervisors[0].stop(timeout)
            return
        with ThreadPoolExecutor(len(self.supervisors)) as pool:
            list(pool.map(lambda s: s.stop(timeout), self.supervisors))


def _error(supervisor: CoreSupervisor, should_stop: Callable[[], bool]) -> EngineStartupError | None:
    try:
        supervisor.wait_ready(should_stop)
    except EngineStartupError as exc:
        return exc
    return None
