"""The sliding-window KV pool under tensor parallelism: each step plan carries every KV-cache group's tables
(slot mapping, block tables, copy-on-write pairs) to the other ranks, with no message of their own, so every
rank keeps only the window's blocks of its local layers; a tiny Gemma 3 (window 8, one KV head replicated,
its two query heads split over 2 ranks) gives HF transformers' greedy ids with window blocks freed
mid-request, reused by other requests, and a forked request's shared partial block copied on every rank;
with the window tables zeroed in the packet the other rank reads the wrong blocks and the ids change."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import pagedrs.executor.executor as executor_module
from pagedrs import _core
from pagedrs.executor import TPExecutor
from pagedrs.executor.step_packet import Op, pack_step, unpack_step
from pagedrs.runner.kv_groups import max_live_blocks
from tests.distributed.helpers_tp import tp_engine
from tests.engine.conftest import assert_pool_free, greedy, random_prompts
from tests.helpers import make_tiny_model
from tests.models.helpers_families import WINDOW, gemma3_config, hf_reference

BLOCK = 4
STEP = 8


def test_tp2_window_pool_equals_hf(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path / "gemma3", gemma3_config())
    ref = hf_reference(folder)
    engine = tp_engine(folder, 2, num_kv_blocks=40, max_num_batched_tokens=STEP)
    try:
        assert isinstance(engine.engine_core.executor, TPExecutor)
        assert [g.window for g in engine.engine_core.executor.runner.kv_groups] == [WINDOW]
        window, num_window_blocks, _ = _window_pool(engine)
        assert window == WINDOW and num_window_blocks < 40
        # One 60-token prompt alone: 15+ full blocks, never more than the live window blocks of local ones.
        used: list[int] = []
        prompt = random_prompts([60], seed=5)[0]
        engine.add_request("long", prompt, greedy(8))
        while engine.has_unfinished_requests():
            outs = engine.step()
            _, n, free = _window_pool(engine)
            used.append(n - free)
        assert [list(c.token_ids) for c in outs[0].outputs] == [ref(prompt, 8)]
        assert max(used) <= max_live_blocks(WINDOW, BLOCK, STEP) < 60 // BLOCK, used
        prompts = random_prompts([60, 44, 37], seed=6) + [random_prompts([38], seed=8)[0]]
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, greedy(6, n=2 if i == 3 else 1))  # n=2: copy-on-write
        final = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = [list(c.token_ids) for c in out.outputs]
            _, n, free = _window_pool(engine)
            used.append(n - free)
        for i, p in enumerate(prompts):
            assert final[str(i)] == [ref(p, 6)] * (2 if i == 3 else 1), i
        # The requests' blocks over the run outnumber the window pool: freed blocks were reused.
        assert sum(-(-len(p) // BLOCK) for p in prompts) > num_window_blocks
        assert_pool_free(engine)
        _, n, free = _window_pool(engine)
        assert free == n
        engine.scheduler.check_invariants()
    finally:
        engine.shutdown()


def _window_pool(engine) -> tuple[int, int, int]:
    ((_, window, n, free),) = engine.scheduler.kv_group_pools()
    return window, n, free


def test_the_step_packet_carries_every_group_table() -> None:
    """A plan of a scheduler with two window groups, through the step channel: the other rank's plan has
    every group's slot mapping, tables and copy-on-write pairs, and the header has no opcode for them."""
    s = _core.Scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=64, max_model_len=128)
    assert [s.add_window_group(8, 32), s.add_window_group(16, 32)] == [0, 1]
    s.add_request([1], list(range(1, 31)), max_tokens=4)
    s.add_request([2], list(range(40, 43)), max_tokens=4)
    plan = s.schedule()
    assert plan.num_groups == 2 and plan.group_slot_mapping.shape == (2, int(plan.num_tokens))
    header, payload = pack_step(plan, None)
    assert int(header[0]) == Op.EXECUTE and {op.name for op in Op} == {
        "EXECUTE",
        "SHUTDOWN",
        "LIQUID",
        "LORA",
    }
    got, _ = unpack_step(header.numpy(), payload.numpy())
    assert got.num_groups == 2
    for name in ("group_slot_mapping", "group_block_tables", "group_copies", "group_num_copies"):
        assert np.array_equal(getattr(got, name), getattr(plan, name)), name
    assert got.group_block_tables.shape == (2, 2, plan.block_tables.shape[1])
    table = s.group_blocks_of(0, 1)
    assert got.group_block_tables[0, 0, : len(table)].tolist() == [max(b, 0) for b in table]


def _zero_group_tables(header: torch.Tensor, payload: torch.Tensor) -> None:
    """Zero the group block tables in a step packet (the plan's 22nd array), as a broken channel would."""
    lens = header[2 + 6 :].tolist()
    start = sum(lens[:21])
    payload[start : start + lens[21]] = 0


def test_zeroed_window_tables_in_the_packet_change_the_other_ranks_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 reads the window tables from the packet alone: zeroed there (rank 0 keeps its own), the
    local layers of rank 1 read the wrong blocks and the greedy ids leave HF's."""
    folder = make_tiny_model(tmp_path / "gemma3", gemma3_config())
    ref = hf_reference(folder)
    real = executor_module.pack_step
    zeroed = []

    def broken(plan, extra):  # type: ignore[no-untyped-def]
        header, payload = real(plan, extra)
        if plan.num_groups and plan.group_block_tables.any():
            _zero_group_tables(header, payload)
            zeroed.append(plan.step_id)
        return header, payload

    monkeypatch.setattr(executor_module, "pack_step", broken)
    engine = tp_engine(folder, 2, num_kv_blocks=40, max_num_batched_tokens=STEP)
    try:
        prompts = random_prompts([60, 44], seed=6)
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, greedy(8))
        final = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = list(out.outputs[0].token_ids)
        assert zeroed
        assert any(final[str(i)] != ref(p, 8) for i, p in enumerate(prompts)), final
    finally:
        engine.shutdown()
