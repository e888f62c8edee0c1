"""A tensor-parallel group as an object: rank, size and two torch.distributed process groups.

- `device_pg`: collectives on the model's tensors (NCCL on CUDA, gloo on CPU): the row-parallel
  all-reduce, the vocab-parallel embedding's all-reduce, the logits gather to rank 0.
- `cpu_pg`: gloo, for host-side messages (the step broadcast, the block-count agreement). On CPU it
  is the same group as `device_pg`.

The groups are built from a `TCPStore` directly (`ProcessGroupGloo(store, rank, size, options)`), not
through `init_process_group`: an engine never touches the process's default group, so several
engines (or a user's own torch.distributed job) can live in one process.
"""

from __future__ import annotations

import datetime
import socket
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["TPGroup", "connect_tp_group", "create_store", "free_port"]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def create_store(host: str, port: int, rank: int, size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0 hosts the store (port 0: any free port, read it back from `.port`); the others join."""
    return dist.TCPStore(
        host,
        port,
        size,
        rank == 0,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def _gloo_group(store: Any, rank: int, size: int, host: str, timeout_s: float) -> Any:
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # in torch, missing from its stubs
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    return dist.ProcessGroupGloo(store, rank, size, opts)


def _nccl_group(store: Any, rank: int, size: int, timeout_s: float) -> Any:
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    return dist.ProcessGroupNCCL(store, rank, size, opts)


def connect_tp_group(
    store: Any, rank: int, size: int, device: torch.device, *, host: str, timeout_s: float
) -> TPGroup:
    """Join the group (blocks until every rank has joined, or `timeout_s`). `host` is the address this
    rank's gloo transport listens on (127.0.0.1 on one host)."""
    cpu_pg = _gloo_group(dist.PrefixStore("cpu", store), rank, size, host, timeout_s)
    if device.type == "cuda":
        device_pg = _nccl_group(dist.PrefixStore("nccl", store), rank, size, timeout_s)
    else:
        device_pg = cpu_pg
    return TPGroup(rank, size, device_pg=device_pg, cpu_pg=cpu_pg, store=store)


class TPGroup:
    """This rank's place in a tensor-parallel group. Size 1 has no process group and every collective
    is the identity, so layers built for one device pay nothing."""

    def __init__(
        self,
        rank: int = 0,
        size: int = 1,
        *,
        device_pg: Any = None,
        cpu_pg: Any = None,
        store: Any = None,
        positions: list[int] | None = None,
    ) -> None:
        if not isinstance(size, int) or size < 1 or not 0 <= rank < size:
            raise ValueError(f"tensor-parallel rank {rank} out of range for size {size}")
        self.rank = rank
        self.size = size
        self.device_pg = device_pg
        self.cpu_pg = cpu_pg
        self.store = store
        # positions[r]: which slice of every split tensor group rank r holds (its shard position). The
        # identity for plain tensor parallelism; a permutation under liquid scaling, where a rank keeps
        # the first half of its shards on scale-out and its new partner takes the second half.
        self.positions = list(positions) if positions is not None else list(range(size))
        if sorted(self.positions) != list(range(size)):
            raise ValueError(f"positions {self.positions} are not a permutation of range({size})")

    @property
    def position(self) -> int:
        """This rank's slice of every split tensor."""
        return self.positions[self.rank]

    def __repr__(self) -> str:
        return f"TPGroup(rank={self.rank}, size={self.size}, position={self.position})"

    @property
    def is_driver(self) -> bool:
        """Rank 0 samples and talks to the scheduler."""
        return self.rank == 0

    def _require(self, pg: Any, what: str) -> Any:
        if pg is None:
            raise RuntimeError(f"{what} needs a process group (tensor-parallel size {self.size})")
        return pg

    # ---- collectives on the model's tensors ---------------------------------------------------------
    def all_reduce(self, t: Tensor) -> Tensor:
        """Sum over ranks, in place."""
        if self.size > 1:
            self._require(self.device_pg, "all_reduce").allreduce([t]).wait()
        return t

    def gather_last_dim(self, t: Tensor) -> Tensor | None:
        """Every rank's `t` concatenated along the last dim, on rank 0 (None on the others)."""
        if self.size == 1:
            return t
        pg = self._require(self.device_pg, "gather")
        t = t.contiguous()
        parts = [[torch.empty_like(t) for _ in range(self.size)]] if self.is_driver else []
        opts = dist.GatherOptions()
        opts.rootRank = 0
        pg.gather(parts, [t], opts).wait()
        if not self.is_driver:
            return None
        by_position = [parts[0][self.positions.index(p)] for p in range(self.size)]
        return torch.cat(by_position, dim=-1)

    # ---- host-side messages ------------------------------------------------------------------------
    def broadcast_cpu(self, t: Tensor) -> Tensor:
        """Rank 0's CPU tensor into every rank's `t` (same shape and dtype everywhere)."""
        if self.size > 1:
            self._require(self.cpu_pg, "broadcast").broadcast(t, 0).wait()
        return t

    def min_cpu(self, values: list[int]) -> list[int]:
        """Element-wise minimum over ranks."""
        if self.size == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self._require(self.cpu_pg, "min").allreduce([t], opts).wait()
        return [int(x) for x in t.tolist()]

    def abort(self) -> None:
        """Tear the groups down after a peer failed (a plain destructor would terminate the process)."""
        for pg in {id(p): p for p in (self.device_pg, self.cpu_pg) if p is not None}.values():
            try:
                pg.abort()
            except Exception:  # best effort: the group is already broken
                pass
        self.device_pg = self.cpu_pg = None
