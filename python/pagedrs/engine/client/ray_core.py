"""An engine core run by a Ray actor (`--data-parallel-backend ray`), on any node of the cluster in
`RAY_ADDRESS` (a local Ray instance when unset): `RayCore` has `ProcessCore`'s interface, so the frontend,
its restart path and a supervisor drive it the same way.

Placement follows vLLM's Ray data parallelism: each core gets its own placement group, STRICT_PACK (one
node), bundle 0 for the core (rank 0 of its tensor-parallel group) and, under the `ray` executor, one bundle
per other rank; the rank actors the core starts are captured by the group, so a replica never straddles
nodes. Under the `mp` executor the ranks are the core's child processes and bundle 0 holds them all.

The core binds TCP sockets on its node's IP (an ephemeral port each), not ipc paths: the frontend may be on
another node. The channel is the same ZeroMQ + msgspec one (`core.proc`); Ray carries only the core's
config as JSON and the addresses back. The actor's end is watched through the reference of its `run`
call, which resolves when the core returns or the actor dies; `stop()` kills the actor and removes its
placement group."""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

import zmq

from pagedrs.engine.client.core_handles import EngineStartupError, send_shutdown
from pagedrs.engine.core.proc import EngineCoreProc, serve_core
from pagedrs.executor.rank_processes import connect_ray as rank_connect_ray
from pagedrs.launch_config import LaunchConfig

__all__ = ["RayCore", "connect_ray", "core_bundles"]

logger = logging.getLogger("pagedrs.ray_core")

_PLACEMENT_TIMEOUT_S = 300.0  # a cluster without room for the bundles
_BIND_TIMEOUT_S = 120.0  # the actor's process starts and binds its sockets


def connect_ray() -> Any:
    """The `ray` module, connected to the cluster in `RAY_ADDRESS` (or a local instance started here)."""
    return rank_connect_ray("data_parallel_backend")


def core_bundles(config: LaunchConfig, use_gpu: bool) -> list[dict[str, float]]:
    """The placement group of one core: bundle 0 for the core (with its `mp` ranks), then one bundle per
    Ray rank actor (`RayRanks` asks 1 CPU on CPU, 1 GPU and no CPU on GPUs). CPU counts are the torch
    threads of a rank (`num_threads`, 1 when unset): Ray sets OMP_NUM_THREADS to the CPUs it grants."""
    tp = config.parallel.tensor_parallel_size
    threads = config.device.num_threads or 1
    ray_ranks = tp - 1 if config.parallel.backend == "ray" else 0
    local = tp - ray_ranks  # ranks in the core's own process tree
    core: dict[str, float] = {"CPU": 1.0, "GPU": float(local)} if use_gpu else {"CPU": float(threads * local)}
    rank: dict[str, float] = {"GPU": 1.0} if use_gpu else {"CPU": float(threads)}
    return [core] + [dict(rank) for _ in range(ray_ranks)]


def _uses_gpu(config: LaunchConfig, ray: Any) -> bool:
    if config.device_name == "auto":
        return float(ray.cluster_resources().get("GPU", 0)) > 0
    return config.device.device.type == "cuda"


class RayCore:
    """An engine core in a Ray actor; same constructor as `ProcessCore` (`ipc_dir` is unused: the sockets
    are TCP, known once the actor has bound them in `start()`)."""

    def __init__(
        self,
        config: LaunchConfig,
        ipc_dir: str = "",
        gen: int = 0,
        num_clients: int = 1,
        *,
        status: bool = False,
        placement_timeout_s: float = _PLACEMENT_TIMEOUT_S,
    ) -> None:
        if num_clients < 1:
            raise ValueError(f"num_clients must be at least 1, got {num_clients}")
        self.config = config
        self.generation = gen
        self.num_clients = num_clients
        self.status = status
        self.placement_timeout_s = placement_timeout_s
        self.input_addr = ""
        self.output_addrs: list[str] = []
        self.status_addr: str | None = None
        self.pid: int | None = None  # of the actor's process, on its node
        self.node_ip: str | None = None
        self.bundles: list[dict[str, float]] = []
        self._ray: Any = None
        self._pg: Any = None
        self._actor: Any = None
        self._run_ref: Any = None

    def start(self) -> None:
        """Places the core's bundles, starts its actor there and waits for its sockets (not for the model:
        the caller waits for Ready). EngineStartupError, with nothing left behind, when the cluster has no
        room or the actor does not come up."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray = self._ray = connect_ray()
        use_gpu = _uses_gpu(self.config, ray)
        # Ray gives the actor its GPUs as cuda:0.. (CUDA_VISIBLE_DEVICES); "auto" is decided by the cluster.
        config = self.config.on_device("cuda" if use_gpu else "cpu")
        self.bundles = core_bundles(config, use_gpu)
        self._pg = placement_group(self.bundles, strategy="STRICT_PACK")
        placed, _ = ray.wait([self._pg.ready()], timeout=self.placement_timeout_s)
        if not placed:
            self._release()
            raise EngineStartupError(
                f"no node of the Ray cluster has {self.bundles} free for an engine core within "
                f"{self.placement_timeout_s:.0f}s (free now: {ray.available_resources()})"
            )
        core = self.bundles[0]
        self._actor = (
            ray.remote(_CoreActor)
            .options(
                num_cpus=core.get("CPU", 0.0),
                num_gpus=core.get("GPU", 0.0),
                max_restarts=0,  # the frontend restarts a core, with a fresh generation
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._pg,
                    placement_group_bundle_index=0,
                    placement_group_capture_child_tasks=True,  # the core's Ray ranks join its group
                ),
            )
            .remote()
        )
        try:
            bound = ray.get(self._actor.bind.remote(self.num_clients, self.status), timeout=_BIND_TIMEOUT_S)
        except Exception as exc:  # the actor did not start, or could not bind
            self._release()
            raise EngineStartupError(
                f"the engine core's Ray actor did not start: {_first_line(exc)}"
            ) from exc
        self.input_addr, self.output_addrs, self.status_addr, self.pid, self.node_ip = bound
        level = logging.getLevelName(logging.getLogger("pagedrs").getEffectiveLevel())
        self._run_ref = self._actor.run.remote(config.to_json(), str(level).lower())
        logger.info(
            "engine core Ray actor started (pid %s on %s, bundles %s, input %s)",
            self.pid,
            self.node_ip,
            self.bundles,
            self.input_addr,
        )

    def alive(self) -> bool:
        """False once the core's `run` has returned or its actor has died (a killed process, a lost node).
        A core seen dead gives its placement group back at once: a frontend restarting it starts a new
        handle and need not stop the old one."""
        if self._run_ref is None:
            return False
        done, _ = self._ray.wait([self._run_ref], timeout=0)
        if done:
            self._release()
        return not done

    def exit_description(self) -> str:
        if self._run_ref is None:
            return "engine core not started"
        where = f"engine core Ray actor (pid {self.pid} on {self.node_ip})"
        if self.alive():
            return f"{where} is running"
        try:
            code = self._ray.get(self._run_ref, timeout=1)
        except Exception as exc:  # the actor's death (RayActorError) or its error
            return f"{where} died: {type(exc).__name__}: {_first_line(exc)}"
        return f"{where} exited with code {code}"

    def kill(self) -> bool:
        """Kills the core's actor (a stuck core cannot shut down by itself); `alive()` then says so."""
        if self._actor is None:
            return False
        with contextlib.suppress(Exception):  # already gone
            self._ray.kill(self._actor, no_restart=True)
        with contextlib.suppress(Exception):  # the run ends with the actor's death
            self._ray.wait([self._run_ref], timeout=10)
        return True

    def stop(self, timeout: float) -> None:
        """Asks the core to shut down and waits up to `timeout`; then kills the actor (its rank actors die
        with it) and removes its placement group, whatever state it was in."""
        if self._actor is None:
            return
        if self.alive():
            with contextlib.suppress(zmq.ZMQError):
                send_shutdown(self.input_addr)
            with contextlib.suppress(Exception):  # the actor may die meanwhile
                self._ray.wait([self._run_ref], timeout=timeout)
        self._release()

    def _release(self) -> None:
        ray = self._ray
        if self._actor is not None:
            if self._run_ref is not None and ray.wait([self._run_ref], timeout=0)[0]:
                # The core returned (or died): a graceful exit, so a live actor is not killed while it
                # tears its sockets down (a SIGTERM traceback in the log); a dead one answers at once.
                with contextlib.suppress(Exception):
                    ray.wait([self._actor.__ray_terminate__.remote()], timeout=5)
            with contextlib.suppress(Exception):  # already gone
                ray.kill(self._actor, no_restart=True)
            self._actor = None
        if self._pg is not None:
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):  # already removed
                remove_placement_group(self._pg)
            self._pg = None

    @property
    def placement_group(self) -> Any:
        """The core's placement group while it runs (None once stopped)."""
        return self._pg

    @property
    def actor(self) -> Any:
        """The core's Ray actor handle while it runs (None once stopped)."""
        return self._actor


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


class _TcpCoreProc(EngineCoreProc):
    """`EngineCoreProc` bound on `tcp://IP:*`: after binding, its addresses are the ports the system chose."""

    def bind(self) -> None:
        super().bind()
        self.input_addr = _endpoint(self._in_sock)
        self.output_addrs = [_endpoint(s) for s in self._out_socks]
        if self._status_sock is not None:
            self.status_addr = _endpoint(self._status_sock)


def _endpoint(sock: Any) -> str:
    last = sock.getsockopt(zmq.LAST_ENDPOINT)
    return last.decode() if isinstance(last, bytes) else str(last)


class _CoreActor:
    """Body of the Ray actor (decorated with `ray.remote` at run time, so Ray stays optional): `bind` then
    `run`, called in that order (a Ray actor runs its calls one at a time)."""

    def __init__(self) -> None:
        self.proc: _TcpCoreProc | None = None

    def bind(self, num_clients: int, status: bool) -> tuple[str, list[str], str | None, int, str]:
        import ray

        ip = ray.util.get_node_ip_address()
        host = f"tcp://{ip}:*"
        self.proc = _TcpCoreProc(host, [host] * num_clients, status_addr=host if status else None)
        self.proc.bind()
        return self.proc.input_addr, self.proc.output_addrs, self.proc.status_addr, os.getpid(), ip

    def run(self, config_json: str, log_level: str) -> int:
        if self.proc is None:
            raise RuntimeError("bind() first")
        lvl = getattr(logging, log_level.upper(), logging.INFO)
        logging.basicConfig(
            level=lvl,
            format="%(levelname)s %(asctime)s [core] %(message)s",
            datefmt="%m-%d %H:%M:%S",
            force=True,
        )
        logging.getLogger("pagedrs").setLevel(lvl)
        return serve_core(self.proc, config_json)
