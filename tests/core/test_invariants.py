"""Random add / schedule / update / abort / resize sequences through the binding, with every
invariant (Scheduler.check_invariants) and the simulated KV memory checked after each step."""

import random

import pytest

from pagedrs._core import InvalidRequestError, ResizeError
from tests.core.sim import Sim


def _config(rng: random.Random) -> dict:
    return {
        "num_blocks": rng.randrange(3, 24),
        "block_size": rng.choice([1, 2, 4, 8]),
        "max_num_batched_tokens": rng.randrange(1, 40),
        "max_num_seqs": rng.randrange(1, 7),
        "max_model_len": rng.randrange(8, 80),
        "enable_prefix_caching": rng.random() < 0.7,
        "enable_chunked_prefill": rng.random() < 0.7,
        "num_swap_blocks": rng.choice([0, 0, 4, 16]),
        "watermark": rng.choice([0.0, 0.05, 0.2]),
    }


def _prompt(rng: random.Random) -> list[int]:
    template = rng.randrange(3)
    shared = [2 + (template * 7 + k * 13) % 6 for k in range(rng.randrange(0, 30))]
    return (shared + [rng.randrange(2, 8) for _ in range(rng.randrange(0, 8))]) or [2]


def _run(seed: int, num_ops: int) -> Sim:
    rng = random.Random(seed)
    sim = Sim.make(seed=seed, **_config(rng))
    for _ in range(num_ops):
        op = rng.random()
        if op < 0.3:
            try:
                sim.add(
                    _prompt(rng),
                    n=rng.randrange(1, 4),
                    max_tokens=rng.randrange(1, 12),
                    priority=rng.randrange(-1, 2),
                    cache_salt=rng.choice([None, None, "a"]),
                )
            except InvalidRequestError:
                pass  # too long for max_model_len or the pool
        elif op < 0.75:
            sim.step()
        elif op < 0.82 and sim.live:
            sim.abort([rng.choice(list(sim.live))])
        elif op < 0.88:
            p = sim.schedule_and_run()
            if sim.live:
                sim.abort([rng.choice(list(sim.live))])
            sim.update(p)
        elif op < 0.96:
            used = sim.sched.stats().num_blocks - sim.sched.stats().num_free_blocks
            n = rng.randrange(1, 32)
            try:
                sim.sched.resize(n)
                assert used <= n
            except ResizeError:
                assert used > n
        else:
            assert sim.sched.reset_prefix_cache() == (
                sim.sched.stats().num_free_blocks == sim.sched.num_blocks
            )
        sim.sched.check_invariants()
        sim.check_table()  # only schedule() writes the table: the runner's copy stays equal
    sim.drain()
    return sim


@pytest.mark.parametrize("chunk", range(4))
def test_random_sequences(chunk: int) -> None:
    totals = dict.fromkeys(("preempted", "swap_out", "copies", "moves"), 0)
    for seed in range(chunk * 100, chunk * 100 + 100):
        sim = _run(seed, 50)
        for k in totals:
            totals[k] += sim.seen[k]
    assert all(v > 0 for v in totals.values()), totals


def test_abort_everything_frees_everything() -> None:
    for seed in range(30):
        rng = random.Random(seed)
        sim = Sim.make(seed=seed, **_config(rng))
        for _ in range(30):
            if rng.random() < 0.4:
                try:
                    sim.add(_prompt(rng), n=rng.randrange(1, 3), max_tokens=rng.randrange(1, 12))
                except InvalidRequestError:
                    pass
            else:
                sim.step()
        sim.abort(list(sim.live))
        if sim.sched.has_unfinished():  # finished (pool too small) but not yet reported
            p = sim.sched.schedule()
            sim.sched.update(p, [])
        sim.assert_all_free()
