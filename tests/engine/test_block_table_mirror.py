"""The runner's device mirror of the scheduler's persistent block table (the CUDA path, forced on CPU here):
copying only each plan's changed rows must give the same tokens as the full padded table, through
preemption by swap, copy-on-write (n=2) and a pool resize, and the mirror must equal the view after every
step."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tests.engine.conftest import HFReference, PlanSpy, assert_pool_free, greedy, make_engine, random_prompts
from tests.engine.helpers_greedy import check_against_hf, run_batch


def _mirror_engine(path: Path, **kwargs):
    engine = make_engine(path, **kwargs)
    engine.runner.attach_block_table(engine.scheduler.block_table_view(), mirror=True)
    assert engine.runner._bt_device is not None
    return engine


def _check_mirror_each_step(engine) -> list[int]:
    """Wrap execute: after the runner synced, its mirror equals the scheduler's view; count changed rows."""
    inner = engine.runner.execute
    changed: list[int] = []

    def execute(plan, *args, **kwargs):
        out = inner(plan, *args, **kwargs)
        changed.append(len(plan.changed_rows))
        view = engine.scheduler.block_table_view()
        rows = plan.block_table_rows
        np.testing.assert_array_equal(engine.runner._bt_device.numpy()[rows], view[rows])
        return out

    engine.runner.execute = execute
    return changed


def test_mirror_matches_hf_with_swap_and_n2(
    tiny_models: dict[str, Path], hf_refs: dict[str, HFReference]
) -> None:
    prompts = random_prompts([5, 40, 150, 300], seed=3)
    max_tokens = [48, 40, 30, 12]
    engine = _mirror_engine(
        tiny_models["llama"], num_kv_blocks=22, max_num_batched_tokens=256, swap_space=0.002
    )
    spy = PlanSpy().attach(engine)
    changed = _check_mirror_each_step(engine)
    outs = run_batch(engine, prompts, max_tokens)
    check_against_hf(outs, prompts, max_tokens, hf_refs["llama"])
    assert spy.swap_outs > 0 and sum(changed) > 0
    assert_pool_free(engine)

    engine.add_request("n2", prompts[1], greedy(20, n=2))
    changed.clear()
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out if out.finished else final
    assert final is not None and len(final.outputs) == 2
    expected = hf_refs["llama"](prompts[1], 20)
    assert all(c.token_ids == expected for c in final.outputs)
    assert_pool_free(engine)


def test_mirror_survives_resize(tiny_models: dict[str, Path], hf_refs: dict[str, HFReference]) -> None:
    prompts = random_prompts([30, 70], seed=5)
    engine = _mirror_engine(tiny_models["qwen2"], num_kv_blocks=64, max_num_batched_tokens=64)
    _check_mirror_each_step(engine)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, greedy(24))
    engine.step()
    engine.step()
    engine.scheduler.resize(24)  # shrink: in-use blocks above 24 move down, rows are rewritten
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    for i, p in enumerate(prompts):
        assert final[str(i)].outputs[0].token_ids == hf_refs["qwen2"](p, 24)
    assert torch.equal(
        engine.runner._bt_device, torch.from_numpy(np.array(engine.scheduler.block_table_view()))
    )
