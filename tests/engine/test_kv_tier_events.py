"""The KV tiers' events: blocks entering and leaving the host tier go out as vLLM's BlockStored /
BlockRemoved with medium "CPU" (its least-recently-used eviction a removal), the disk tier's files with
medium "DISK", beside the device pool's unchanged events; the step message carries each tier's net change,
and the data-parallel router routes a prompt to the replica whose host tier holds it."""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import numpy as np

from pagedrs import _core
from pagedrs.config import KVEventsConfig
from pagedrs.engine.core.kv_events import BlockRemoved as KVRemoved
from pagedrs.engine.core.kv_events import BlockStored as KVStored
from pagedrs.engine.core.kv_events import KVEventsTap, disk_events
from pagedrs.engine.core.messages import KVCacheEvents
from pagedrs.engine.core.prefix_hashes import request_block_hashes
from pagedrs.engine.dp.router import DPRouter
from pagedrs.runner.kv_disk import DiskKVTier
from tests.engine.helpers_kv_events import BlockRemoved, BlockStored, Subscriber, free_tcp_ports

BS = 4


def _run(s: _core.Scheduler, rid: int, prompt: list[int]) -> None:
    s.add_request([rid], prompt, max_tokens=1)
    s.update(s.schedule(), [0])


def _replay_all(sub: Subscriber, n: int) -> None:
    deadline = time.monotonic() + 10
    while len(sub.batches) < n and time.monotonic() < deadline:
        sub.catch_up(sub.next_seq)
        time.sleep(0.02)
    assert len(sub.batches) == n


def test_host_tier_stores_and_evictions_are_published_with_medium_cpu() -> None:
    # 4 device blocks, 2 tier slots: a second prompt of 3 full blocks evicts the first prompt's blocks
    # from the device pool and, in least-recently-used order, from the tier.
    s = _core.Scheduler(num_blocks=4, block_size=BS, watermark=0.0, num_tier_blocks=2)
    port = free_tcp_ports(2)
    cfg = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"tcp://127.0.0.1:{port}",
        replay_endpoint=f"tcp://*:{port + 1}",
        step_events=True,
    )
    tap = KVEventsTap(cfg, s, "GPU")
    sub = Subscriber(None, f"tcp://127.0.0.1:{port + 1}")
    first, second = list(range(1, 10)), list(range(100, 113))
    a, b = request_block_hashes(first, BS), request_block_hashes(second, BS)
    tier: set[int] = set()
    try:
        for rid, prompt in ((1, first), (2, second)):
            _run(s, rid, prompt)
            msg = tap.take_step()
            assert msg is not None
            tier.difference_update(msg.tier_removed.get("CPU", []))
            tier.update(msg.tier_stored.get("CPU", []))
        assert tier == {b[1], b[2]} and "DISK" not in msg.tier_stored
        assert tap.publisher is not None
        _replay_all(sub, 2)
        events = [e for batch in sub.batches for e in batch.events]
        cpu = [e for e in events if e.medium == "CPU"]
        assert [(type(e), e.block_hashes) for e in cpu] == [
            (BlockStored, a),
            (BlockRemoved, [a[0]]),
            (BlockStored, [b[0]]),
            (BlockRemoved, [a[1]]),
            (BlockStored, [b[1]]),
            (BlockRemoved, [b[0]]),
            (BlockStored, [b[2]]),
        ]
        assert cpu[0].parent_block_hash is None and cpu[0].token_ids == first[:8]
        assert cpu[4].parent_block_hash == b[0] and cpu[4].block_size == BS
        # The device pool's events are as before: medium GPU, and they add up to its cached set.
        device: set[int] = set()
        for e in events:
            if e.medium == "GPU":
                (device.update if isinstance(e, BlockStored) else device.difference_update)(e.block_hashes)
        assert {e.medium for e in events} == {"CPU", "GPU"}
        assert device == set(s.cached_block_hashes()) == set(b)
        # A prefix-cache reset empties the tier: its blocks are removed, medium CPU.
        assert s.reset_prefix_cache()
        msg = tap.take_step()
        assert msg is not None and msg.cleared and sorted(msg.tier_removed["CPU"]) == sorted([b[1], b[2]])
    finally:
        sub.close()
        tap.close()


def test_disk_tier_files_are_published_with_medium_disk(tmp_path: Path) -> None:
    # Files of 72 + 16 + 100 bytes: a bound of 400 bytes holds two; the third evicts the first.
    disk = DiskKVTier(tmp_path, "ab" * 32, 400)
    s = _core.Scheduler(num_blocks=4, block_size=BS)
    tap = KVEventsTap(KVEventsConfig(step_events=True), s, "GPU")
    tap.attach_disk(disk)
    try:
        hashes = request_block_hashes(list(range(1, 13)), BS)
        parent = _core.prefix_root_hash(0)
        for i, h in enumerate(hashes):
            disk.put(h, parent, list(range(i * BS + 1, i * BS + BS + 1)), _payload())
            parent = h
        disk.flush()
        msg = tap.take_step()
        assert msg is not None and not msg.stored
        assert sorted(msg.tier_stored["DISK"]) == sorted(hashes[1:]) and "DISK" not in msg.tier_removed
        assert tap.take_step() is None
        disk.put(hashes[0], _core.prefix_root_hash(0), [1, 2, 3, 4], _payload())
        disk.flush()
        log = disk.take_events()
        assert log == [("stored", hashes[0], _core.prefix_root_hash(0), [1, 2, 3, 4]), ("removed", hashes[1])]
        stored, removed = disk_events(log)
        assert isinstance(stored, KVStored) and isinstance(removed, KVRemoved)
        assert (stored.block_hashes, stored.parent_block_hash, stored.medium) == ([hashes[0]], None, "DISK")
        assert (removed.block_hashes, removed.medium) == ([hashes[1]], "DISK")
    finally:
        tap.close()
        disk.close()


def test_blocks_on_disk_at_start_up_are_announced(tmp_path: Path) -> None:
    key = "cd" * 32
    disk = DiskKVTier(tmp_path, key, 10_000)
    prompt = list(range(1, 17))
    hashes = request_block_hashes(prompt, BS)
    parent = _core.prefix_root_hash(0)
    for i, h in enumerate(hashes):
        disk.put(h, parent, prompt[i * BS : (i + 1) * BS], _payload())
        parent = h
    disk.close()
    (disk.folder / f"{123:016x}.kv").write_bytes(b"garbage")  # no block of this tier: not announced
    again = DiskKVTier(tmp_path, key, 10_000)  # a restart
    assert len(again) == 5
    port = free_tcp_ports(2)
    cfg = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"tcp://127.0.0.1:{port}",
        replay_endpoint=f"tcp://*:{port + 1}",
        step_events=True,
    )
    tap = KVEventsTap(cfg, _core.Scheduler(num_blocks=4, block_size=BS), "GPU")
    sub = Subscriber(None, f"tcp://127.0.0.1:{port + 1}")
    try:
        tap.attach_disk(again)  # published at once, before any step
        _replay_all(sub, 1)
        events = [e for batch in sub.batches for e in batch.events]
        assert all(isinstance(e, BlockStored) and e.medium == "DISK" for e in events)
        got = {}  # hash -> (parent hash, tokens), from the announced chains
        for e in events:
            parent = e.parent_block_hash
            for j, h in enumerate(e.block_hashes):
                got[h] = (parent, e.token_ids[j * BS : (j + 1) * BS])
                parent = h
        assert got == {
            h: (hashes[i - 1] if i else None, prompt[i * BS : (i + 1) * BS]) for i, h in enumerate(hashes)
        }
        msg = tap.take_step()  # the first step message carries them for the data-parallel router
        assert msg is not None and sorted(msg.tier_stored["DISK"]) == sorted(hashes)
        assert tap.take_step() is None
        _replay_all(sub, 1)  # nothing published twice
    finally:
        sub.close()
        tap.close()
        again.close()


def _payload() -> np.ndarray:
    return np.zeros(100, dtype=np.uint8)


def test_a_replica_holding_a_prompt_only_in_its_host_tier_is_routed_to() -> None:
    # Replica 0's core ran the prompt, then another prompt evicted it from the device pool: only its host
    # tier holds it. Its step messages (through msgpack, as the data-parallel client gets them) reach the
    # router, which sends the prompt back there rather than to the empty replica 1.
    s = _core.Scheduler(num_blocks=4, block_size=BS, watermark=0.0, num_tier_blocks=8)
    tap = KVEventsTap(KVEventsConfig(step_events=True), s, "GPU")
    router = DPRouter(2, block_size=BS, optimistic=False)
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(KVCacheEvents)
    prompt, other = list(range(1, 10)), list(range(100, 113))
    try:
        for rid, p in ((1, prompt), (2, other)):
            _run(s, rid, p)
            msg = tap.take_step()
            assert msg is not None
            router.apply_events(0, dec.decode(enc.encode(msg)))
        hashes = request_block_hashes(prompt, BS)
        assert not set(hashes) & set(s.cached_block_hashes())  # not on the device any more
        assert router.snapshot()[0].num_tier_blocks == {"CPU": 5}
        assert router.tier_hit(0, hashes) == 2 * 0.5
        assert router.route("r", hashes, len(prompt)) == 0
        # Against a replica 32 load tokens lighter (a penalty of 3.2 tokens): the tier hit (2 blocks of 4 at
        # half weight, 4 tokens) still wins; at weight 0 it is a miss and the lighter replica wins.
        for weight, want in ((0.5, 0), (0.0, 1)):
            r = DPRouter(2, block_size=BS, optimistic=False, load_penalty=0.1, host_tier_hit_weight=weight)
            r.apply_events(0, KVCacheEvents(tier_stored={"CPU": hashes}))
            assert r.route("busy", [], 0) == 0
            assert r.route("r", hashes, len(prompt)) == want, weight
    finally:
        tap.close()
