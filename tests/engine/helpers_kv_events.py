"""A KV-event subscriber as an external router writes one against vLLM: vLLM's schema declared here as
msgspec structs (from `vllm/distributed/kv_events.py`, not imported from pagedrs), a SUB socket for the
stream and a DEALER socket for the replay endpoint; it keeps each data-parallel rank's set of cached block
hashes."""

from __future__ import annotations

import socket
import time
from typing import Any

import msgspec
import zmq


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


END_SEQ = -1


def free_tcp_ports(n: int) -> int:
    """A port p with p..p+n-1 free on the loopback interface (a moment ago)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports")


class Subscriber:
    """Applies batches in sequence order; a gap (or a late start) is filled from the replay endpoint."""

    def __init__(self, endpoint: str | None, replay_endpoint: str | None, topic: str = "") -> None:
        ctx = zmq.Context.instance()
        self.decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.sub: zmq.Socket[bytes] | None = None
        if endpoint is not None:
            self.sub = ctx.socket(zmq.SUB)
            self.sub.connect(endpoint)
            self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.replay_endpoint = replay_endpoint
        self.next_seq = 0
        self.cached: dict[int, set[int]] = {}  # data-parallel rank -> cached block hashes
        self.groups: dict[int | None, set[int]] = {}  # KV-cache group -> its cached block hashes
        self.batches: list[KVEventBatch] = []
        self.replayed = 0  # batches that came from the replay endpoint
        self.topics: set[bytes] = set()

    def apply(self, seq: int, batch: KVEventBatch) -> None:
        if seq < self.next_seq:
            return  # already applied (a replay overlapping the stream)
        assert seq == self.next_seq, f"batch {seq} applied before {self.next_seq}"
        self.next_seq = seq + 1
        self.batches.append(batch)
        blocks = self.cached.setdefault(batch.data_parallel_rank or 0, set())
        for ev in batch.events:
            if isinstance(ev, AllBlocksCleared):
                blocks.clear()
                self.groups.clear()
            elif isinstance(ev, BlockRemoved):
                blocks.difference_update(ev.block_hashes)
                group = self.groups.setdefault(ev.group_idx, set())
                if ev.group_idx is not None:
                    assert group.issuperset(ev.block_hashes), (
                        f"group {ev.group_idx} removes what it never stored"
                    )
                group.difference_update(ev.block_hashes)
            else:
                blocks.update(ev.block_hashes)
                self.groups.setdefault(ev.group_idx, set()).update(ev.block_hashes)

    def replay(self, start: int) -> list[tuple[int, KVEventBatch]]:
        """The buffered batches from `start` on, as the replay endpoint streams them (a DEALER socket:
        one request, many replies, each ``[b"", seq, payload]``, the last with seq -1)."""
        assert self.replay_endpoint is not None
        req = zmq.Context.instance().socket(zmq.DEALER)
        req.connect(self.replay_endpoint)
        out = []
        try:
            req.send_multipart((b"", start.to_bytes(8, "big")))
            while True:
                if not req.poll(5000):
                    raise AssertionError("the replay endpoint did not answer")
                _, seq_bytes, payload = req.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq == END_SEQ:
                    return out
                out.append((seq, self.decoder.decode(payload)))
        finally:
            req.close(linger=0)

    def catch_up(self, start: int) -> None:
        for seq, batch in self.replay(start):
            if seq >= self.next_seq:
                self.replayed += 1
                self.apply(seq, batch)

    def poll(self, timeout_ms: int = 50) -> int:
        """Applies what arrived on the stream; returns how many batches."""
        assert self.sub is not None
        n = 0
        while self.sub.poll(timeout_ms):
            topic, seq_bytes, payload = self.sub.recv_multipart()
            self.topics.add(topic)
            seq = int.from_bytes(seq_bytes, "big")
            if seq > self.next_seq and self.replay_endpoint is not None:
                self.catch_up(self.next_seq)
            self.apply(seq, self.decoder.decode(payload))
            n += 1
            timeout_ms = 10
        return n

    def wait_for(self, rank: int, want: set[int], timeout: float = 10.0) -> set[int]:
        """Polls until rank `rank`'s set is `want` (or the time is up); returns the set."""
        deadline = time.monotonic() + timeout
        while self.cached.get(rank, set()) != want and time.monotonic() < deadline:
            self.poll()
        return self.cached.get(rank, set())

    def close(self) -> None:
        if self.sub is not None:
            self.sub.close(linger=0)
