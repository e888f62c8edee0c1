"""The host KV tier under tensor parallelism: every rank stores its own KV heads into its own tier and loads
them back from the same plan; greedy ids equal one rank's, and the returning prompt is served from the tier."""

from __future__ import annotations

from pathlib import Path

from pagedrs import LLMEngine
from tests.distributed.helpers_tp import tp_engine
from tests.engine.conftest import greedy, run_all
from tests.helpers import make_tiny_llama

FIRST = list(range(3, 43))  # 10 blocks of 4 tokens
OTHERS = [list(range(100, 140)), list(range(150, 190))]  # each takes most of the 20-block pool


def sessions(engine: LLMEngine) -> tuple[list[list[int]], int]:
    """Greedy ids of a session, two others, and the session's return; the tier's loaded blocks."""
    ids = []
    for rid, p in [("a", FIRST), ("b", OTHERS[0]), ("c", OTHERS[1])]:
        engine.add_request(rid, p, greedy(6))
        ids.append(list(run_all(engine)[rid].outputs[0].token_ids))
    prompt = FIRST + ids[0] + [7, 8, 9]
    engine.add_request("a2", prompt, greedy(6))
    ids.append(list(run_all(engine)["a2"].outputs[0].token_ids))
    return ids, int(engine.engine_core.scheduler.stats().tier_loaded_blocks)


def test_tier_loads_on_every_rank(tmp_path: Path) -> None:
    folder = make_tiny_llama(tmp_path)
    kw = dict(kv_offloading_size=0.002)
    one = tp_engine(folder, 1, **kw)
    try:
        want, loaded_one = sessions(one)
    finally:
        one.shutdown()
    engine = tp_engine(folder, 2, **kw)
    try:
        got, loaded = sessions(engine)
        assert loaded == loaded_one > 0, "the returning session was meant to load from the tier"
        assert got == want
    finally:
        engine.shutdown()
