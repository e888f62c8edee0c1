"""The host KV tier's bytes on this rank, and the worker that stores blocks into it off the step.

As vLLM's CPU offloading worker, a step only enqueues its stores ((device block, slot) pairs): a worker
thread copies them while the step goes on (on CUDA it issues the copies on a side stream of its own, which
first waits for an event the step recorded, so the copies read the blocks as the last step left them). Two
rules keep the bytes right:

- a device block is not written while a store that reads it is in flight: before a step writes any block
  (its forward's slots, block moves, swap-ins, tier loads, copy-on-write copies) it waits for the stores
  reading one of them (`wait_blocks`);
- a slot is not read (a tier load) or written from elsewhere (a disk tier's block) while a store into it is
  in flight (`wait_slots`, `flush`).

Stores run in the order they were enqueued, and a callable queued after them (`after`: the disk tier's
file writes) runs once they are done.
"""

from __future__ import annotations

import collections
import contextlib
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from pagedrs.config import as_bytes

__all__ = ["HostTierCaches"]


def _index(values: np.ndarray, device: torch.device) -> Tensor:
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64)).to(device)


@dataclass
class _Job:
    """One queued store (device blocks `src` into slots `dst`) or callable (`fn`)."""

    src: np.ndarray
    dst: np.ndarray
    kv_caches: list[Tensor] = field(default_factory=list)
    device: torch.device = torch.device("cpu")
    ready: Any = None  # a CUDA event the step recorded: the copies wait for it
    fn: Callable[[], None] | None = None
    done: threading.Event = field(default_factory=threading.Event)


class HostTierCaches:
    """The host KV tier's bytes (one CPU tensor per layer, shaped as the device pool's) and the counts of
    blocks moved. Slots belong to the scheduler's tier index. `background=False` stores in the step."""

    def __init__(self, caches: list[Tensor], *, background: bool = True) -> None:
        self.caches = caches
        self.num_blocks = int(caches[0].shape[1])
        self.blocks_stored = 0
        self.blocks_loaded = 0
        self.background = background
        self._inflight: collections.deque[_Job] = collections.deque()
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._error: BaseException | None = None
        self._stream: Any = None
        self._thread: threading.Thread | None = None

    # ---- the step's side ---------------------------------------------------------------------------
    def store(self, kv_caches: list[Tensor], pairs: np.ndarray, device: torch.device) -> None:
        """(device block, slot) pairs: device pool -> tier, in order (a later pair may reuse a slot)."""
        if len(pairs) == 0:
            return
        self._raise()
        job = _Job(pairs[:, 0].copy(), pairs[:, 1].copy(), list(kv_caches), device)
        if not self.background:
            self._copy(job)
            return
        if device.type == "cuda":
            if self._stream is None:
                self._stream = torch.cuda.Stream(device)
            job.ready = torch.cuda.Event()
            job.ready.record()
        self._submit(job)

    def after(self, fn: Callable[[], None]) -> None:
        """Run `fn` once every store enqueued so far is in its slots (on the worker, or now)."""
        if not self.background:
            fn()
            return
        self._submit(_Job(np.zeros(0, np.int64), np.zeros(0, np.int64), fn=fn))

    def load(self, kv_caches: list[Tensor], pairs: np.ndarray, device: torch.device) -> None:
        """(slot, device block) pairs: tier -> device pool, once the stores into those slots are done."""
        if len(pairs) == 0:
            return
        self.wait_slots(pairs[:, 0])
        src = _index(pairs[:, 0], torch.device("cpu"))
        dst_dev = _index(pairs[:, 1], device)
        for kv, host in zip(map(as_bytes, kv_caches), map(as_bytes, self.caches), strict=True):
            kv[:, dst_dev] = host[:, src].to(device, non_blocking=True)
        self.blocks_loaded += len(pairs)

    def wait_blocks(self, blocks: np.ndarray) -> None:
        """Wait for the stores in flight that read one of these device blocks (and those before them)."""
        self._wait(lambda j: len(blocks) > 0 and bool(np.isin(j.src, blocks).any()))

    def wait_slots(self, slots: np.ndarray) -> None:
        """Wait for the stores in flight into one of these slots (and those before them)."""
        self._wait(lambda j: len(slots) > 0 and bool(np.isin(j.dst, slots).any()))

    def flush(self) -> None:
        """Wait for everything queued."""
        self._wait(lambda j: True)

    def close(self) -> None:
        """Finish the queued work and stop the worker."""
        if self._thread is not None:
            self.flush()
            self._jobs.put(None)
            self._thread.join()
            self._thread = None

    @property
    def in_flight(self) -> int:
        """Queued jobs not done yet."""
        self._prune()
        return len(self._inflight)

    def _prune(self) -> None:
        while self._inflight and self._inflight[0].done.is_set():
            self._inflight.popleft()

    def _wait(self, hits: Callable[[_Job], bool]) -> None:
        self._prune()
        last = next((j for j in reversed(self._inflight) if hits(j)), None)
        if last is not None:
            last.done.wait()  # in order: every job before it is done too
            self._prune()
        self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError("the host KV tier's store worker failed") from err

    def _submit(self, job: _Job) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="pagedrs-kv-tier", daemon=True)
            self._thread.start()
        self._inflight.append(job)
        self._jobs.put(job)

    # ---- the worker --------------------------------------------------------------------------------
    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                if job.fn is not None:
                    job.fn()
                else:
                    self._copy(job)
            except BaseException as exc:  # handed to the step, which raises it
                self._error = exc
            finally:
                job.done.set()

    @torch.inference_mode()
    def _copy(self, job: _Job) -> None:
        stream = self._stream if job.ready is not None else None
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            if stream is not None:
                stream.wait_event(job.ready)
            src = _index(job.src, job.device)
            dst = _index(job.dst, torch.device("cpu"))
            for kv, host in zip(map(as_bytes, job.kv_caches), map(as_bytes, self.caches), strict=True):
                host[:, dst] = kv[:, src].to("cpu")  # a copy to pageable memory: done on return
        self.blocks_stored += len(job.src)
