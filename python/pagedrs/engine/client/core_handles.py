"""Where an engine core runs, seen from the frontend: its own process (`ProcessCore`, what the server uses),
a thread of this process (`ThreadCore`, for an `LLMEngine` or a stand-in core handed to the server), or a
process started and restarted by a supervisor that several API server processes share (`RemoteCore`,
`--api-server-count N`). All speak the same ZeroMQ + msgspec channel (`core.proc`), so the frontend code
is one."""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Protocol

import msgspec
import zmq

from pagedrs.engine.core.messages import Ready, Shutdown, StartupFailed, output_decoder
from pagedrs.engine.core.proc import CoreLike, EngineCoreProc
from pagedrs.launch_config import LaunchConfig

__all__ = [
    "CoreHandle",
    "CoreState",
    "EngineStartupError",
    "ProcessCore",
    "RemoteCore",
    "ThreadCore",
    "read_core_state",
    "wait_ready",
    "write_core_state",
]

logger = logging.getLogger("pagedrs.core_handles")


class EngineStartupError(RuntimeError):
    """The engine core did not come up (load failure, crash, timeout); the message says why."""


class CoreHandle(Protocol):
    input_addr: str
    output_addrs: list[str]

    def start(self) -> None: ...
    def alive(self) -> bool: ...
    def exit_description(self) -> str: ...
    def stop(self, timeout: float) -> None: ...
    def kill(self) -> bool:
        """Kills a core that is alive but stuck (True), or says it cannot (False: not its process)."""
        ...


def _addresses(ipc_dir: str, gen: int, num_clients: int) -> tuple[str, list[str]]:
    base = f"ipc://{ipc_dir}/core{gen}"
    return f"{base}-in", [f"{base}-out{i}" for i in range(num_clients)]


def status_address(ipc_dir: str, gen: int) -> str:
    """Where a supervised core announces Ready / StartupFailed to its supervisor."""
    return f"ipc://{ipc_dir}/core{gen}-status"


class ProcessCore:
    """`python -m pagedrs.engine.core.proc` with the core's config as JSON; it dies with this process.
    With `status=True` it also announces Ready / StartupFailed on `status_address` (for a supervisor that
    does not read step messages)."""

    def __init__(
        self, config: LaunchConfig, ipc_dir: str, gen: int, num_clients: int = 1, *, status: bool = False
    ) -> None:
        self.config = config
        self.input_addr, self.output_addrs = _addresses(ipc_dir, gen, num_clients)
        self.status_addr = status_address(ipc_dir, gen) if status else None
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        cmd = [sys.executable, "-m", "pagedrs.engine.core.proc", "--input", self.input_addr]
        for addr in self.output_addrs:
            cmd += ["--output", addr]
        if self.status_addr is not None:
            cmd += ["--status", self.status_addr]
        cmd += ["--config", self.config.to_json(), "--parent-pid", str(os.getpid())]
        level = logging.getLevelName(logging.getLogger("pagedrs").getEffectiveLevel())
        cmd += ["--log-level", str(level).lower()]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
        _LIVE.add(self.proc)
        logger.info("engine core process started (pid %d)", self.proc.pid)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exit_description(self) -> str:
        if self.proc is None:
            return "engine core not started"
        rc = self.proc.poll()
        if rc is None:
            return f"engine core (pid {self.proc.pid}) is running"
        how = f"killed by signal {-rc}" if rc < 0 else f"exited with code {rc}"
        return f"engine core process (pid {self.proc.pid}) {how}"

    def kill(self) -> bool:
        """SIGKILL (a stopped or deadlocked process cannot shut down by itself) and reaps it."""
        if self.proc is None:
            return False
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        return True

    def stop(self, timeout: float) -> None:
        """Asks the core to shut down and waits; terminates, then kills, one that does not exit."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(zmq.ZMQError):
                send_shutdown(self.input_addr)
        for sig in (None, proc.terminate, proc.kill):
            if sig is not None:
                with contextlib.suppress(ProcessLookupError):
                    sig()
            try:
                proc.wait(timeout if sig is None else 5)
                break
            except subprocess.TimeoutExpired:
                continue
        _LIVE.discard(proc)


class ThreadCore:
    """A core object (an `EngineCore`, or anything with its methods) run by `EngineCoreProc` in a thread."""

    def __init__(self, core: CoreLike, ipc_dir: str, gen: int, num_clients: int = 1) -> None:
        self.core = core
        self.input_addr, self.output_addrs = _addresses(ipc_dir, gen, num_clients)
        self.proc = EngineCoreProc(self.input_addr, self.output_addrs)
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def start(self) -> None:
        self.proc.bind()
        self.thread = threading.Thread(target=self._run, name="pagedrs-engine-core", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            if self.proc.run(self.core):
                self.error = RuntimeError("the engine's executor died (see the log)")
        except BaseException as exc:  # reported as the core's death
            logger.exception("engine core thread failed")
            self.error = exc
        finally:
            self.proc.close()
            shutdown = getattr(self.core, "shutdown", None)
            if shutdown is not None:
                shutdown()

    def alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def exit_description(self) -> str:
        if self.error is not None:
            return f"engine core thread failed: {self.error!r}"
        return "engine core thread stopped"

    def kill(self) -> bool:
        return False  # a thread of this process cannot be killed

    def stop(self, timeout: float) -> None:
        self.proc.stop()
        if self.thread is not None:
            self.thread.join(timeout)


class CoreState(msgspec.Struct):
    """What a supervisor says of its core (`core-state.json` in the private ipc dir): generation, pid and
    state: starting | ready | down (it died; restarting) | failed (this generation did not start) |
    exhausted (out of restarts) | stopped."""

    gen: int
    pid: int
    state: str
    message: str = ""
    num_clients: int = 1


_STATE_FILE = "core-state.json"


def write_core_state(ipc_dir: str, state: CoreState) -> None:
    path = os.path.join(ipc_dir, _STATE_FILE)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(msgspec.json.encode(state))
    os.replace(tmp, path)  # readers see the old state or the new one, never half of one


def read_core_state(ipc_dir: str) -> CoreState | None:
    try:
        with open(os.path.join(ipc_dir, _STATE_FILE), "rb") as f:
            return msgspec.json.decode(f.read(), type=CoreState)
    except (OSError, msgspec.DecodeError, json.JSONDecodeError):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (dead, not yet reaped by the supervisor) is dead
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


class RemoteCore:
    """A core that a supervisor process starts and restarts (`--api-server-count N`); this frontend is
    client `client_index` of it. `start()` waits for the supervisor's generation `gen` or a later one;
    `stop()` leaves the core alone (the supervisor stops it when every frontend is gone)."""

    def __init__(self, ipc_dir: str, gen: int, client_index: int, supervisor_pid: int | None = None) -> None:
        self.ipc_dir = ipc_dir
        self.gen = gen
        self.client_index = client_index
        self.supervisor_pid = supervisor_pid if supervisor_pid is not None else os.getppid()
        self.pid: int | None = None
        self.input_addr = ""
        self.output_addrs: list[str] = []

    def start(self, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = read_core_state(self.ipc_dir)
            if st is not None and st.gen >= self.gen and st.state != "starting":
                self.gen = st.gen
                if st.state != "ready":  # down, failed, exhausted, stopped
                    raise EngineStartupError(f"the engine core failed to start: {st.message or st.state}")
                if not 0 <= self.client_index < st.num_clients:
                    raise EngineStartupError(
                        f"client index {self.client_index} is not one of the core's {st.num_clients}"
                    )
                self.pid = st.pid
                self.input_addr, self.output_addrs = _addresses(self.ipc_dir, st.gen, st.num_clients)
                return
            if not _pid_alive(self.supervisor_pid):
                raise EngineStartupError("the server's supervisor process is gone")
            time.sleep(0.05)
        raise EngineStartupError(f"the engine core did not become ready within {timeout:.0f}s")

    def alive(self) -> bool:
        return self.pid is not None and _pid_alive(self.pid)

    def exit_description(self) -> str:
        if self.pid is None:
            return "engine core not started"
        st = read_core_state(self.ipc_dir)
        if st is not None and st.pid == self.pid and st.state != "ready" and st.message:
            return st.message
        if self.alive():
            return f"engine core (pid {self.pid}) is running"
        return f"engine core process (pid {self.pid}) exited"

    def stop(self, timeout: float) -> None:
        return None

    def kill(self) -> bool:
        return False  # the supervisor process owns the core


def wait_ready(handle: CoreHandle, timeout: float, client_index: int = 0) -> Ready:
    """Block until the core says Ready on this client's output socket; EngineStartupError if it reports a
    failure, exits, or says nothing for `timeout` seconds."""
    ready, sock = connect_ready(handle, timeout, client_index)
    sock.close(linger=0)
    return ready


def connect_ready(
    handle: CoreHandle,
    timeout: float,
    client_index: int = 0,
    *,
    address: str | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> tuple[Ready, zmq.Socket]:
    """`wait_ready`, keeping the output socket it read Ready from: the caller goes on reading the step
    messages from it. (A second socket on the same address would be a second PUSH peer, and the core's
    round robin could hand a step message to the one being closed.) `address` reads another socket (a
    supervisor's status socket); `should_stop()` gives up early."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address or handle.output_addrs[client_index])
    decoder = output_decoder()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if sock.poll(100):
                msg = decoder.decode(sock.recv())
                if isinstance(msg, Ready):
                    return msg, sock
                if isinstance(msg, StartupFailed):
                    raise EngineStartupError(f"the engine core failed to start: {msg.message}")
                continue
            if not handle.alive():
                raise EngineStartupError(f"the engine core failed to start: {handle.exit_description()}")
            if should_stop is not None and should_stop():
                raise EngineStartupError("the server is stopping")
        raise EngineStartupError(f"the engine core did not become ready within {timeout:.0f}s")
    except BaseException:
        sock.close(linger=0)
        raise


def send_shutdown(input_addr: str) -> None:
    """Ask a core to stop (a short-lived socket: the caller's event loop may be gone)."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUSH)
    try:
        sock.connect(input_addr)
        sock.send(msgspec.msgpack.encode(Shutdown()))
    finally:
        sock.close(linger=1000)


_LIVE: set[subprocess.Popen[bytes]] = set()


@atexit.register
def _kill_children() -> None:
    # Last line of defence: no core process outlives the frontend that started it.
    for proc in list(_LIVE):
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
