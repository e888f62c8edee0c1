"""One host-to-device copy per step: the packed step inputs equal the per-array construction the runner used
before (each array converted on its own, the block table read through a mirror updated from the changed
rows), for real plans of the Rust scheduler through chunked prefill, decode, preemption and finishes; the
graph layout pads a decode batch the way CUDA graphs need; a plan over the limits still packs."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pagedrs._core import Scheduler
from pagedrs.runner.step_buffers import StepBuffers

BLOCK = 4
MAX_LEN = 64
WIDTH = MAX_LEN // BLOCK


def _old(arr: np.ndarray) -> torch.Tensor:
    """The runner's former per-array conversion."""
    return torch.from_numpy(np.array(arr))


def _plans(seed: int, max_num_seqs: int = 6, budget: int = 24):
    """Yield (scheduler, plan) over a random workload; the caller reads the plan before the next one."""
    rng = random.Random(seed)
    sched = Scheduler(
        num_blocks=20,
        block_size=BLOCK,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        max_model_len=MAX_LEN,
        enable_prefix_caching=True,
    )
    next_id = 0
    for step in range(80):
        if step < 40 and rng.random() < 0.4:
            n = rng.choice([1, 1, 2])
            prompt = [rng.randrange(1, 30) for _ in range(rng.randrange(1, 30))]
            sched.add_request(list(range(next_id, next_id + n)), prompt, max_tokens=rng.randrange(1, 20))
            next_id += n
        plan = sched.schedule()
        yield sched, plan
        sched.update(plan, np.array([rng.randrange(1, 30) for _ in plan.sampled_seq_ids], dtype=np.int64))


@pytest.mark.parametrize("mirror", [True, False])
def test_packed_inputs_equal_per_array_construction(mirror: bool) -> None:
    bufs = StepBuffers(
        max_num_tokens=24, max_num_reqs=6, table_width=WIDTH, graph_rows=4, device=torch.device("cpu")
    )
    seen = {"decode": 0, "prefill": 0, "changed": 0, "extra": 0, "preempted": 0}
    mirror_dev: torch.Tensor | None = None
    ref_table: np.ndarray | None = None
    rng = random.Random(1)
    for sched, plan in _plans(seed=0):
        view = sched.block_table_view()
        if mirror_dev is None:
            mirror_dev = torch.from_numpy(view.copy())
            ref_table = view.copy()
        extra = None
        if plan.num_tokens and rng.random() < 0.3:
            extra = np.sort(rng.sample(range(plan.num_tokens), rng.randrange(1, plan.num_tokens + 1))).astype(
                np.int64
            )
            seen["extra"] += 1
        inputs = bufs.pack(plan, extra_logits_indices=extra, mirror_rows=view if mirror else None)
        assert torch.equal(inputs.input_ids, _old(plan.input_ids))
        assert torch.equal(inputs.positions, _old(plan.positions))
        assert torch.equal(inputs.slot_mapping, _old(plan.slot_mapping))
        assert torch.equal(inputs.query_start_loc, _old(plan.query_start_loc))
        assert torch.equal(inputs.seq_lens, _old(plan.seq_lens))
        idx = plan.logits_indices if extra is None else np.concatenate([plan.logits_indices, extra])
        if len(idx):
            assert torch.equal(inputs.logits_indices, _old(idx))
            assert inputs.logits_are_all_rows == (
                extra is None and np.array_equal(idx, np.arange(plan.num_tokens))
            )
        else:
            assert inputs.logits_indices is None
        dense = plan.block_tables  # the old construction (a dense padded copy)
        if mirror:
            assert ref_table is not None and mirror_dev is not None
            changed = plan.changed_rows
            ref_table[changed] = view[changed]  # the old mirror update
            if inputs.changed_rows is not None:
                mirror_dev.index_copy_(0, inputs.changed_rows, inputs.changed_row_data)
                seen["changed"] += 1
            assert np.array_equal(mirror_dev.numpy(), ref_table)
            tables = mirror_dev.index_select(0, inputs.block_table_rows)
            assert torch.equal(tables[:, : dense.shape[1]], torch.from_numpy(dense))
            assert not tables[:, dense.shape[1] :].any()
        else:
            assert inputs.block_tables is not None
            assert torch.equal(inputs.block_tables, torch.from_numpy(dense))
        if plan.num_tokens:
            seen["decode" if plan.num_tokens == len(plan.seq_lens) else "prefill"] += 1
        seen["preempted"] += len(plan.preempted)
    if not mirror:
        del seen["changed"]
    assert all(seen.values()), seen


def test_graph_layout_pads_a_decode_batch() -> None:
    bufs = StepBuffers(
        max_num_tokens=32, max_num_reqs=8, table_width=WIDTH, graph_rows=8, device=torch.device("cpu")
    )
    static = bufs.graph_inputs()
    n, size = 3, 4
    plan = SimpleNamespace(
        input_ids=np.array([11, 12, 13], dtype=np.int64),
        positions=np.array([5, 9, 20], dtype=np.int64),
        slot_mapping=np.array([21, 37, 80], dtype=np.int64),
        seq_lens=np.array([6, 10, 21], dtype=np.int32),
        query_start_loc=np.arange(n + 1, dtype=np.int32),
        logits_indices=np.arange(n, dtype=np.int64),
        block_table_rows=np.array([2, 0, 5], dtype=np.int32),
        changed_rows=np.array([5], dtype=np.int32),
    )
    view = np.arange(8 * WIDTH, dtype=np.int32).reshape(8, WIDTH)
    # Stale values past the batch must be overwritten with padding.
    for t in (static.input_ids, static.positions, static.slot_mapping, static.block_table_rows):
        t.fill_(77)
    static.seq_lens.fill_(77)
    inputs = bufs.pack(plan, mirror_rows=view, graph_size=size)
    assert inputs.graph_size == size and inputs.logits_are_all_rows
    assert static.input_ids[:size].tolist() == [11, 12, 13, 0]
    assert static.positions[:size].tolist() == [5, 9, 20, 0]
    assert static.slot_mapping[:size].tolist() == [21, 37, 80, -1]
    assert static.seq_lens[:size].tolist() == [6, 10, 21, 0]
    assert static.query_start_loc[: size + 1].tolist() == [0, 1, 2, 3, 4]
    assert static.block_table_rows[:size].tolist() == [2, 0, 5, 0]
    assert inputs.changed_rows.tolist() == [5]
    assert torch.equal(inputs.changed_row_data, torch.from_numpy(view[[5]]))
    # the step's views are the static inputs themselves (nothing is copied twice)
    assert inputs.input_ids.data_ptr() == static.input_ids.data_ptr()
    assert inputs.seq_lens.data_ptr() == static.seq_lens.data_ptr()
    with pytest.raises(ValueError, match="graph step"):
        bufs.pack(plan, mirror_rows=view, graph_size=2)


def test_a_plan_over_the_limits_still_packs() -> None:
    bufs = StepBuffers(
        max_num_tokens=4, max_num_reqs=1, table_width=2, graph_rows=1, device=torch.device("cpu")
    )
    t, b, w = 50, 5, 7
    plan = SimpleNamespace(
        input_ids=np.arange(t, dtype=np.int64),
        positions=np.arange(t, dtype=np.int64) + 1,
        slot_mapping=np.arange(t, dtype=np.int64) + 2,
        seq_lens=np.full(b, 10, dtype=np.int32),
        query_start_loc=np.arange(0, t + 1, 10, dtype=np.int32),
        logits_indices=np.arange(9, t, 10, dtype=np.int64),
        block_tables=np.arange(b * w, dtype=np.int32).reshape(b, w),
    )
    inputs = bufs.pack(plan)
    assert inputs.input_ids.tolist() == list(range(t))
    assert inputs.slot_mapping[-1].item() == t + 1
    assert torch.equal(inputs.block_tables, torch.from_numpy(plan.block_tables))
    assert inputs.logits_indices.tolist() == list(range(9, t, 10))
    assert not inputs.logits_are_all_rows
