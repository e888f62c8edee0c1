"""Prefix-cache (KV) events out of the engine core, for routers: the step message's net change
(`KVCacheEvents`, read by the data-parallel router) and vLLM's KV-event stream on ZeroMQ for external
routers (llm-d, Dynamo, SGLang's gateway).

The wire format is vLLM's (`vllm/distributed/kv_events.py`): each message is a multipart
``[topic, sequence number (8 bytes, big-endian), payload]``, the payload a msgpack-encoded `KVEventBatch`
(`ts`, `events`, `data_parallel_rank`) whose events are tagged, array-like `BlockStored`, `BlockRemoved`
and `AllBlocksCleared`. Block hashes are the scheduler's chained u64 hashes (`prefix_hashes`); a block
that starts a prompt has no parent (`parent_block_hash` None). A ROUTER socket at the replay endpoint
answers a request (the first wanted sequence number, 8 bytes big-endian) with every buffered batch from
there, ``[seq, payload]`` each, then ``[-1, b""]``, as vLLM's `ZmqEventPublisher` does.

Publishing never blocks the step: the step thread drains the scheduler's events and queues them; a
publisher thread builds the events, encodes and sends them. A full queue drops the batch (its sequence
number is skipped, so a subscriber sees the gap) and logs a warning.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from pagedrs import _core
from pagedrs.config import KVEventsConfig
from pagedrs.engine.core.messages import KVCacheEvents
from pagedrs.engine.core.prefix_hashes import lora_salt_of

if TYPE_CHECKING:
    from pagedrs.lora_request import LoRARequest

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventGroup",
    "KVEventBatch",
    "KVEventsTap",
    "ZmqEventPublisher",
    "disk_events",
    "event_groups",
    "net_of_log",
    "offset_endpoint_port",
    "to_vllm_events",
]

logger = logging.getLogger("pagedrs.engine")

STORED, REMOVED, CLEARED = 0, 1, 2  # `_core.KVEvents.kinds`
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class _KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """vLLM's `KVCacheEvent`: the tag is the class name."""


class BlockStored(_KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    # vLLM's later fields, in its order (omitted at their defaults): the KV-cache group the blocks are in,
    # with its kind and window, set where the model has groups of its own (sliding-window pools).
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(_KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(_KVCacheEvent):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
# One step's events of each published pool, with its medium (None: the device pool's), as the scheduler
# recorded them or (a disk tier's) as vLLM's events already.
_Part = tuple["EventGroup | None", "_core.KVEvents | list[KVEvent]", "str | None"]
_Parts = Sequence[_Part]

HOST_TIER_MEDIUM, DISK_TIER_MEDIUM = "CPU", "DISK"  # vLLM's mediums of its CPU offloading tier, and disk


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


@dataclass(frozen=True)
class EventGroup:
    """A KV pool whose events are published, as vLLM names its KV-cache group: its index among the
    published pools, its spec's kind (`full_attention`, `sliding_window`, `mamba` for recurrent state)
    and window."""

    group_idx: int
    kind: str
    window: int | None = None


def event_groups(pool_labels: list[str]) -> list[EventGroup]:
    """The published pools of a model whose KV pools are `pool_labels` (the engine core's: `full` for the
    full-attention pool when some layer stores KV in it, then `window:W` per group), in that order; none
    for a model with only the full-attention pool (its events carry no group, as before)."""
    if pool_labels == ["full"]:
        return []
    out = []
    for i, label in enumerate(pool_labels):
        kind, _, window = label.partition(":")
        # vLLM's spec kinds; its name for a recurrent-state (linear-attention) group is "mamba"
        spec = {"full": "full_attention", "window": "sliding_window", "recurrent": "mamba"}.get(kind, kind)
        out.append(EventGroup(i, spec, int(window or 0) or None))
    return out


def to_vllm_events(
    ev: _core.KVEvents, lora_ids: dict[int, int], medium: str, group: EventGroup | None = None
) -> list[KVEvent]:
    """The scheduler's events as vLLM's, in order: consecutive blocks of one chain in one BlockStored
    (its parent the first block's parent, None at the start of a prompt), consecutive evictions in one
    BlockRemoved. `lora_ids`: extra key -> LoRA adapter id; `group`: the KV-cache group of the pool the
    events are from (None: the model's only pool)."""
    idx = group.group_idx if group is not None else None
    spec = (group.kind, group.window) if group is not None else (None, None)
    kinds, hashes = ev.kinds.tolist(), ev.hashes.tolist()
    parents, keys, tokens = ev.parents.tolist(), ev.extra_keys.tolist(), ev.tokens.tolist()
    out: list[KVEvent] = []
    roots: dict[int, int] = {}
    row = 0
    for kind, h, parent, key in zip(kinds, hashes, parents, keys, strict=True):
        last = out[-1] if out else None
        if kind == STORED:
            toks = tokens[row]
            row += 1
            if isinstance(last, BlockStored) and last.block_hashes[-1] == parent:
                last.block_hashes.append(h)
                last.token_ids.extend(toks)
                continue
            root = roots.get(key)
            if root is None:
                root = roots[key] = _core.prefix_root_hash(key)
            first = None if parent == root else parent
            lora = lora_ids.get(key)
            out.append(BlockStored([h], first, toks, ev.block_size, lora, medium, None, None, idx, *spec))
        elif kind == REMOVED:
            if isinstance(last, BlockRemoved):
                last.block_hashes.append(h)
            else:
                out.append(BlockRemoved([h], medium, idx))
        else:
            out.append(AllBlocksCleared())
    return out


def disk_events(log: list[tuple[Any, ...]]) -> list[KVEvent]:
    """A disk tier's log (`DiskKVTier.take_events`) as vLLM's events with medium "DISK", in order:
    consecutive files of one chain in one BlockStored, consecutive deletions in one BlockRemoved. A
    block's chain key is not on disk: a block whose parent is the no-adapter root has no parent hash."""
    root = _core.prefix_root_hash(0)
    out: list[KVEvent] = []
    for entry in log:
        last = out[-1] if out else None
        if entry[0] == "stored":
            _, h, parent, tokens = entry
            if isinstance(last, BlockStored) and last.block_hashes[-1] == parent:
                last.block_hashes.append(h)
                last.token_ids.extend(tokens)
                continue
            first = None if parent == root else parent
            out.append(BlockStored([h], first, list(tokens), len(tokens), None, DISK_TIER_MEDIUM))
        elif isinstance(last, BlockRemoved):
            last.block_hashes.append(entry[1])
        else:
            out.append(BlockRemoved([entry[1]], DISK_TIER_MEDIUM))
    return out


def net_of_log(log: list[tuple[Any, ...]]) -> tuple[list[int], list[int]]:
    """The net change (stored, removed) of a disk tier's log: a block stored and deleted again is neither;
    a block's first entry says whether it was held before (a deletion: it was)."""
    state: dict[int, tuple[bool, bool]] = {}  # hash -> (held before, held after), in first-touch order
    for entry in log:
        now = entry[0] == "stored"
        before = state[entry[1]][0] if entry[1] in state else not now
        state[entry[1]] = (before, now)
    stored = [h for h, (b, a) in state.items() if a and not b]
    removed = [h for h, (b, a) in state.items() if b and not a]
    return stored, removed


def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """The endpoint of data-parallel rank `data_parallel_rank`, as vLLM: a tcp port plus the rank, an
    inproc name with ``_dp<rank>``; unchanged for rank 0."""
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{data_parallel_rank}"
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        if not port.isdigit():
            raise ValueError(f"kv_events_config endpoint {endpoint!r} has no port to offset by the rank")
        return f"{base}:{int(port) + data_parallel_rank}"
    raise ValueError(
        f"kv_events_config endpoint {endpoint!r}: data parallelism needs a tcp:// or inproc:// one"
    )


def _binds(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard, ipc or inproc address; connect to any other."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """vLLM's reliable PUB/ROUTER publisher: batches go out from a thread, the last `buffer_steps` of
    them replayable."""

    SHUTDOWN_TIMEOUT = 2.0

    def __init__(self, config: KVEventsConfig, lora_ids: dict[int, int], medium: str) -> None:
        rank = config.data_parallel_rank
        self.endpoint = offset_endpoint_port(config.endpoint, rank)
        self.replay_endpoint = offset_endpoint_port(config.replay_endpoint, rank)
        self._rank = rank
        self._hwm = config.hwm
        self._topic = config.topic.encode()
        self._lora_ids, self._medium = lora_ids, medium
        self._queue: queue.Queue[tuple[int, float, _Parts] | None] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = itertools.count()
        self.num_dropped = 0
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kv-events-publisher", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread.join()
            raise ValueError(
                f"kv_events_config: cannot open {self.endpoint!r}: {self._error}"
            ) from self._error

    def publish(self, events: _core.KVEvents | _Parts) -> None:
        """Queue one step's events (never blocks; a full queue drops them, leaving a sequence gap): the
        model's only pool's, or each published pool's with its KV-cache group."""
        seq = next(self._seq)
        parts: _Parts = [(None, events, None)] if isinstance(events, _core.KVEvents) else events
        try:
            self._queue.put_nowait((seq, time.time(), parts))
        except queue.Full:
            self.num_dropped += 1
            logger.warning("KV-event queue full: batch %d dropped (%d so far)", seq, self.num_dropped)

    def shutdown(self) -> None:
        """Send what is queued (up to SHUTDOWN_TIMEOUT), then close the sockets."""
        try:
            self._queue.put(None, timeout=self.SHUTDOWN_TIMEOUT)
        except queue.Full:
            pass
        self._thread.join(self.SHUTDOWN_TIMEOUT)

    def _open(self, ctx: zmq.Context) -> tuple[zmq.Socket, zmq.Socket | None]:
        pub = ctx.socket(zmq.PUB)
        pub.set_hwm(self._hwm)
        replay = None
        try:
            assert self.endpoint is not None  # the config requires one
            if _binds(self.endpoint):
                pub.bind(self.endpoint)
            else:
                pub.connect(self.endpoint)
            if self.replay_endpoint is not None:
                replay = ctx.socket(zmq.ROUTER)
                replay.bind(self.replay_endpoint)
        except BaseException:
            pub.close(linger=0)
            if replay is not None:
                replay.close(linger=0)
            raise
        return pub, replay

    def _run(self) -> None:
        try:
            pub, replay = self._open(zmq.Context.instance())
        except BaseException as exc:  # reported by the constructor
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        encoder = msgspec.msgpack.Encoder()
        try:
            while True:
                if replay is not None and replay.poll(0):
                    self._serve_replay(replay)
                try:
                    item = self._queue.get(timeout=0.05)
                except queue.Empty:
                    continue
                if item is None:
                    break
                seq, ts, parts = item
                try:
                    out = [e for part in parts for e in self._events_of(part)]
                    batch = KVEventBatch(ts, out, self._rank)
                    payload = encoder.encode(batch)
                    pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                    self._buffer.append((seq, payload))
                except Exception:
                    logger.exception("KV-event batch %d not published", seq)
        finally:
            pub.close(linger=100)
            if replay is not None:
                replay.close(linger=0)

    def _events_of(self, part: _Part) -> list[KVEvent]:
        group, ev, medium = part
        if isinstance(ev, list):
            return ev
        return to_vllm_events(ev, self._lora_ids, medium or self._medium, group)

    def _serve_replay(self, replay: zmq.Socket) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("KV-event replay: a request of %d frames ignored (want 3)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        replay.send_multipart((client, b"", END_SEQ, b""))


class KVEventsTap:
    """The core's side: turns on the scheduler's event recording, drains it once per step into the step
    message's net change (when `step_events`) and the ZeroMQ publisher (when publishing)."""

    def __init__(
        self,
        config: KVEventsConfig,
        scheduler: _core.Scheduler,
        medium: str,
        pool_labels: list[str] | None = None,
    ) -> None:
        """`pool_labels`: the model's KV pools (`event_groups`); by default its only pool, the full-attention
        one. Each published pool's events go out with its KV-cache group; the step message's net change is
        the full-attention pool's (its hashes are every pool's keys)."""
        self.config = config
        self._scheduler = scheduler
        self._groups = event_groups(pool_labels or ["full"])
        self._lora_ids: dict[int, int] = {}  # extra key -> LoRA adapter id, for BlockStored.lora_id
        self.publisher = ZmqEventPublisher(config, self._lora_ids, medium) if config.publishes else None
        self._disk: Any = None  # the disk tier, once attached
        self._disk_held: list[tuple[Any, ...]] = []  # its blocks at start-up, for the first step message
        scheduler.set_kv_events(True)

    @classmethod
    def open(
        cls, config: KVEventsConfig, scheduler: _core.Scheduler, device: Any, pool_labels: list[str]
    ) -> KVEventsTap | None:
        """The tap of an engine core on `device` (medium GPU on CUDA, else CPU), None when nothing
        consumes the events."""
        if not config.records:
            return None
        return cls(config, scheduler, "GPU" if device.type == "cuda" else "CPU", pool_labels)

    def note_lora(self, lora: LoRARequest | None) -> None:
        """A request with this adapter was added: its blocks' extra key maps to its id."""
        if lora is not None and self.publisher is not None:
            self._lora_ids.setdefault(_core.prefix_extra_key(lora_salt_of(lora)), lora.lora_int_id)

    def attach_disk(self, disk: Any) -> None:
        """Publish the disk tier's (`runner.kv_disk.DiskKVTier`) block files too, with medium "DISK", those it
        holds already first."""
        self._disk = disk
        disk.record_events(True)
        # The blocks found at start-up: published now, and in the first step's net change.
        self._disk_held = disk.held_records()
        if self._disk_held and self.publisher is not None:
            self.publisher.publish([(None, disk_events(self._disk_held), DISK_TIER_MEDIUM)])

    def take_step(self) -> KVCacheEvents | None:
        """Drain the events since the last step, the device pool's and the tiers': publish them, and return
        their net change for the step message (None when nothing changed or the message does not carry it)."""
        events = self._scheduler.take_kv_events()
        tiers = self._take_tiers()
        parts: list[_Part] = self._group_parts(events) if self._groups else []
        if not self._groups and len(events):
            parts.append((None, events, None))
        parts += [(None, ev, medium) for medium, ev, _ in tiers if len(ev)]
        if parts and self.publisher is not None:
            self.publisher.publish(parts)
        if not self.config.step_events:
            return None
        stored, removed, cleared = events.net() if len(events) else ([], [], False)
        tier_stored = {m: net[0] for m, _, net in tiers if net[0]}
        tier_removed = {m: net[1] for m, _, net in tiers if net[1]}
        if not (stored or removed or cleared or tier_stored or tier_removed):
            return None
        return KVCacheEvents(stored, removed, cleared, tier_stored, tier_removed)

    def _take_tiers(self) -> list[tuple[str, _core.KVEvents | list[KVEvent], tuple[list[int], list[int]]]]:
        """The host tier's and the disk tier's events since the last step, each with its medium and net
        change (stored, removed); none for a tier without events."""
        out: list[tuple[str, _core.KVEvents | list[KVEvent], tuple[list[int], list[int]]]] = []
        host = self._scheduler.take_tier_kv_events()
        if len(host):
            stored, removed, _ = host.net()  # the tier logs its clear as removals
            out.append((HOST_TIER_MEDIUM, host, (stored, removed)))
        log = self._disk.take_events() if self._disk is not None else []
        held, self._disk_held = self._disk_held, []  # published when attached
        if log or held:
            out.append((DISK_TIER_MEDIUM, disk_events(log), net_of_log(held + log)))
        return out

    def _group_parts(self, full: _core.KVEvents) -> list[_Part]:
        """Every published pool's events (the full-attention pool's only when it stores KV)."""
        pools = (
            [full] if self._groups[0].kind == "full_attention" else []
        ) + self._scheduler.take_group_kv_events()
        return [(g, ev, None) for g, ev in zip(self._groups, pools, strict=True) if len(ev)]

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.shutdown()
            self.publisher = None
