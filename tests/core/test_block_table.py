"""The persistent block table through the binding: the zero-copy view, plan.block_table_rows,
plan.changed_rows, and plan.block_tables gathered lazily from the view."""

import gc

import numpy as np
import pytest

from pagedrs._core import FinishReason, PagedrsError, Scheduler


def _sched(**kw: int) -> Scheduler:
    args = dict(num_blocks=64, block_size=4, max_num_seqs=3, max_model_len=32, watermark=0.0)
    args.update(kw)
    return Scheduler(**args)  # type: ignore[arg-type]


def _data_ptr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def test_view_is_a_read_only_zero_copy_table_of_final_size() -> None:
    s = _sched()
    v = s.block_table_view()
    assert v.shape == (3, 8) and v.dtype == np.int32 and v.flags.c_contiguous
    assert not v.flags.writeable and not v.flags.owndata
    with pytest.raises(ValueError):
        v[0, 0] = 1
    with pytest.raises(ValueError):
        v.flags.writeable = True
    s.add_request([1], [5] * 6, max_tokens=4)
    p = s.schedule()
    # Written in place: the view taken before schedule() sees the new row, and every view shares
    # the same memory.
    assert p.block_table_rows.tolist() == [0] and p.changed_rows.tolist() == [0]
    assert (v[0, :2] == p.block_tables[0]).all() and not v[0, 2:].any()
    assert _data_ptr(s.block_table_view()) == _data_ptr(v)


def test_view_keeps_the_scheduler_alive() -> None:
    s = _sched()
    s.add_request([1], [5] * 6, max_tokens=4)
    s.schedule()
    v = s.block_table_view()
    row = v[0].copy()
    assert v.base is s
    del s
    gc.collect()
    assert isinstance(v.base, Scheduler)  # the memory lives as long as the view
    assert (v[0] == row).all() and (v[0, :2] != 0).any()


def test_block_tables_are_gathered_lazily_and_only_until_the_next_schedule() -> None:
    s = _sched()
    s.add_request([1], [5] * 9, max_tokens=4)
    s.add_request([2], [6] * 2, max_tokens=4)
    p = s.schedule()
    view = s.block_table_view()
    rows = p.block_table_rows
    assert rows.dtype == np.int32 and rows.shape == (2,)
    bt = p.block_tables
    assert bt.shape == (2, 3) and bt.dtype == np.int32
    assert (bt == view[rows, :3]).all()
    assert bt[1, 1:].tolist() == [0, 0]
    assert p.block_tables is bt  # cached
    s.update(p, np.array([7, 7]))
    q = s.schedule()
    assert (p.block_tables == bt).all()  # already read: kept
    s.update(q, np.array([7, 7]))
    r = s.schedule()
    with pytest.raises(PagedrsError, match="before the next schedule"):
        q.block_tables  # noqa: B018 - never read, and a later schedule() may have rewritten it
    assert r.block_tables.shape[0] == 2


def test_changed_rows_name_exactly_the_rewritten_rows() -> None:
    s = _sched(max_num_seqs=2)
    s.add_request([1], [5] * 3, max_tokens=1)
    s.add_request([2], [6] * 3, max_tokens=8)
    s.add_request([3], [7] * 5, max_tokens=8)
    view = s.block_table_view()
    p = s.schedule()
    assert p.changed_rows.tolist() == [0, 1]
    assert s.update(p, np.array([9, 9])) == [(1, FinishReason.LENGTH, None)]
    # Seq 2 writes position 3 (its first block, no change); seq 3 takes the freed row 0.
    p = s.schedule()
    assert p.req_ids.tolist() == [2, 3]
    assert p.block_table_rows.tolist() == [1, 0]
    assert p.changed_rows.tolist() == [0]
    assert (view[0, :2] == p.block_tables[1]).all() and not view[0, 2:].any()
    s.update(p, np.array([9, 9]))
    p = s.schedule()  # seq 2 needs a second block: only its row changes
    assert p.changed_rows.tolist() == [1]
    assert (view[1, :2] == p.block_tables[0]).all()


def test_a_runner_copy_fed_changed_rows_tracks_the_table_under_preemption_and_resize() -> None:
    from tests.core.sim import Sim

    sim = Sim.make(num_blocks=10, block_size=2, max_num_seqs=4, num_swap_blocks=8, watermark=0.0, seed=7)
    sim.vocab = 50
    for k in range(6):
        sim.add([2 + k % 3] * (3 + k), n=1 + (k + 1) % 2, max_tokens=12)
    for i in range(40):
        sim.step()  # checks the copy against the view and reads the batch's blocks through it
        sim.check_table()
        if i == 5:
            sim.sched.resize(40)
        if i == 12:
            sim.sched.resize(max(12, sim.sched.num_blocks - sim.sched.stats().num_free_blocks))
    sim.drain()
    assert sim.seen["preempted"] > 0 and sim.seen["copies"] > 0 and sim.seen["moves"] > 0, sim.seen
