"""Scheduler behaviour through the binding: arrays, chunking, priorities, preemption, swap, n > 1
copy-on-write, prefix caching, abort, resize, stop checks."""

import threading

import numpy as np
import pytest

from pagedrs._core import FinishReason, Scheduler, StepPlan
from tests.core.sim import Sim

I32 = {
    "num_scheduled_tokens",
    "num_computed_tokens",
    "num_prompt_tokens",
    "seq_lens",
    "query_start_loc",
    "block_tables",
}
I64 = {
    "req_ids",
    "input_ids",
    "positions",
    "slot_mapping",
    "logits_indices",
    "sampled_seq_ids",
    "swap_out",
    "swap_in",
    "copies",
    "block_moves",
    "preempted",
}


def test_plan_arrays_and_a_request_lifecycle() -> None:
    s = Scheduler(num_blocks=8, block_size=4)
    s.add_request([5], np.array([11, 12, 13, 14, 15], dtype=np.int32), max_tokens=2)
    p = s.schedule()
    assert isinstance(p, StepPlan)
    for name in I32 | I64:
        arr = getattr(p, name)
        assert isinstance(arr, np.ndarray), name
        assert arr.dtype == (np.int32 if name in I32 else np.int64), name
        assert getattr(p, name) is arr  # cached: one array per plan
    assert p.req_ids.tolist() == [5]
    assert p.input_ids.tolist() == [11, 12, 13, 14, 15]
    assert p.positions.tolist() == [0, 1, 2, 3, 4]
    assert p.query_start_loc.tolist() == [0, 5]
    assert p.seq_lens.tolist() == [5] and p.num_computed_tokens.tolist() == [0]
    assert p.num_prompt_tokens.tolist() == [5]
    assert p.block_tables.shape == (1, 2)
    bt = p.block_tables[0]
    assert p.slot_mapping.tolist() == [bt[0] * 4 + i for i in range(4)] + [bt[1] * 4]
    assert p.logits_indices.tolist() == [4] and p.sampled_seq_ids.tolist() == [5]
    assert (p.num_prefill_tokens, p.num_decode_tokens, p.num_tokens, p.num_blocks) == (5, 0, 5, 8)
    for name in ("swap_out", "swap_in", "copies", "block_moves"):
        assert getattr(p, name).shape == (0, 2)
    assert "StepPlan(" in repr(p)
    assert s.update(p, np.array([21])) == []
    p = s.schedule()
    assert p.input_ids.tolist() == [21] and p.positions.tolist() == [5]
    assert (p.num_prefill_tokens, p.num_decode_tokens) == (0, 1)
    assert s.update(p, np.array([22])) == [(5, FinishReason.LENGTH, None)]
    assert not s.has_unfinished()
    assert s.stats().num_free_blocks == 8


def test_empty_plan_needs_no_update() -> None:
    s = Scheduler(num_blocks=4)
    p = s.schedule()
    assert p.num_tokens == 0 and p.block_tables.shape == (0, 0)
    assert s.update(p, np.zeros(0, dtype=np.int64)) == []
    s.schedule()  # fine without update too


def test_chunked_prefill_shares_steps_with_decodes() -> None:
    sim = Sim.make(num_blocks=32, block_size=4, max_num_batched_tokens=8)
    sim.vocab = 50
    sim.add([1, 2, 3], max_tokens=5, ignore_eos=True)
    sim.step()  # prefill of the short one
    sim.add(list(range(2, 22)), max_tokens=2)  # 20 tokens: chunks of 7, 8, 5 beside the decode
    chunks = []
    for _ in range(3):
        p, _ = sim.step()
        assert p.num_decode_tokens == 1
        chunks.append(p.num_prefill_tokens)
        assert len(p.logits_indices) == (2 if len(chunks) == 3 else 1)
    assert chunks == [7, 7, 6]
    sim.drain()


def test_no_chunking_waits_for_a_step_with_room() -> None:
    sim = Sim.make(num_blocks=32, block_size=4, max_num_batched_tokens=16, enable_chunked_prefill=False)
    sim.add([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], max_tokens=3)
    sim.add([2] * 10, max_tokens=3)
    p, _ = sim.step()
    assert p.req_ids.tolist() == [1]  # the second (10 tokens) does not fit the 6 left
    p, _ = sim.step()
    assert sorted(p.num_scheduled_tokens.tolist()) == [1, 10]
    sim.drain()


def test_priority_then_arrival() -> None:
    sim = Sim.make(num_blocks=32, block_size=4, max_num_seqs=1)
    a = sim.add([1, 2], max_tokens=1, priority=1)
    b = sim.add([1, 3], max_tokens=1, priority=0)
    c = sim.add([1, 4], max_tokens=1, priority=0)
    order = []
    while sim.sched.has_unfinished():
        p, _ = sim.step()
        order += p.req_ids.tolist()
    assert order == b + c + a


def test_preemption_by_recompute_keeps_outputs() -> None:
    sim = Sim.make(num_blocks=6, block_size=2, max_num_seqs=4, watermark=0.0, seed=3)
    sim.vocab = 50  # eos (0) is rare
    a = sim.add([1, 2, 3, 4], max_tokens=6, priority=0)[0]
    b = sim.add([5, 6, 7, 8], max_tokens=6, priority=1)[0]
    preempted = []
    for _ in range(200):
        if not sim.sched.has_unfinished():
            break
        p, _ = sim.step()
        preempted += p.preempted.tolist()
    assert b in preempted and a not in preempted  # the lower priority one is the victim
    assert sim.sched.stats().num_preemptions >= 1
    sim.drain()


def test_preemption_by_swap() -> None:
    sim = Sim.make(num_blocks=6, block_size=2, max_num_seqs=4, watermark=0.0, num_swap_blocks=16, seed=5)
    sim.vocab = 50
    sim.add([1, 2, 3, 4], max_tokens=6)
    sim.add([5, 6, 7, 8], max_tokens=6)
    swapped_seen = False
    for _ in range(200):
        if not sim.sched.has_unfinished():
            break
        sim.step()
        swapped_seen |= sim.sched.stats().num_swapped > 0
    assert swapped_seen and sim.seen["swap_out"] > 0
    sim.drain()


def test_n_children_share_the_prompt_and_copy_on_write() -> None:
    sim = Sim.make(num_blocks=16, block_size=4)
    ids = sim.add([1, 2, 3, 4, 5, 6], n=3, max_tokens=4)
    assert sim.sched.num_unfinished() == 3 and sim.sched.stats().num_waiting == 3
    p = sim.schedule_and_run()
    assert p.req_ids.tolist() == [ids[0]]
    assert p.sampled_seq_ids.tolist() == ids
    assert p.logits_indices.tolist() == [5, 5, 5]
    assert sim.sched.stats().num_free_blocks == 14  # children share both prompt blocks
    sim.update(p, np.array([7, 8, 9]))
    p = sim.schedule_and_run()
    assert sorted(p.req_ids.tolist()) == ids
    assert len(p.copies) == 2  # two of the three copy the shared partial block; the last keeps it
    assert p.input_ids.tolist() == [7, 8, 9] or sorted(p.input_ids.tolist()) == [7, 8, 9]
    sim.update(p)
    sim.drain()


def test_prefix_cache_hit_skips_cached_blocks_but_not_the_last_token() -> None:
    s = Scheduler(num_blocks=16, block_size=4)
    prompt = list(range(10, 22))  # 12 tokens: three full blocks
    s.add_request([1], prompt, max_tokens=1)
    p = s.schedule()
    s.update(p, [3])
    s.add_request([2], prompt, max_tokens=1)
    p = s.schedule()
    # Blocks 0 and 1 hit; block 2 holds the last prompt token, which must be computed.
    assert p.num_computed_tokens.tolist() == [8] and p.num_scheduled_tokens.tolist() == [4]
    assert s.num_cached_tokens(2) == 8
    st = s.stats()
    assert (st.prefix_cache_queries, st.prefix_cache_hits) == (24, 8)
    s.update(p, [3])
    s.add_request([3], prompt[:6] + [99, 98], max_tokens=1)  # shares one block
    p = s.schedule()
    assert p.num_computed_tokens.tolist() == [4]
    s.update(p, [1])
    s.check_invariants()


def test_cache_salt_and_skip_isolate() -> None:
    s = Scheduler(num_blocks=16, block_size=4)
    prompt = list(range(10, 22))
    for sid, kw in [
        (1, {}),
        (2, {"cache_salt": "tenant-a"}),
        (3, {"skip_prefix_cache": True}),
        (4, {"cache_salt": "tenant-a"}),
    ]:
        s.add_request([sid], prompt, max_tokens=1, **kw)
        p = s.schedule()
        s.update(p, [3])
    assert s.stats().prefix_cache_hits == 8  # only seq 4 (same salt as seq 2) hit


def test_reset_prefix_cache_only_when_idle() -> None:
    s = Scheduler(num_blocks=16, block_size=4)
    s.add_request([1], list(range(10, 22)), max_tokens=2)
    p = s.schedule()
    s.update(p, [3])
    assert s.reset_prefix_cache() is False
    s.abort([1])
    assert s.reset_prefix_cache() is True
    s.add_request([2], list(range(10, 22)), max_tokens=1)
    assert s.schedule().num_computed_tokens.tolist() == [0]


def test_abort_in_every_state() -> None:
    sim = Sim.make(num_blocks=6, block_size=2, max_num_batched_tokens=4, num_swap_blocks=8, max_num_seqs=3)
    sim.vocab = 50
    waiting = sim.add([1] * 6, max_tokens=8)
    family = sim.add([2, 3, 4, 5, 6, 7, 8], n=3, max_tokens=8)
    p = sim.schedule_and_run()  # first one mid-prefill (chunk of 4 of 6)
    assert p.req_ids.tolist() == waiting
    sim.abort(waiting)  # running, mid-prefill, between schedule and update
    sim.update(p)
    sim.abort([family[1]])  # a child that has not forked yet
    sim.abort([family[0]])  # the parent: the remaining child takes over the prefill
    assert sim.sched.num_unfinished() == 1
    p = sim.schedule_and_run()
    assert p.req_ids.tolist() == [family[2]]
    sim.update(p)
    for _ in range(50):
        if not sim.sched.has_unfinished():
            break
        sim.add([9, 9, 9], max_tokens=8)
        sim.step()
        ids = list(sim.live)
        if sim.sched.stats().num_swapped and ids:
            sim.abort(ids[:1])
    sim.abort(list(sim.live))
    sim.assert_all_free()


def test_resize_grow_and_shrink_while_serving() -> None:
    sim = Sim.make(num_blocks=8, block_size=2, seed=2)
    sim.vocab = 50
    sim.add([1, 2, 3], max_tokens=6)
    sim.step()
    sim.sched.resize(24)
    assert sim.sched.num_blocks == 24
    p, _ = sim.step()
    assert p.num_blocks == 24
    sim.add([4, 5, 6, 7, 8, 9, 10], max_tokens=6)
    sim.add([4, 5, 6, 7, 8, 9, 11], max_tokens=6)
    sim.step()
    sim.sched.resize(12)
    p, _ = sim.step()  # the moves ride on this plan, and the runner shrinks after it
    assert p.num_blocks == 12 and len(p.block_moves) > 0
    assert (p.block_tables < 12).all()
    sim.drain()
    assert sim.seen["moves"] > 0


@pytest.mark.parametrize(
    ("kw", "tokens", "want"),
    [
        ({}, [4, 0], (1, FinishReason.STOP, None)),
        ({"stop_token_ids": [4]}, [4], (1, FinishReason.STOP, 4)),
        ({"min_tokens": 2}, [0, 0], (1, FinishReason.STOP, None)),
        ({"ignore_eos": True}, [0, 0, 0], (1, FinishReason.LENGTH, None)),
        ({"max_tokens": 100}, [5] * 6, (1, FinishReason.LENGTH, None)),  # clipped by max_model_len 10
    ],
)
def test_stop_checks(kw: dict, tokens: list[int], want: tuple) -> None:
    s = Scheduler(num_blocks=8, block_size=4, max_model_len=10)
    args = {"max_tokens": 3, "eos_token_ids": [0]} | kw
    s.add_request([1], [1, 2, 3, 4], **args)
    for i, t in enumerate(tokens):
        p = s.schedule()
        fin = s.update(p, [t])
        if i < len(tokens) - 1:
            assert fin == []
    assert fin == [want]


def test_thread_safety_and_gil_release() -> None:
    s = Scheduler(num_blocks=256, block_size=4, max_num_seqs=64)
    stop = threading.Event()
    errors: list[BaseException] = []

    def churn() -> None:
        i = 1000
        try:
            while not stop.is_set():
                s.add_request([i], [1, 2, 3, 4, 5], max_tokens=3)
                s.abort([i - 3])
                s.stats()
                i += 1
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=churn)
    t.start()
    try:
        for _ in range(300):
            p = s.schedule()
            s.update(p, np.full(len(p.sampled_seq_ids), 7, dtype=np.int64))
    finally:
        stop.set()
        t.join()
    assert not errors
    s.check_invariants()
