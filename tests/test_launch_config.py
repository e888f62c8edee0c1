"""`LaunchConfig`: what the executor builds an engine from, and what crosses to the other ranks."""

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
