"""The sliding-window KV pool under tensor parallelism: rank 0 sends each step's window tables (slot
mapping, block tables, copy-on-write pairs) to the other ranks with the plan, so every rank keeps only the
window's blocks of its local layers; a tiny Gemma 3 (window 8, one KV head replicated, its two query heads
split over 2 ranks) gives HF transformers' greedy ids with window blocks freed mid-request, reused by other
requests, and a forked request's shared partial block copied on every rank."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pagedrs.executor import TPExecutor
from pagedrs.executor.step_packet import Op, unpack_window, window_message
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
        assert engine.engine_core.executor.runner.window_group is not None
        window, num_window_blocks, _ = engine.scheduler.window_pool()
        assert window == WINDOW and num_window_blocks < 40
        # One 60-token prompt alone: 15+ full blocks, never more than the live window blocks of local ones.
        used: list[int] = []
        prompt = random_prompts([60], seed=5)[0]
        engine.add_request("long", prompt, greedy(8))
        while engine.has_unfinished_requests():
            outs = engine.step()
            _, n, free = engine.scheduler.window_pool()
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
            _, n, free = engine.scheduler.window_pool()
            used.append(n - free)
        for i, p in enumerate(prompts):
            assert final[str(i)] == [ref(p, 6)] * (2 if i == 3 else 1), i
        # The requests' blocks over the run outnumber the window pool: freed blocks were reused.
        assert sum(-(-len(p) // BLOCK) for p in prompts) > num_window_blocks
        assert_pool_free(engine)
        _, n, free = engine.scheduler.window_pool()
        assert free == n
        engine.scheduler.check_invariants()
    finally:
        engine.shutdown()


def test_window_message_round_trip() -> None:
    slots = np.array([5, 6, 7], dtype=np.int64)
    tables = np.array([[1, 2, 0], [3, 0, 0]], dtype=np.int32)
    copies = np.array([4, 9], dtype=np.int64)
    header, payload = window_message(slots, tables, copies)
    assert header[0] == Op.WINDOW and header[1] == payload.numel() == 3 + 6 + 2
    got = unpack_window(header.numpy(), payload.numpy())
    assert got[0].tolist() == [5, 6, 7] and got[2].tolist() == [4, 9]
    assert got[1].dtype == np.int32 and got[1].tolist() == tables.tolist()
