"""Starting and watching the processes of ranks 1..N-1 (rank 0 is the engine core itself).

- `MpRanks`: one local process per rank, `python -m pagedrs.executor.rank_main` (a fresh interpreter,
  as multiprocessing's spawn gives, but without re-running the user's `__main__`: a script with no
  `if __name__ == "__main__"` guard still works). Each dies with its parent.
- `RayRanks`: one Ray actor per rank (on any node of the cluster), running the same `run_rank`.

Both expose the driver's `TPGroup` once every rank has joined, `failure()` (the first dead rank and
why) and `stop()`.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import torch

from pagedrs.distributed.group import TPGroup, connect_tp_group, create_store
from pagedrs.executor.rank import error_key

__all__ = [
    "COLLECTIVE_TIMEOUT_S",
    "MpRanks",
    "RankProcesses",
    "RayRanks",
    "RankFailure",
    "rank_devices",
]

logger = logging.getLogger("pagedrs.executor")

# A collective waits at most this long for a rank that neither answers nor dies (a dead rank's closed
# connection fails the collective at once).
COLLECTIVE_TIMEOUT_S = 120.0


class RankFailure(RuntimeError):
    """A tensor-parallel rank failed; `rank` names it."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(f"tensor-parallel rank {rank} failed: {message}")
        self.rank = rank


def rank_devices(device: torch.device, size: int) -> list[torch.device]:
    """The device of every rank: CPU for all, or consecutive GPUs from the configured one."""
    if device.type != "cuda":
        return [device] * size
    base = device.index or 0
    have = torch.cuda.device_count()
    if base + size > have:
        raise ValueError(
            f"tensor_parallel_size={size} needs {size} CUDA devices from cuda:{base}, "
            f"but only {have} are visible"
        )
    return [torch.device("cuda", base + r) for r in range(size)]


class RankProcesses:
    """What both launchers share: the store (hosted here, rank 0), joining the group, error reports."""

    def __init__(self, size: int, device: torch.device, host: str) -> None:
        self.size = size
        self.host = host
        self.store = create_store(host, 0, 0, size, COLLECTIVE_TIMEOUT_S)
        self.port = int(self.store.port)
        self.device = device
        self.tp: TPGroup | None = None
        self.world: TPGroup | None = None  # liquid only: every rank, and the group of each degree
        self.groups: dict[int, TPGroup] = {}

    def abort_groups(self) -> None:
        if self.world is not None:
            from pagedrs.executor.liquid.shards import abort_groups

            abort_groups(self.world, self.groups)
        elif self.tp is not None:
            self.tp.abort()

    def connect(self, startup_timeout_s: float, liquid: bool = False) -> TPGroup:
        """Join the group as rank 0, failing early (with that rank's own error) if a rank dies first.
        `liquid`: the world group plus one group per active degree (`self.world`, `self.groups`); rank 0
        starts alone (`self.tp` is the degree-1 group)."""
        box: dict[str, Any] = {}

        def join() -> None:
            try:
                if liquid:
                    from pagedrs.executor.liquid.shards import connect_liquid_groups

                    self.world, self.groups = connect_liquid_groups(
                        self.store, 0, self.size, self.device, host=self.host, timeout_s=COLLECTIVE_TIMEOUT_S
                    )
                    box["tp"] = self.groups[1]
                    return
                box["tp"] = connect_tp_group(
                    self.store, 0, self.size, self.device, host=self.host, timeout_s=COLLECTIVE_TIMEOUT_S
                )
            except BaseException as exc:  # handed to the caller
                box["error"] = exc

        t = threading.Thread(target=join, name="tp-join", daemon=True)
        t.start()
        deadline = time.monotonic() + startup_timeout_s
        while t.is_alive():
            t.join(0.1)
            failure = self.failure()
            if failure is not None:
                raise failure
            if time.monotonic() > deadline:
                raise TimeoutError(f"tensor-parallel ranks did not join within {startup_timeout_s:.0f} s")
        if "error" in box:
            raise box["error"]
        self.tp = box["tp"]
        return self.tp

    def reported_error(self, rank: int) -> str | None:
        try:
            if self.store.check([error_key(rank)]):
                return self.store.get(error_key(rank)).decode(errors="replace")
        except Exception:  # the store may be gone during teardown
            return None
        return None

    def failure(self) -> RankFailure | None:
        raise NotImplementedError

    def stop(self, timeout_s: float = 5.0) -> None:
        raise NotImplementedError


class MpRanks(RankProcesses):
    """One local process per rank."""

    def __init__(
        self,
        launch_json: str,
        size: int,
        device: torch.device,
        log_level: str = "info",
        devices: list[torch.device] | None = None,
    ) -> None:
        super().__init__(size, device, "127.0.0.1")
        devices = devices or rank_devices(device, size)
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        for rank in range(1, size):
            cmd = [
                sys.executable,
                "-m",
                "pagedrs.executor.rank_main",
                "--rank",
                str(rank),
                "--world-size",
                str(size),
                "--host",
                self.host,
                "--port",
                str(self.port),
                "--device",
                str(devices[rank]),
                "--launch-config",
                launch_json,
                "--timeout",
                str(COLLECTIVE_TIMEOUT_S),
                "--parent-pid",
                str(os.getpid()),
                "--log-level",
                log_level,
            ]
            self.procs[rank] = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
        logger.info(
            "started %d tensor-parallel rank process(es): pids %s",
            size - 1,
            [p.pid for p in self.procs.values()],
        )

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs.values()]

    def failure(self) -> RankFailure | None:
        # A rank that raises writes its error to the store and exits: its exit is what is watched (a
        # waitpid per rank; the store is read only then, not on every step).
        for rank, proc in self.procs.items():
            code = proc.poll()
            if code is not None:
                why = self.reported_error(rank) or f"process {proc.pid} exited with code {code}"
                return RankFailure(rank, why)
        return None

    def stop(self, timeout_s: float = 5.0) -> None:
        deadline = time.monotonic() + timeout_s
        for proc in self.procs.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()


class RayRanks(RankProcesses):
    """Ray actors, one per rank, on whichever nodes Ray places them."""

    def __init__(self, launch_json: str, size: int, device: torch.device) -> None:
        ray = connect_ray("distributed_executor_backend")
        host = ray.util.get_node_ip_address()
        super().__init__(size, device, host)
        self._ray = ray
        use_gpu = device.type == "cuda"
        actor_cls = ray.remote(num_cpus=0 if use_gpu else 1, num_gpus=1 if use_gpu else 0)(_RayRank)
        self.actors = {r: actor_cls.remote() for r in range(1, size)}
        # Ray gives each GPU actor its own visible device: cuda:0 inside the actor.
        dev = "cuda:0" if use_gpu else "cpu"
        self.refs = {
            r: a.run.remote(r, size, host, self.port, launch_json, dev, COLLECTIVE_TIMEOUT_S)
            for r, a in self.actors.items()
        }
        logger.info("started %d tensor-parallel Ray actor(s) (store at %s:%d)", size - 1, host, self.port)

    def failure(self) -> RankFailure | None:
        ray = self._ray
        done, _ = ray.wait(list(self.refs.values()), num_returns=len(self.refs), timeout=0)
        for rank, ref in self.refs.items():
            if ref in done:
                why = self.reported_error(rank)
                if why is None:
                    try:
                        ray.get(ref)
                        why = "actor exited"
                    except Exception as exc:  # the actor's error or its death
                        why = f"{type(exc).__name__}: {exc}"
                return RankFailure(rank, why)
        return None

    def stop(self, timeout_s: float = 5.0) -> None:
        ray = self._ray
        try:
            ray.wait(list(self.refs.values()), num_returns=len(self.refs), timeout=timeout_s)
        except Exception:  # best effort
            pass
        for actor in self.actors.values():
            try:
                ray.kill(actor)
            except Exception:  # already gone
                pass


def _check_reachable(address: str | None, timeout_s: float = 5.0) -> None:
    """Ray waits minutes on a head node that is not there; a plain host:port is tried first."""
    if not address or address == "auto" or "://" in address or ":" not in address:
        return
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot reach the Ray cluster at {address} (RAY_ADDRESS): {exc}") from None


class _RayRank:
    """Body of a Ray actor (decorated with `ray.remote` at run time, so Ray stays optional)."""

    def run(
        self, rank: int, size: int, host: str, port: int, args_json: str, device: str, timeout: float
    ) -> int:
        from pagedrs.executor.rank import run_rank

        logging.basicConfig(level=logging.INFO, format=f"%(levelname)s [rank {rank}] %(message)s")
        run_rank(rank, size, host, port, args_json, device, timeout)
        return rank


def connect_ray(setting: str) -> Any:
    """The `ray` module, connected to the cluster in `RAY_ADDRESS` (or a local instance started here);
    ValueError naming `setting` when Ray is missing, and the address when it cannot be reached."""
    try:
        import ray
    except ImportError as exc:
        raise ValueError(f"{setting}='ray' needs Ray: pip install 'pagedrs[ray]' (or use 'mp')") from exc
    if not ray.is_initialized():
        address = os.environ.get("RAY_ADDRESS")
        _check_reachable(address)
        try:
            ray.init(address=address, ignore_reinit_error=True, log_to_driver=True)
        except Exception as exc:  # a cluster that cannot be reached
            hint = ""
            if address and os.environ.get("RAY_AUTH_MODE") != "token":
                hint = " (a cluster with token authentication needs RAY_AUTH_MODE=token and its token here)"
            raise ValueError(
                f"cannot connect to the Ray cluster at {address or '(local)'}: {exc}{hint}"
            ) from exc
    return ray
