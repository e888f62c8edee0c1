"""The persistent per-sequence sampling state against a from-scratch rebuild (`metadata_from_rows`)
over random add / sample / finish / preempt events with mixed parameters: same metadata, same tokens."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from pagedrs import SamplingParams
from pagedrs.layers.sampler import Sampler, SamplingMetadata
from pagedrs.runner.sampling_state import SamplingState
from tests.helpers import SamplerRow as Row
from tests.helpers_sampling import metadata_from_rows

V = 50
EOS = (3,)


def random_params(rng: random.Random) -> SamplingParams:
    kind = rng.randrange(8)
    kw: dict = {"max_tokens": 100}
    if kind == 0:
        kw["temperature"] = 0.0
    elif kind == 1:
        kw.update(temperature=0.0, logprobs=rng.choice([0, 2, 5]))
    elif kind == 2:
        kw.update(
            temperature=rng.choice([0.5, 1.0]), top_k=rng.choice([0, 1, 5, 100]), seed=rng.randrange(99)
        )
    elif kind == 3:
        kw.update(temperature=0.8, top_p=rng.choice([0.5, 0.9]), min_p=rng.choice([0.0, 0.1]))
    elif kind == 4:
        kw.update(temperature=rng.choice([0.0, 1.0]), presence_penalty=0.5, repetition_penalty=1.2)
    elif kind == 5:
        kw.update(temperature=rng.choice([0.0, 1.0]), min_tokens=rng.randrange(1, 4), stop_token_ids=[7, 99])
    elif kind == 6:
        kw.update(temperature=rng.choice([0.0, 0.7]), logit_bias={1: 5.0, 2: -3.0, 1000: 1.0})
    else:
        kw.update(temperature=1.0, frequency_penalty=0.3, logprobs=1, ignore_eos=True, min_tokens=2)
    return SamplingParams(**kw)


def _pairs(t: tuple[torch.Tensor, ...] | None) -> set[tuple]:
    return set() if t is None else set(zip(*(x.tolist() for x in t), strict=True))


def assert_same_metadata(ours: SamplingMetadata, ref: SamplingMetadata) -> None:
    assert (ours.num_rows, ours.all_greedy, ours.max_num_logprobs) == (
        ref.num_rows,
        ref.all_greedy,
        ref.max_num_logprobs,
    )
    assert ours.is_plain_greedy == ref.is_plain_greedy
    for name in (
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "presence_penalties",
        "frequency_penalties",
        "repetition_penalties",
        "prompt_token_ids",
        "output_token_ids",
        "random_rows",
    ):
        a, b = getattr(ours, name), getattr(ref, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert torch.equal(a, b), name
    assert ours.top_k_max == ref.top_k_max
    assert _pairs(ours.banned) == _pairs(ref.banned)
    assert _pairs(ours.bias) == _pairs(ref.bias)
    assert {i: id(g) for i, g in ours.generators.items()} == {i: id(g) for i, g in ref.generators.items()}


def sample_with(meta: SamplingMetadata, logits: torch.Tensor, rows: list[Row], seed: int) -> torch.Tensor:
    """Sample with every generator reset first (so both metadata draw the same noise)."""
    states = [r.generator.get_state() if r.generator is not None else None for r in rows]
    meta.default_generator = torch.Generator().manual_seed(seed)
    out = Sampler()(logits.clone(), meta)
    for r, s in zip(rows, states, strict=True):
        if r.generator is not None:
            r.generator.set_state(s)
    return out.sampled_token_ids


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_state_equals_rebuild_over_random_events(seed: int) -> None:
    rng = random.Random(seed)
    state = SamplingState(vocab_size=V, device=torch.device("cpu"), eos_token_ids=EOS, capacity=4)
    seqs: dict[int, Row] = {}
    running: list[int] = []
    preempted: list[int] = []
    next_id = 0
    steps = 0
    for _ in range(120):
        event = rng.random()
        if event < 0.3 or not running:  # add a request (sometimes n > 1 children with one params)
            params = random_params(rng)
            for _ in range(rng.choice([1, 1, 2])):
                seqs[next_id] = Row(params, prompt_token_ids=[rng.randrange(V) for _ in range(5)])
                running.append(next_id)
                next_id += 1
        elif event < 0.4:  # finish: told (remove) or silent
            sid = running.pop(rng.randrange(len(running)))
            if rng.random() < 0.5:
                state.remove([sid])
        elif event < 0.5:  # preempt, or resume a preempted one
            if preempted and rng.random() < 0.5:
                running.append(preempted.pop(rng.randrange(len(preempted))))
            else:
                preempted.append(running.pop(rng.randrange(len(running))))
        if not running:
            continue
        batch = rng.sample(running, rng.randrange(1, len(running) + 1))
        rows = [seqs[s] for s in batch]
        ids = np.array(batch, dtype=np.int64)
        ours = state.metadata(ids, rows)
        ref = metadata_from_rows(rows, vocab_size=V, device=torch.device("cpu"), eos_token_ids=EOS)
        assert_same_metadata(ours, ref)
        logits = torch.randn(len(rows), V, generator=torch.Generator().manual_seed(steps))
        a = sample_with(ours, logits, rows, steps)
        b = sample_with(ref, logits, rows, steps)
        assert torch.equal(a, b)
        for r, tok in zip(rows, a.tolist(), strict=True):  # advance generators and histories
            if r.generator is not None:
                torch.empty(V).exponential_(generator=r.generator)
            r.output_token_ids.append(tok)
        steps += 1
        assert state.num_seqs <= state.capacity
    assert steps > 50
    assert state.capacity > 4  # it grew past the first table


def test_all_simple_greedy_builds_nothing() -> None:
    state = SamplingState(vocab_size=V, device=torch.device("cpu"))
    rows = [Row(SamplingParams(temperature=0.0)) for _ in range(3)]
    meta = state.metadata(np.array([5, 9, 7]), rows)
    assert meta.is_plain_greedy and meta.temperature is None and meta.max_num_logprobs is None
    assert state.num_seqs == 3


def test_remove_and_eviction_free_slots() -> None:
    state = SamplingState(vocab_size=V, device=torch.device("cpu"), capacity=16)
    rows = {i: Row(SamplingParams(temperature=1.0, top_k=i % 5 + 1)) for i in range(40)}
    first = np.arange(16)
    state.metadata(first, [rows[i] for i in first])
    assert state.num_seqs == 16
    state.remove([0, 1, 2, 12345])
    assert state.num_seqs == 13
    # 16 new ones do not fit beside 13 others: the ones not in this step are dropped, the table stays
    second = np.arange(16, 32)
    meta = state.metadata(second, [rows[i] for i in second])
    assert state.capacity == 16 and state.num_seqs == 16
    assert meta.top_k.tolist() == [i % 5 + 1 for i in second]
    # a dropped sequence comes back (read again from its row)
    back = np.array([3, 20])
    meta = state.metadata(back, [rows[3], rows[20]])
    assert meta.top_k.tolist() == [4, 1]


def test_a_batch_larger_than_the_table_grows_it() -> None:
    state = SamplingState(vocab_size=V, device=torch.device("cpu"), capacity=16)
    ids = np.arange(100, 140)
    rows = [Row(SamplingParams(temperature=0.5, top_p=0.9)) for _ in ids]
    meta = state.metadata(ids, rows)
    assert state.capacity >= 40 and meta.num_rows == 40 and meta.top_p is not None
