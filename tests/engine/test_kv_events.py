"""Prefix-cache events: a subscriber decoding vLLM's KV-event stream with vLLM's schema rebuilds the
core's cached block set under eviction and resets, per data-parallel rank; the replay endpoint serves the
batches a late subscriber missed; the step message's net change rebuilds the same set; bad
`kv_events_config` values fail naming the value."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from pagedrs import _core
from pagedrs.config import KVEventsConfig
from pagedrs.engine.arg_utils import EngineArgs
from pagedrs.engine.core.engine_core import EngineCore
from pagedrs.engine.core.kv_events import BlockStored, ZmqEventPublisher, to_vllm_events
from pagedrs.engine.core.messages import EngineCoreOutputs, EngineCoreRequest
from pagedrs.engine.core.prefix_hashes import lora_salt_of, request_block_hashes
from pagedrs.lora_request import LoRARequest
from pagedrs.sampling_params import SamplingParams
from tests.engine.helpers_kv_events import AllBlocksCleared, BlockRemoved, Subscriber, free_tcp_ports
from tests.helpers import make_tiny_llama

BS = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("kv_events"))


def _core_with(tiny: Path, **kw: Any) -> EngineCore:
    args = EngineArgs(model=str(tiny), device="cpu", num_kv_blocks=24, block_size=BS, **kw)
    return EngineCore.from_config(args.launch_config())[0]


def _run_wave(core: EngineCore, wave: int, n: int = 4) -> Iterator[EngineCoreOutputs]:
    """n requests sharing a 2-block system prompt per tenant, with their own tails: 24 blocks of 4
    tokens cannot hold them all, so earlier waves' blocks are evicted. Yields each step's output."""
    for i in range(n):
        tenant = [3 + (wave + i) % 3] * 8
        prompt = tenant + [10 + wave, 20 + i, 30 + wave, 40 + i] * 2 + [50 + i]
        params = SamplingParams(max_tokens=5, ignore_eos=True)
        core.add_request(EngineCoreRequest(f"w{wave}r{i}", prompt, params, 5, time.time()))
    while core.has_unfinished_requests():
        yield core.step()


def test_subscriber_rebuilds_the_cached_set_per_rank(tiny: Path) -> None:
    port = free_tcp_ports(4)
    cfg = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{port}",
        "replay_endpoint": f"tcp://*:{port + 2}",
        "topic": "kv",
    }
    # Rank 1 offsets both ports by one, as vLLM's publisher does, and stamps its batches.
    core = _core_with(tiny, kv_events_config=json.dumps(cfg), data_parallel_rank=1)
    sub = Subscriber(f"tcp://127.0.0.1:{port + 1}", f"tcp://127.0.0.1:{port + 3}", topic="kv")
    try:
        for wave in range(4):
            for _ in _run_wave(core, wave):
                pass
            want = set(core.cached_block_hashes())
            assert sub.wait_for(1, want) == want, f"wave {wave}"
        assert core.reset_prefix_cache()
        for _ in _run_wave(core, 9, n=1):
            pass
        want = set(core.cached_block_hashes())
        assert sub.wait_for(1, want) == want
        events = [e for b in sub.batches for e in b.events]
        assert any(isinstance(e, BlockRemoved) for e in events)  # eviction happened and was published
        assert any(isinstance(e, AllBlocksCleared) for e in events)
        assert {b.data_parallel_rank for b in sub.batches} == {1} and sub.topics == {b"kv"}
        stored = [e for e in events if not isinstance(e, (BlockRemoved, AllBlocksCleared))]
        assert all(e.medium == "CPU" and e.block_size == BS and e.lora_id is None for e in stored)
        # A prompt's first blocks: no parent, the hashes `request_block_hashes` predicts.
        first = next(e for e in stored if e.parent_block_hash is None and len(e.block_hashes) >= 3)
        assert first.block_hashes == request_block_hashes(first.token_ids, BS)
    finally:
        sub.close()
        core.shutdown()


def test_replay_serves_the_batches_a_late_subscriber_missed(tiny: Path) -> None:
    port = free_tcp_ports(2)
    cfg = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://*:{port}",
        "replay_endpoint": f"tcp://*:{port + 1}",
    }
    core = _core_with(tiny, kv_events_config=json.dumps(cfg))
    late = Subscriber(None, f"tcp://127.0.0.1:{port + 1}")
    try:
        for wave in range(3):
            for _ in _run_wave(core, wave):
                pass
        want = set(core.cached_block_hashes())
        deadline = time.monotonic() + 10
        while late.cached.get(0, set()) != want and time.monotonic() < deadline:
            late.catch_up(late.next_seq)  # the publisher thread may still be sending the last batches
            time.sleep(0.02)
        assert late.cached[0] == want and late.replayed == late.next_seq > 3
        assert late.replay(2)[0][0] == 2  # from a given sequence number on
        assert late.replay(late.next_seq) == []  # nothing newer: only the end marker
    finally:
        late.close()
        core.shutdown()


def test_step_message_events_rebuild_the_cached_set(tiny: Path) -> None:
    core = _core_with(tiny, kv_cache_events=True)
    off = _core_with(tiny)
    try:
        cached: set[int] = set()
        removed = 0
        for wave in range(4):
            for out in _run_wave(core, wave):
                ev = out.kv_events
                if ev is None:
                    continue
                if ev.cleared:
                    cached.clear()
                assert set(ev.removed) <= cached and not set(ev.stored) & (cached - set(ev.removed))
                cached.difference_update(ev.removed)
                cached.update(ev.stored)
                removed += len(ev.removed)
            assert cached == set(core.cached_block_hashes()), f"wave {wave}"
        assert removed > 0
        assert all(out.kv_events is None for out in _run_wave(off, 0))
    finally:
        core.shutdown()
        off.shutdown()


def test_lora_blocks_carry_the_adapter_and_chain_from_no_parent() -> None:
    lora = LoRARequest("a", 7, "/adapters/a")
    s = _core.Scheduler(num_blocks=16, block_size=BS)
    s.set_kv_events(True)
    prompt = list(range(100, 113))
    s.add_request([1], prompt, max_tokens=1, cache_salt=lora_salt_of(lora))
    s.update(s.schedule(), [3])
    lora_ids = {_core.prefix_extra_key(lora_salt_of(lora)): 7}
    (ev,) = to_vllm_events(s.take_kv_events(), lora_ids, "GPU")
    assert isinstance(ev, BlockStored)
    assert ev.block_hashes == request_block_hashes(prompt, BS, lora_int_id=7, lora_path="/adapters/a")
    assert (ev.parent_block_hash, ev.lora_id, ev.token_ids) == (None, 7, prompt[:12])


@pytest.mark.parametrize(
    ("spec", "named"),
    [
        ("{enable_kv_cache_events: true}", "{enable_kv_cache_events: true}"),
        ('{"publisher": "kafka"}', "kafka"),
        ('{"enable_kv_cache_events": true, "endpoint": "5557"}', "5557"),
        ('{"buffer_steps": 0}', "buffer_steps"),
        ('{"enable_kv_events": true}', "enable_kv_events"),
        ("[1, 2]", "[1, 2]"),
    ],
)
def test_bad_kv_events_config_names_the_value(spec: str, named: str) -> None:
    with pytest.raises(ValueError, match="kv_events_config") as info:
        EngineArgs(kv_events_config=spec).early_configs()  # before any process starts
    assert named in str(info.value)


def test_kv_events_config_flag_and_launch_round_trip() -> None:
    import argparse

    from pagedrs.launch_config import LaunchConfig

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    spec = '{"enable_kv_cache_events": true, "topic": "t"}'
    ns = parser.parse_args(["--kv-events-config", spec])
    args = EngineArgs(kv_events_config=ns.kv_events_config, kv_cache_events=True, data_parallel_rank=2)
    launch = args.launch_config()
    assert launch.kv_events == KVEventsConfig(
        enable_kv_cache_events=True, topic="t", step_events=True, data_parallel_rank=2
    )
    assert LaunchConfig.from_json(launch.to_json()).kv_events == launch.kv_events
    assert EngineArgs().launch_config().kv_events.records is False  # off by default


def test_an_endpoint_in_use_is_a_clear_error() -> None:
    port = free_tcp_ports(1)
    taken = zmq.Context.instance().socket(zmq.PUB)
    taken.bind(f"tcp://*:{port}")
    try:
        cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{port}")
        with pytest.raises(ValueError, match=f"tcp://\\*:{port}"):
            ZmqEventPublisher(cfg, {}, "CPU")
    finally:
        taken.close(linger=0)
