"""KV events of a model with sliding-window pools: every pool that stores KV publishes its own events,
with its KV-cache group as vLLM names it (`group_idx`, `kv_cache_spec_kind`, `kv_cache_spec_sliding_window`);
a model whose every layer is windowed publishes its window pool's (its full-attention pool is bookkeeping); a
hybrid's recurrent group publishes its state snapshots' (a prefix hit needs one);
a subscriber replaying each group's stream never sees a block removed that the group did not store."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from pagedrs.engine.arg_utils import EngineArgs
from pagedrs.engine.core.engine_core import EngineCore
from pagedrs.engine.core.kv_events import EventGroup, event_groups
from pagedrs.engine.core.messages import EngineCoreRequest
from pagedrs.sampling_params import SamplingParams
from tests.engine.helpers_kv_events import BlockRemoved, BlockStored, Subscriber, free_tcp_ports
from tests.helpers import make_tiny_llama, make_tiny_model
from tests.models.helpers_families import gemma3_config
from tests.models.helpers_qwen3_5 import qwen3_5_config

BS = 4
WINDOW = 8


def _core(model: Path, port: int, num_kv_blocks: int) -> EngineCore:
    # the replay endpoint fills in what a subscriber that joins late missed (a PUB socket drops it)
    cfg = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{port}",
        "replay_endpoint": f"tcp://*:{port + 1}",
        "topic": "kv",
    }
    args = EngineArgs(
        model=str(model),
        device="cpu",
        dtype="float32",
        num_kv_blocks=num_kv_blocks,
        block_size=BS,
        max_num_batched_tokens=8,
        kv_events_config=json.dumps(cfg),
    )
    return EngineCore.from_config(args.launch_config())[0]


def _serve(core: EngineCore, sub: Subscriber) -> list[BlockStored | BlockRemoved]:
    """Three waves of prompts (a shared prefix, their own tails) through a pool too small to keep them all:
    blocks are cached, evicted, and cached again. Returns every published event."""
    for wave in range(3):
        for i in range(3):
            prompt = [3 + wave] * 12 + [10 + i, 20 + wave] * 9
            params = SamplingParams(max_tokens=4, ignore_eos=True)
            core.add_request(EngineCoreRequest(f"w{wave}r{i}", prompt, params, 4, time.time()))
        while core.has_unfinished_requests():
            core.step()
    deadline, quiet = time.monotonic() + 10, 0
    while time.monotonic() < deadline and quiet < 3:  # until the stream stays quiet for 3 polls
        quiet = 0 if sub.poll(200) or not sub.batches else quiet + 1
    sub.catch_up(sub.next_seq)  # anything the stream dropped before the subscriber joined
    return [e for b in sub.batches for e in b.events]


def test_event_groups_name_each_published_pool() -> None:
    assert event_groups(["full"]) == []  # the only pool: events carry no group, as before
    assert event_groups(["full", "window:8", "window:32"]) == [
        EventGroup(0, "full_attention"),
        EventGroup(1, "sliding_window", 8),
        EventGroup(2, "sliding_window", 32),
    ]
    assert event_groups(["window:8"]) == [EventGroup(0, "sliding_window", 8)]


@pytest.mark.parametrize("kind", ["mixed", "all_windowed", "hybrid"])
def test_every_pool_publishes_its_group(tmp_path: Path, kind: str) -> None:
    all_windowed = kind == "all_windowed"
    if all_windowed:
        model = make_tiny_llama(tmp_path / "mistral", arch="mistral", sliding_window=WINDOW)
        want = {0: ("sliding_window", WINDOW)}
    elif kind == "hybrid":  # the recurrent group publishes its state snapshots' cache, as vLLM's mamba group
        model = make_tiny_model(tmp_path / "qwen3_5", qwen3_5_config())
        want = {0: ("full_attention", None), 1: ("mamba", None)}
    else:
        model = make_tiny_model(tmp_path / "gemma3", gemma3_config())
        want = {0: ("full_attention", None), 1: ("sliding_window", WINDOW)}
    port = free_tcp_ports(2)
    core = _core(model, port, num_kv_blocks=24)
    sub = Subscriber(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}", topic="kv")
    try:
        assert core.scheduler.kv_group_pools() != []
        events = _serve(core, sub)
        stored = [e for e in events if isinstance(e, BlockStored)]
        specs = {e.group_idx: (e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in stored}
        assert specs == want
        removed = [e for e in events if isinstance(e, BlockRemoved)]
        assert {e.group_idx for e in removed} <= set(want) and removed  # eviction was published too
        assert all(e.block_size == BS and len(e.token_ids) == BS * len(e.block_hashes) for e in stored)
        if not all_windowed:  # the full-attention pool's stream rebuilds its cache exactly
            assert sub.groups[0] == set(core.cached_block_hashes())
        window = len(want) - 1
        assert sub.groups[window] and not sub.groups.get(None)
    finally:
        sub.close()
        core.shutdown()
