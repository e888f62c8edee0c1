"""The disk KV tier behind the host tier (`kv_offloading_disk_path`, `kv_offloading_disk_size`).

Every block the host tier stores is also written, by a worker thread, as one file
``PATH/<model key>/<block hash>.kv``: a header with the model key, the block's record (hash, parent hash,
tokens) and a CRC-32 over header, tokens and bytes, then the block's bytes on this rank (each layer's K and
V, as the host tier holds them). The model key is a hash of what makes KV bytes differ (the model's path
and weight files, its dtype, the KV dtype, the block size, the layers' shapes, the tensor-parallel rank and
size), so another model's or dtype's blocks are never looked at. The folder's index (hash -> file size, least
recently used first) is rebuilt from the file names at start-up, so blocks outlive a restart.

A request's blocks that neither the device pool nor the host tier holds are read when it is added (before
the scheduler admits it): each file is verified (header, record, length, checksum) and copied into a host
tier slot, and only then does the scheduler's host tier hold the block; a missing, corrupt or truncated
file ends the chain there (a miss, never a wrong answer), and a bad file is deleted. The admission then
loads those blocks as any host tier hit. Reads are synchronous (a disk hit costs its file reads at
`add_request`); writes are off the step.

With `record_events` on, the tier logs the blocks it comes to hold (a file written) and drops (evicted over
the bound, or deleted as bad), in order, for the engine's KV events (medium "DISK"); the blocks found at
start-up are announced from their files' headers (`held_records`). The disk tier runs with one rank
(`EngineConfig` refuses it under tensor parallelism).
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import struct
import threading
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagedrs.runner.host_tier import HostTierCaches

__all__ = ["DiskKVTier", "DiskTierLink", "model_key"]

logger = logging.getLogger(__name__)

_MAGIC = b"PGKVBLK1"
# magic, model key (sha256), hash, parent hash, tokens, payload bytes, crc32 (of the rest of the file).
_HEAD = struct.Struct("<8s32sQQIQI")
_GiB = 1 << 30


def model_key(
    model_path: str, model_dtype: torch.dtype, kv_dtype: torch.dtype, block_size: int,
    layer_shapes: Sequence[tuple[int, int]], tp_rank: int = 0, tp_size: int = 1,
) -> str:  # fmt: skip
    """A hex digest of what makes a block's KV bytes differ between engines; the weight files' sizes and
    modification times stand for the model's revision."""
    h = hashlib.sha256()
    path = os.path.realpath(model_path)
    h.update(
        f"{path}|{model_dtype}|{kv_dtype}|{block_size}|{list(layer_shapes)}|{tp_rank}/{tp_size}".encode()
    )
    if os.path.isdir(path):
        for name in sorted(os.listdir(path)):
            if name.endswith((".safetensors", ".bin", ".gguf", "config.json")):
                st = os.stat(os.path.join(path, name))
                h.update(f"|{name}:{st.st_size}:{st.st_mtime_ns}".encode())
    elif os.path.isfile(path):
        st = os.stat(path)
        h.update(f"|{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()


class DiskKVTier:
    """One rank's block files under ``root/key``, at most `max_bytes` of them (least recently used files
    are deleted first), written by a worker thread."""

    def __init__(self, root: str | Path, key: str, max_bytes: int) -> None:
        self.key = bytes.fromhex(key)
        self.folder = Path(root) / key
        self.folder.mkdir(parents=True, exist_ok=True)
        self.max_bytes = int(max_bytes)
        self._lock = threading.Lock()
        self._index: OrderedDict[int, int] = OrderedDict()  # hash -> file bytes, least recently used first
        self.used_bytes = 0
        self.blocks_written = self.blocks_read = self.blocks_rejected = self.blocks_evicted = 0
        # ("stored", hash, parent, tokens) / ("removed", hash) since the last take_events; None: not kept
        self._events: list[tuple[Any, ...]] | None = None
        files = []
        for p in self.folder.glob("*.kv"):
            try:
                files.append((p.stat().st_mtime_ns, int(p.stem, 16), p.stat().st_size))
            except (OSError, ValueError):
                continue
        for _, h, size in sorted(files):
            self._index[h] = size
            self.used_bytes += size
        with self._lock:
            self._evict_over_bound()
        self._jobs: queue.Queue[tuple[int, int, list[int], np.ndarray] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._write_loop, name="pagedrs-kv-disk", daemon=True)
        self._thread.start()

    def __len__(self) -> int:
        return len(self._index)

    def path_of(self, block_hash: int) -> Path:
        return self.folder / f"{block_hash:016x}.kv"

    def hashes(self) -> list[int]:
        """Held block hashes, least recently used first."""
        with self._lock:
            return list(self._index)

    def record_events(self, on: bool = True) -> None:
        """Start (with an empty log) or stop logging the blocks this tier comes to hold and drops."""
        with self._lock:
            self._events = [] if on else None

    def held_records(self) -> list[tuple[Any, ...]]:
        """``("stored", hash, parent, tokens)`` of every block held now, least recently used first, from
        the files' headers (a file whose header is not this tier's block is left out: a read rejects it)."""
        out = []
        for h in self.hashes():
            try:
                with open(self.path_of(h), "rb") as f:
                    head = f.read(_HEAD.size)
                    magic, key, fh, parent, ntok, _, _ = _HEAD.unpack(head)
                    if (magic, key, fh) != (_MAGIC, self.key, h):
                        continue
                    tokens = np.frombuffer(f.read(4 * ntok), dtype="<u4").tolist()
            except (OSError, struct.error, ValueError):
                continue
            if len(tokens) == ntok:
                out.append(("stored", h, parent, tokens))
        return out

    def take_events(self) -> list[tuple[Any, ...]]:
        """The logged changes since the last call, in order: ``("stored", hash, parent, tokens)`` for a
        block file written, ``("removed", hash)`` for one deleted."""
        with self._lock:
            if not self._events:
                return []
            out, self._events = self._events, []
            return out

    def put(self, block_hash: int, parent: int, tokens: Sequence[int], payload: np.ndarray) -> None:
        """Queue one block's file (`payload`: its bytes, a uint8 array this tier now owns)."""
        self._jobs.put((block_hash, parent, list(tokens), payload))

    def flush(self) -> None:
        """Wait until every queued block is written."""
        self._jobs.join()

    def close(self) -> None:
        self.flush()
        self._jobs.put(None)
        self._thread.join()

    def _write_loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                self._write(*job)
            except OSError as exc:
                logger.warning("disk KV tier: a block could not be written: %s", exc)
            finally:
                self._jobs.task_done()
        self._jobs.task_done()

    def _encode(self, block_hash: int, parent: int, tokens: list[int], payload: np.ndarray) -> list[bytes]:
        toks = np.asarray(tokens, dtype="<u4").tobytes()
        body = payload.tobytes()
        head = _HEAD.pack(_MAGIC, self.key, block_hash, parent, len(tokens), len(body), 0)[:-4]
        crc = zlib.crc32(body, zlib.crc32(toks, zlib.crc32(head)))
        return [head, struct.pack("<I", crc), toks, body]

    def _write(self, block_hash: int, parent: int, tokens: list[int], payload: np.ndarray) -> None:
        parts = self._encode(block_hash, parent, tokens, payload)
        size = sum(map(len, parts))
        if size > self.max_bytes:
            return
        path = self.path_of(block_hash)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            for part in parts:
                f.write(part)
        os.replace(tmp, path)  # a reader sees the whole file or none
        with self._lock:
            self.used_bytes += size - self._index.pop(block_hash, 0)
            self._index[block_hash] = size
            self.blocks_written += 1
            if self._events is not None:
                self._events.append(("stored", block_hash, parent, tokens))
            self._evict_over_bound()

    def _evict_over_bound(self) -> None:
        while self.used_bytes > self.max_bytes and self._index:
            h, size = self._index.popitem(last=False)
            self.used_bytes -= size
            self.blocks_evicted += 1
            self.path_of(h).unlink(missing_ok=True)
            if self._events is not None:
                self._events.append(("removed", h))

    def _drop(self, block_hash: int) -> None:
        with self._lock:
            size = self._index.pop(block_hash, None)
            if size is not None:
                self.used_bytes -= size
                self.path_of(block_hash).unlink(missing_ok=True)
                if self._events is not None:
                    self._events.append(("removed", block_hash))

    def get(self, block_hash: int, parent: int, tokens: Sequence[int], nbytes: int) -> np.ndarray | None:
        """The block's `nbytes` bytes, only if its file is whole and is exactly this block of this model;
        a file that is not is deleted (a miss)."""
        with self._lock:
            if block_hash not in self._index:
                return None
        try:
            data = self.path_of(block_hash).read_bytes()
        except OSError:
            self._drop(block_hash)
            return None
        toks = np.asarray(list(tokens), dtype="<u4").tobytes()
        n = _HEAD.size
        ok = len(data) == n + len(toks) + nbytes
        if ok:
            magic, key, h, p, ntok, size, crc = _HEAD.unpack_from(data)
            ok = (magic, key, h, p, ntok, size) == (_MAGIC, self.key, block_hash, parent, len(tokens), nbytes)
            ok = ok and data[n : n + len(toks)] == toks
            ok = ok and zlib.crc32(data[n:], zlib.crc32(data[: n - 4])) == crc
        if not ok:
            self.blocks_rejected += 1
            self._drop(block_hash)
            return None
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
        try:
            os.utime(self.path_of(block_hash))  # the order survives a restart
        except OSError:
            pass
        self.blocks_read += 1
        return np.frombuffer(data, dtype=np.uint8, offset=n + len(toks))


class DiskTierLink:
    """The disk tier between the scheduler's host tier index and this rank's host tier bytes: blocks the
    host tier stores go to disk, and a new request's blocks held on disk come back into host tier slots."""

    def __init__(
        self, disk: DiskKVTier, scheduler: Any, tier: HostTierCaches, device: torch.device, block_size: int
    ) -> None:
        self.disk = disk
        self.scheduler = scheduler
        self.tier = tier
        self.caches = tier.caches
        self.device = device
        self.block_size = block_size
        self.slot_bytes = sum(c[:, 0].numel() * c.element_size() for c in tier.caches)

    @classmethod
    def open(cls, config: Any, model_path: str, executor: Any, scheduler: Any) -> DiskTierLink | None:
        """The link of a single-rank engine with a host tier and `kv_offloading_disk_path`, else None."""
        cache = config.cache
        runner = getattr(executor, "runner", None)
        pool = getattr(runner, "kv_pool", None)
        if not cache.kv_offloading_disk_path or runner is None or pool is None or pool.tier is None:
            return None
        model_dtype = next(runner.model.parameters()).dtype
        key = model_key(model_path, model_dtype, pool.dtype, pool.block_size, pool.layer_shapes)
        disk = DiskKVTier(cache.kv_offloading_disk_path, key, int(cache.kv_offloading_disk_size * _GiB))
        logger.info("disk KV tier: %d blocks found in %s", len(disk), disk.folder)
        link = cls(disk, scheduler, pool.tier, pool.device, pool.block_size)
        executor.disk_tier = link
        return link

    def _slot_bytes(self, slot: int) -> np.ndarray:
        parts = [c[:, slot].contiguous().view(torch.uint8).reshape(-1) for c in self.caches if c.numel()]
        return torch.cat(parts).numpy()

    def _fill_slot(self, slot: int, data: np.ndarray) -> None:
        src = torch.from_numpy(data.copy())
        o = 0
        for c in self.caches:
            dst = c[:, slot]
            n = dst.numel() * dst.element_size()
            if n:
                dst.copy_(src[o : o + n].view(dst.dtype).view(dst.shape))
            o += n

    def stored(self, plan: Any) -> None:
        """After a plan ran, before the scheduler's update (the slots' records are still the plan's): each
        stored block's file is queued once its store into the host slot is done (on the tier's worker)."""
        if not len(plan.tier_store):
            return
        recs = [(int(s), self.scheduler.tier_record(int(s))) for s in plan.tier_store[:, 1].tolist()]
        recs = [(s, r) for s, r in recs if r is not None]
        if recs:
            self.tier.after(lambda: self._put(recs))

    def _put(self, recs: list[tuple[int, Any]]) -> None:
        for slot, (h, parent, tokens) in recs:
            self.disk.put(h, parent, tokens, self._slot_bytes(slot))

    def promote(self, seq_id: int, prompt: Sequence[int]) -> int:
        """Reads the request's blocks the disk holds (from the first block neither the device pool nor the
        host tier holds, in chain order, up to the first miss) into host tier slots; the blocks read."""
        chain = self.scheduler.tier_missing_chain(seq_id)
        if not chain or not len(self.disk):
            return 0
        bs, n = self.block_size, 0
        self.tier.flush()  # no store in flight writes a slot filled here
        synced = False
        for h, parent, i in chain:
            tokens = [int(t) for t in prompt[i * bs : (i + 1) * bs]]
            data = self.disk.get(h, parent, tokens, self.slot_bytes)
            if data is None:
                break
            if not synced and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # no copy of an earlier step still reads a slot
                synced = True
            slot = self.scheduler.tier_insert(h, parent, tokens)
            if slot is not None:  # None: the host tier holds it already
                self._fill_slot(int(slot), data)
                n += 1
        return n

    def close(self) -> None:
        self.tier.flush()  # the files of stores still in flight are queued first
        self.disk.close()
