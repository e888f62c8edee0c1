"""Resizing the KV pool while requests run, with KV-cache groups beside it: a model whose every layer is
windowed (Mistral with a window shorter than the context), a model with window and full-attention layers
(Gemma 3), and a hybrid with recurrent state (Qwen3.5). The window pools shrink and grow in proportion to the
full-attention pool, their in-use blocks moved by the plan onto the groups' own layers; the recurrent state
slots keep their number. The greedy ids equal an unresized run's; a shrink the in-use window blocks do not fit
is refused with the numbers and changes nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pagedrs import LLMEngine
from tests.engine.conftest import assert_pool_free, greedy, make_engine, random_prompts
from tests.helpers import make_tiny_llama, make_tiny_model
from tests.models.helpers_families import gemma3_config
from tests.models.helpers_qwen3_5 import qwen3_5_config

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("mistral_rs"), arch="mistral", sliding_window=6)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("gemma3_rs") / "m", gemma3_config())


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("qwen35_rs") / "m", qwen3_5_config())


def _engine(folder: Path, num_kv_blocks: int) -> LLMEngine:
    return make_engine(
        folder,
        dtype="float32",
        block_size=4,
        num_kv_blocks=num_kv_blocks,
        max_num_batched_tokens=8,
        max_model_len=64,
        enable_prefix_caching=True,
    )


def _pools(engine: LLMEngine) -> list[int]:
    """The full-attention pool's blocks, then each group's."""
    groups = [int(n) for _, _, n, _ in engine.scheduler.kv_group_pools()]
    return [int(engine.scheduler.num_blocks), *groups]


def _run(
    engine: LLMEngine, prompts: list[list[int]], resizes: dict[int, int]
) -> tuple[dict[str, list[int]], int]:
    """Greedy ids of `prompts`, the pool resized to `resizes[k]` blocks after step k; and the group block moves
    the plans carried."""
    moves = 0
    execute = engine.engine_core.executor.execute

    def spy(plan: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal moves
        moves += len(plan.group_block_moves)
        return execute(plan, *args, **kwargs)

    engine.engine_core.executor.execute = spy  # type: ignore[method-assign]
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, greedy(MAX_TOKENS))
    final: dict[str, list[int]] = {}
    step = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = list(out.outputs[0].token_ids)
        step += 1
        if step in resizes:
            engine.scheduler.resize(resizes[step])
            engine.scheduler.check_invariants()
    return final, moves


@pytest.mark.parametrize(
    ("model", "num_kv_blocks"),
    [("mistral", 16), ("gemma3", 48), ("qwen3_5", 32)],
)
def test_resize_down_and_up_while_running_keeps_the_ids(
    model: str, num_kv_blocks: int, request: pytest.FixtureRequest
) -> None:
    folder: Path = request.getfixturevalue(model)
    prompts = random_prompts([14, 9, 11], seed=5)
    base, _ = _run(_engine(folder, num_kv_blocks), prompts, {})
    engine = _engine(folder, num_kv_blocks)
    start = _pools(engine)
    # Grown first, so the running requests hold the new high blocks the shrink then moves down.
    after, moves = _run(engine, prompts, {1: engine.scheduler.num_blocks * 2, 6: engine.scheduler.num_blocks})
    assert after == base
    assert len(after) == len(prompts) and all(len(ids) == MAX_TOKENS for ids in after.values())
    assert _pools(engine) == start  # back to the start sizes, every group in proportion
    windowed = model != "qwen3_5"
    assert (moves > 0) == windowed, moves  # the recurrent group's state slots never move
    engine.scheduler.resize(engine.scheduler.num_blocks * 2)
    grown_pools = _pools(engine)
    if windowed:
        assert grown_pools[1] == 2 * start[1]
    else:
        assert grown_pools[1] == start[1]  # state slots are sized by max_num_seqs, not the KV budget
    assert_pool_free(engine)


def test_a_shrink_the_window_blocks_do_not_fit_is_refused(gemma3: Path) -> None:
    engine = _engine(gemma3, 48)
    start = _pools(engine)
    engine.scheduler.resize(start[0] * 10)  # the window pool grows tenfold too
    # Many short requests at once: each holds about as many window blocks as full-attention ones.
    for i, prompt in enumerate(random_prompts([8] * 12, seed=9)):
        engine.add_request(str(i), prompt, greedy(MAX_TOKENS))
    for _ in range(14):
        engine.step()
    before = _pools(engine)
    stats = engine.scheduler.stats()
    full_in_use = int(stats.num_blocks) - int(stats.num_free_blocks)
    _, _, n, free = engine.scheduler.kv_group_pools()[0]
    in_use = int(n) - int(free)
    # The smallest pool the full-attention blocks fit; its window pool in proportion is too small.
    window_target = -(-start[1] * full_in_use // start[0])
    assert in_use > window_target, (in_use, window_target)
    with pytest.raises(
        ValueError,
        match=f"window:8 group's pool cannot shrink from {n} to {window_target} blocks: {in_use} are in use",
    ):
        engine.scheduler.resize(full_in_use)
    assert _pools(engine) == before
    engine.scheduler.check_invariants()
