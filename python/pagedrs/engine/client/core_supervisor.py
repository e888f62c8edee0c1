"""The engine core of a server with several API server processes (`--api-server-count N`): one process
(the supervisor, the server's main process) starts the core with N client sockets, restarts it when it
dies (at most `max_restarts` times), and publishes what it knows in `core-state.json` in the core's ipc
dir. The API server processes follow that file (`RemoteCore`): they fail their in-flight requests when the
core dies and reconnect to the generation that replaces it. With data parallelism there is one of these
per core (`dp.frontends.DPCoreSupervisor`)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from pagedrs.engine.client.core_handles import (
    CoreState,
    EngineStartupError,
    ProcessCore,
    connect_ready,
    write_core_state,
)
from pagedrs.engine.core.messages import Ready
from pagedrs.launch_config import LaunchConfig

__all__ = ["CoreSupervisor"]

logger = logging.getLogger("pagedrs.core_supervisor")

_READY_TIMEOUT_S = 600.0


class CoreSupervisor:
    """Owns the core process of N frontends. `start()` once, then `check()` a few times a second."""

    def __init__(
        self, config: LaunchConfig, ipc_dir: str, num_clients: int, max_restarts: int = 3, *, index: int = 0
    ) -> None:
        """`index`: the data-parallel replica this core is (named in the log)."""
        if num_clients < 1:
            raise ValueError(f"num_clients must be at least 1, got {num_clients}")
        self.index = index
        self.config = config
        self.ipc_dir = ipc_dir
        self.num_clients = num_clients
        self.max_restarts = max_restarts
        self.gen = 0
        self.num_restarts = 0
        self.exhausted = False
        self.handle: ProcessCore | None = None

    @property
    def pid(self) -> int | None:
        return self.handle.pid if self.handle is not None else None

    def _publish(self, state: str, message: str = "") -> None:
        pid = self.handle.pid if self.handle is not None and self.handle.pid is not None else 0
        write_core_state(self.ipc_dir, CoreState(self.gen, pid, state, message, self.num_clients))

    def start(self, should_stop: Callable[[], bool] = lambda: False) -> Ready:
        """Starts generation `self.gen` and waits for its Ready; EngineStartupError (published as
        `failed`) when it reports a failure, exits, says nothing for the timeout, or `should_stop()`."""
        self.launch()
        return self.wait_ready(should_stop)

    def launch(self) -> None:
        """Starts generation `self.gen`'s process, not waiting for it (from a thread that outlives the
        core: it dies with the thread that started it)."""
        self.handle = None
        self._publish("starting")
        handle = ProcessCore(self.config, self.ipc_dir, self.gen, self.num_clients, status=True)
        handle.start()
        self.handle = handle

    def wait_ready(self, should_stop: Callable[[], bool] = lambda: False) -> Ready:
        """Waits for the launched generation's Ready (any thread); see `start`."""
        handle = self.handle
        assert handle is not None and handle.status_addr is not None
        try:
            ready, sock = connect_ready(
                handle, _READY_TIMEOUT_S, address=handle.status_addr, should_stop=should_stop
            )
        except EngineStartupError as exc:
            handle.stop(5)
            self._publish("failed", str(exc))
            raise
        sock.close(linger=0)
        self._publish("ready")
        logger.info(
            "engine core %d ready (pid %s, generation %d): %s, %d KV blocks, %d API servers",
            self.index,
            handle.pid,
            self.gen,
            ready.model_name,
            ready.num_blocks,
            self.num_clients,
        )
        return ready

    def check(self, should_stop: Callable[[], bool] = lambda: False) -> bool:
        """A dead core is reported (`down`) and restarted; False once it is down for good."""
        if self.exhausted:
            return False
        if self.handle is not None and self.handle.alive():
            return True
        why = self.handle.exit_description() if self.handle is not None else "engine core not started"
        logger.error("%s", why)
        self._publish("down", why)
        if self.handle is not None:
            self.handle.stop(1)  # reaps it
        while self.num_restarts < self.max_restarts and not should_stop():
            self.num_restarts += 1
            self.gen += 1
            logger.warning(
                "restarting engine core %d (%d/%d)", self.index, self.num_restarts, self.max_restarts
            )
            try:
                self.start(should_stop)
                return True
            except EngineStartupError as exc:
                logger.error("engine core restart failed: %s", exc)
        self.exhausted = True
        msg = f"the engine core is down and out of restarts ({self.max_restarts}): {why}"
        logger.error("%s", msg)
        self._publish("exhausted", msg)
        return False

    def stop(self, timeout: float = 10.0) -> None:
        """Asks the core to shut down (aborting what is left); terminates it if it does not exit."""
        if self.handle is not None:
            self.handle.stop(timeout)
        self._publish("stopped", "the server stopped")
