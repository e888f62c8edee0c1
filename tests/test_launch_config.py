"""`LaunchConfig`: what an engine core is built from, and what crosses to its process and to the other ranks."""

from __future__ import annotations

import pytest
import torch

from pagedrs import EngineArgs
from pagedrs.launch_config import LaunchConfig


def test_round_trips_as_json() -> None:
    launch = EngineArgs(
        device="cpu",
        max_model_len=64,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        liquid_gpu_range=[0, 1],
        enable_lora=False,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
        kv_cache_dtype="fp8",
        revision="v1",
    ).launch_config()
    back = LaunchConfig.from_json(launch.to_json())
    assert back == launch
    assert back.device.device == torch.device("cpu") and back.parallel.liquid_gpu_range == (0, 1)
    assert back.load.revision == "v1" and back.load.overrides["rope_scaling"]["factor"] == 2.0


def test_resolve_bounds_the_context_by_the_model() -> None:
    launch = EngineArgs(device="cpu", max_num_seqs=4).launch_config()
    config = launch.resolve(512)
    assert config.scheduler.max_model_len == 512 and config.scheduler.max_num_seqs == 4
    assert config.scheduler.max_num_batched_tokens == 2048  # chunked prefill's default budget
    assert (
        EngineArgs(device="cpu", enable_chunked_prefill=False)
        .launch_config()
        .resolve(4096)
        .scheduler.max_num_batched_tokens
        == 4096
    )
    assert config == EngineArgs(device="cpu", max_num_seqs=4).create_engine_config(512)
    with pytest.raises(
        ValueError, match=r"max_model_len \(1024\) is larger than the model's maximum length \(512\)"
    ):
        EngineArgs(device="cpu", max_model_len=1024).launch_config().resolve(512)


def test_an_engine_core_gets_everything_it_needs_from_the_config() -> None:
    """What once crossed as EngineArgs (the data-parallel settings, max_logprobs, the device as given)
    crosses in the config; the engine's config carries the data-parallel settings."""
    launch = EngineArgs(
        device="cpu",
        max_logprobs=5,
        data_parallel_size=2,
        dp_routing="least_loaded",
        dp_router_config={"load_penalty": 0.5},
    ).launch_config()
    back = LaunchConfig.from_json(launch.to_json())
    assert back == launch and back.max_logprobs == 5 and back.device_name == "cpu"
    dp = back.data_parallel
    assert (dp.size, dp.routing, dp.router_tuning, dp.rank) == (2, "least_loaded", {"load_penalty": 0.5}, 0)
    assert back.resolve(128).data_parallel == dp


def test_a_replica_is_the_config_with_its_own_fields() -> None:
    launch = EngineArgs(device="cpu", data_parallel_size=4, kv_events_config='{"topic": "t"}').launch_config()
    r = launch.for_replica(3, num_threads=2)
    assert r.data_parallel.rank == 3 and r.kv_events.data_parallel_rank == 3
    assert r.kv_events.step_events and r.kv_events.topic == "t"  # routing by cache: its changes reported
    assert r.device.num_threads == 2 and r.device.device == launch.device.device
    assert (r.model, r.cache, r.parallel, r.load) == (
        launch.model,
        launch.cache,
        launch.parallel,
        launch.load,
    )
    assert LaunchConfig.from_json(r.to_json()) == r
    plain = EngineArgs(device="cpu", data_parallel_size=2, dp_routing="round_robin").launch_config()
    assert not plain.for_replica(1, None).kv_events.step_events
    with pytest.raises(ValueError, match="data_parallel_rank"):
        launch.for_replica(-1, None)


def test_on_device_settles_auto_and_the_default_swap_space() -> None:
    launch = EngineArgs(device="auto").launch_config()
    assert launch.device_name == "auto"
    on_gpu = launch.on_device("cuda")
    assert on_gpu.device.device == torch.device("cuda") and on_gpu.device_name == "cuda"
    assert on_gpu.cache.swap_space == 4.0 and on_gpu.on_device("cpu").cache.swap_space == 0.0
    given = EngineArgs(device="cpu", swap_space=1.5).launch_config()
    assert given.on_device("cuda").cache.swap_space == 1.5  # a swap space given stays
