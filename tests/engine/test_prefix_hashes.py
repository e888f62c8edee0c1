"""`request_block_hashes` gives the hashes the scheduler actually caches for a prompt, with and without a
cache salt and a LoRA adapter, and the core hands the scheduler the same salt for a LoRA request."""

from __future__ import annotations

import pytest

from pagedrs._core import Scheduler
from pagedrs.engine.core.messages import EngineCoreRequest
from pagedrs.engine.core.prefix_hashes import (
    core_request_block_hashes,
    lora_salt_of,
    request_block_hashes,
    scheduler_cache_salt,
)
from pagedrs.lora_request import LoRARequest
from pagedrs.sampling_params import SamplingParams

BS = 4


def _cached_after_prefill(prompt: list[int], salt: str | None) -> set[int]:
    s = Scheduler(num_blocks=32, block_size=BS)
    s.add_request([1], prompt, max_tokens=1, cache_salt=salt)
    s.update(s.schedule(), [3])
    return set(s.cached_block_hashes())


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"cache_salt": "tenant-a"},
        {"lora_int_id": 3, "lora_path": "/adapters/a"},
        {"lora_int_id": 3, "lora_path": "/adapters/a", "cache_salt": "tenant-a"},
    ],
)
def test_hashes_equal_what_the_scheduler_caches(kw: dict) -> None:
    prompt = list(range(100, 118))  # 4 full blocks and 2 tokens
    hashes = request_block_hashes(prompt, BS, **kw)
    assert len(hashes) == 4 and all(0 <= h < 2**64 for h in hashes)
    assert _cached_after_prefill(prompt, scheduler_cache_salt(**kw)) == set(hashes)
    # Another salt or adapter, or the base model, hashes every block differently.
    base = request_block_hashes(prompt, BS)
    other = request_block_hashes(prompt, BS, cache_salt="tenant-b", lora_int_id=4)
    assert not set(other) & set(hashes)
    assert (set(base) == set(hashes)) == (kw == {})


def test_shared_prefix_shares_leading_hashes() -> None:
    a = request_block_hashes(list(range(12)), BS)
    b = request_block_hashes(list(range(8)) + [50, 51, 52, 53], BS)
    assert a[:2] == b[:2] and a[2] != b[2]
    assert request_block_hashes([1, 2, 3], BS) == []


def test_core_request_uses_the_cores_lora_salt() -> None:
    lora = LoRARequest("a", 3, "/adapters/a")
    assert lora_salt_of(lora) == lora.cache_salt
    assert lora_salt_of(None) is None
    req = EngineCoreRequest("r", list(range(100, 118)), SamplingParams(), 1, 0.0, lora_request=lora)
    assert core_request_block_hashes(req, BS) == request_block_hashes(
        req.prompt_token_ids, BS, lora_int_id=3, lora_path="/adapters/a"
    )
    assert _cached_after_prefill(req.prompt_token_ids, lora_salt_of(lora)) == set(
        core_request_block_hashes(req, BS)
    )


@pytest.mark.parametrize(
    ("args", "kw", "match"),
    [
        (([1, 2], 0), {}, "block_size"),
        (([1, 2], 2), {"lora_int_id": -1}, "lora_int_id"),
        (([1, -2], 2), {}, "-2"),
    ],
)
def test_bad_input_names_the_value(args: tuple, kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        request_block_hashes(*args, **kw)
