"""Liquid scaling on CPU (gloo): a tiny model cut into 4 shards moves 1 -> 2 -> 4 -> 2 -> 1 ranks while 24
requests are in flight through `LLMEngine`; every request's greedy ids equal a run with no events, the
pool grows after each scale-out and shrinks back, rank 0's parameter bytes halve on each scale-out, no
block leaks; a scale-in whose live blocks do not fit fails with both numbers and the engine goes on."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from pagedrs import LiquidRequest, LiquidType, SamplingParams
from pagedrs.engine.arg_utils import EngineArgs
from pagedrs.engine.llm_engine import LLMEngine
from pagedrs.executor.liquid.log import shard_moves
from pagedrs.runner.kv_cache import block_bytes
from tests.distributed.helpers_liquid import liquid_blocks, pool_blocks
from tests.engine.conftest import assert_pool_free
from tests.helpers import FP8_SAME_CACHE_TOL, greedy_agreement, make_tiny_llama

BLOCK = 4
EVENTS = [(1, 2), (2, 4), (4, 2), (2, 1)]
# hidden 64, 8 heads of 8, 4 KV heads, 2 layers: a block holds 2 * 2 * 4 * 4 * 8 floats = 2 KiB
PER_BLOCK = block_bytes(2, BLOCK, 4, 8, __import__("torch").float32)
BASE = dict(
    device="cpu", dtype="float32", block_size=BLOCK, disable_log_stats=True, max_num_batched_tokens=32
)


def _model(tmp_path: Path) -> Path:
    return make_tiny_llama(tmp_path, num_attention_heads=8, num_key_value_heads=4)


def _prompts(n: int, length: int) -> list[list[int]]:
    return [[(7 * i + 3 * j) % 250 + 1 for j in range(length + i % 5)] for i in range(n)]


def _engine(folder: Path, blocks: int, **kw: object) -> LLMEngine:
    args = EngineArgs(model=str(folder), cpu_kv_cache_gb=blocks * PER_BLOCK / (1 << 30), **{**BASE, **kw})
    return LLMEngine.from_engine_args(args)


def _param_bytes(engine: LLMEngine) -> int:
    return sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())


def _run(
    engine: LLMEngine,
    prompts: list[list[int]],
    events: dict[int, int] | None = None,
    logprobs: int | None = None,
) -> dict:
    """Greedy ids of each prompt (with their top-`logprobs` logprobs: (ids, logprobs)), moving to
    `events[step]` ranks before those steps."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=logprobs)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    done: dict[str, Any] = {}
    step = 0
    while engine.has_unfinished_requests():
        if events and step in events:
            engine.do_liquid(LiquidRequest(target=events[step]))
        for out in engine.step():
            if out.finished:
                ids = list(out.outputs[0].token_ids)
                done[out.request_id] = ids if logprobs is None else (ids, out.outputs[0].logprobs or [])
        step += 1
    return done


def test_shard_moves_are_the_forks() -> None:
    """The shard ids each pair moves, as the liquid fork's log shows them over 4 shards."""
    moves = {(a, b): [(m.src, m.dst, m.shard_ids) for m in shard_moves(a, b, 4)] for a, b in EVENTS}
    assert moves == {
        (1, 2): [(0, 1, [2, 3])],
        (2, 4): [(0, 2, [1]), (1, 3, [3])],
        (4, 2): [(2, 0, [1]), (3, 1, [3])],
        (2, 1): [(1, 0, [2, 3])],
    }


def test_scale_1_2_4_2_1_with_requests_in_flight(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    """Each event logs the liquid fork's block (rank 0's lines here, each other sender's in its own log)."""
    import logging

    folder = _model(tmp_path)
    prompts = _prompts(24, 12)
    want = _run(_engine(folder, 80, max_num_seqs=8), prompts)
    engine = _engine(folder, 80, max_num_seqs=8, liquid_gpu_range=[0, 1, 2, 3], liquid_total_num_shards=4)
    caplog.set_level(logging.INFO, logger="pagedrs")
    try:
        core = engine.engine_core
        assert core.liquid_degree() == 1 and engine.get_stats().num_blocks == 80
        seen: list[tuple[int, int, int]] = []
        held: list[int] = []
        weights_1 = _param_bytes(engine)
        inner = core.liquid

        def liquid(target: int) -> list[dict]:
            before = _param_bytes(engine)
            events = inner(target)
            seen.append((target, engine.get_stats().num_blocks, _param_bytes(engine) * 1000 // before))
            held.append(_param_bytes(engine))
            return events

        core.liquid = liquid  # type: ignore[method-assign]
        got = _run(engine, prompts, {3: 2, 8: 4, 14: 2, 20: 1})
        assert got == want
        # The pool is sized from each rank's memory after the move: the 80 blocks' budget plus the weight
        # bytes rank 0 no longer holds, in blocks of fewer KV heads (more than the doubling to 160 and 320
        # a fixed budget gives, as the fork's 964 -> 3381 -> 8179)
        want_blocks = [
            pool_blocks(80 * PER_BLOCK, PER_BLOCK, weights_1, h, t)
            for (t, _, _), h in zip(seen, held, strict=True)
        ]
        assert [(t, n) for t, n, _ in seen] == list(zip((2, 4, 2, 1), want_blocks, strict=True))
        assert want_blocks[0] > 160 and want_blocks[1] > 2 * want_blocks[0] and want_blocks[3] == 80
        # Split tensors halve on a scale-out and double back on a scale-in (norms are replicated, so a
        # little over half); per mille of rank 0's parameter bytes before the event.
        ratios = [r for _, _, r in seen]
        assert 490 <= ratios[0] <= 560 and 490 <= ratios[1] <= 560, ratios
        assert 1780 <= ratios[2] <= 2040 and 1780 <= ratios[3] <= 2040, ratios
        assert_pool_free(engine)
        blocks = liquid_blocks(caplog.text)
        assert [b.header for b in blocks] == [
            "---------Start 0'th liquid: Scale out from rank0 to rank1---------",
            "---------Start 1'th liquid: Scale out from rank[0,1] to rank[2,3]---------",
            "---------Start 2'th liquid: Scale in from rank[2,3] to rank[0,1]---------",
            "---------Start 3'th liquid: Scale in from rank1 to rank0---------",
        ]
        for i, (b, (src, dst), (_, n, _)) in enumerate(zip(blocks, EVENTS, seen, strict=True)):
            assert b.moves == [(m.src, m.dst, m.shard_ids) for m in shard_moves(src, dst, 4)]
            assert b.finished is not None and b.finished["n"] == str(i) and int(b.finished["blocks"]) == n
            # printed with 2 decimals as the fork does: a tiny model's weight move can read 0.00s
            assert float(b.finished["e2e"]) >= float(b.finished["weights"]) >= 0
            assert "current mem info on rank0: allocated space on rank 0:" in b.text
            if dst > src:  # rank 0 sent: the fork's sender lines; the pool after the move
                assert b.after_scale_out == n and b.sent_kv == (b.moves[0][2], b.moves[0][1])
                assert re.search(r"send weights shards takes: [0-9.]+s, sent out: [0-9.]+GB", b.text)
            else:  # the pool shrinks first, to what the smaller degree holds
                assert b.shrink is not None and b.shrink[0] == n and 0 < b.shrink[1] <= n
                assert "move and shrink latency:" in b.text
        # the other senders (rank 1 on 2 -> 4, ranks 2 and 3 on 4 -> 2, rank 1 on 2 -> 1) log their own
        # sends (the pair names the sender), and each active worker its memory after an event
        err = capfd.readouterr().err
        for line in (
            "Successfully send kv cache shards: [3] to rank: 3",
            "Successfully send kv cache shards: [1] to rank: 0",
            "Successfully send kv cache shards: [3] to rank: 1",
            "Successfully send kv cache shards: [2, 3] to rank: 0",
        ):
            assert line in err, line
        assert "After liquid kvc, allocated space on rank 3: " in err
    finally:
        engine.shutdown()


def test_seed_moves_and_blocked_scale_in(tmp_path: Path) -> None:
    folder = _model(tmp_path)
    engine = _engine(folder, 80, max_num_seqs=8, liquid_gpu_range=[0, 1], liquid_total_num_shards=4)
    try:
        weights_1 = _param_bytes(engine)
        events = engine.do_liquid(LiquidRequest(LiquidType.LIQUID_1_2))
        assert len(events) == 1 and events[0]["weight_bytes"] > 0 and events[0]["kv_bytes"] > 0
        grown = pool_blocks(80 * PER_BLOCK, PER_BLOCK, weights_1, _param_bytes(engine), 2)
        assert engine.get_stats().num_blocks == grown > 160  # the budget plus the freed weight bytes
        with pytest.raises(ValueError, match="from 1 active ranks"):
            engine.do_liquid(LiquidRequest(LiquidType.LIQUID_1_2))
        with pytest.raises(ValueError, match="power of two from 1 to 2"):
            engine.do_liquid(LiquidRequest(target=4))
        prompts = _prompts(8, 40)  # 8 x 14 blocks live at the end: more than the 80 one rank holds
        want = _run(_engine(folder, 200, max_num_seqs=8), prompts)
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        done: dict[str, list[int]] = {}

        def in_use() -> int:
            return engine.get_stats().num_blocks - engine.get_stats().num_free_blocks

        while in_use() <= 80 and engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = list(out.outputs[0].token_ids)
        live = in_use()
        assert live > 80 and not done
        with pytest.raises(ValueError, match=f"cannot resize to 80 blocks: {live} blocks are in use"):
            engine.do_liquid(LiquidRequest(LiquidType.LIQUID_2_1))
        assert engine.engine_core.liquid_degree() == 2
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = list(out.outputs[0].token_ids)
        assert done == want
        engine.do_liquid(LiquidRequest(LiquidType.LIQUID_2_1))  # fits now
        assert engine.engine_core.liquid_degree() == 1 and engine.get_stats().num_blocks == 80
        assert_pool_free(engine)
    finally:
        engine.shutdown()


def test_models_that_do_not_cut_into_the_shards_are_refused(tmp_path: Path) -> None:
    folder = make_tiny_llama(tmp_path)  # 4 heads, 2 KV heads: not 4 shards of KV heads
    with pytest.raises(ValueError, match="liquid_total_num_shards=4 does not divide the model's 2 KV heads"):
        _engine(folder, 80, liquid_gpu_range=[0, 1], liquid_total_num_shards=4)
    with pytest.raises(ValueError, match="liquid_gpu_range"):
        EngineArgs(liquid_gpu_range=[0, 1, 2]).early_configs()
    with pytest.raises(ValueError, match="liquid_total_num_shards"):
        EngineArgs(liquid_gpu_range=[0, 1], liquid_total_num_shards=3).early_configs()


def test_auto_policy_scales_out_under_load_and_in_when_quiet(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A burst that needs more blocks than one rank holds scales out; once it drains (usage under 0.7,
    the used blocks fit one rank) the engine scales back in. Outputs equal a run with no events."""
    import logging

    folder = _model(tmp_path)
    burst = _prompts(16, 30)
    want = _run(_engine(folder, 200, max_num_seqs=16), burst)
    engine = _engine(
        folder,
        40,
        max_num_seqs=16,
        liquid_gpu_range=[0, 1],
        liquid_total_num_shards=2,
        liquid_auto=True,
        liquid_auto_window=4,
    )
    try:
        with caplog.at_level(logging.INFO, logger="pagedrs"):
            got = _run(engine, burst)
            assert got == want
            assert "scale out 1 -> 2" in caplog.text
            quiet = _run(engine, [[5, 6, 7]])
            assert len(quiet["0"]) == 16
        assert engine.engine_core.liquid_degree() == 1
        text = caplog.text
        assert "liquid auto: mean concurrent cache usage" in text
        assert text.index("scale out 1 -> 2") < text.index("scale in 2 -> 1")
        assert_pool_free(engine)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("arch", ["gpt2", "opt-proj", "qwen2"])
def test_other_architectures_move_and_match(tmp_path: Path, arch: str) -> None:
    """Fused c_attn (GPT-2, replicated position table), OPT's project_in/out, Qwen2's q/k/v biases:
    1 -> 2 -> 1 over two shards mid-generation equals no events."""
    from tests.helpers import make_tiny_model
    from tests.models.helpers_configs import gpt2_config, opt_config

    if arch == "gpt2":
        folder = make_tiny_model(tmp_path / arch, gpt2_config())
    elif arch == "opt-proj":
        folder = make_tiny_model(
            tmp_path / arch, opt_config(do_layer_norm_before=False, word_embed_proj_dim=32)
        )
    else:
        folder = make_tiny_llama(tmp_path, arch="qwen2")
    prompts = _prompts(6, 10)
    kw = dict(device="cpu", dtype="float32", block_size=BLOCK, disable_log_stats=True, max_num_seqs=4)
    want = _run(LLMEngine.from_engine_args(EngineArgs(model=str(folder), **kw)), prompts)
    engine = LLMEngine.from_engine_args(
        EngineArgs(model=str(folder), liquid_gpu_range=[0, 1], liquid_total_num_shards=2, **kw)
    )
    try:
        assert _run(engine, prompts, {2: 2, 9: 1, 14: 2}) == want
    finally:
        engine.shutdown()


def test_fp8_cache_moves_as_bytes(tmp_path: Path) -> None:
    """kv_cache_dtype="fp8": the KV shards cross gloo as their bytes (gloo has no fp8 type); 1 -> 2 -> 1
    with requests in flight agrees with an fp8 run with no events as an fp8 cache can across rank counts
    (`greedy_agreement`)."""
    folder = _model(tmp_path)
    prompts = _prompts(12, 12)
    want = _run(_engine(folder, 40, max_num_seqs=8, kv_cache_dtype="fp8"), prompts, logprobs=5)
    engine = _engine(
        folder, 40, max_num_seqs=8, kv_cache_dtype="fp8", liquid_gpu_range=[0, 1], liquid_total_num_shards=4
    )
    try:
        assert engine.runner.kv_pool.kv_caches[0].dtype == __import__("torch").float8_e4m3fn
        got = _run(engine, prompts, {3: 2, 9: 1}, logprobs=5)
        assert got.keys() == want.keys()
        common = [greedy_agreement(want[r], got[r], FP8_SAME_CACHE_TOL) for r in want]
        assert sum(common) >= 16 * len(want) // 2, common
        assert engine.engine_core.liquid_degree() == 1
        assert_pool_free(engine)
    finally:
        engine.shutdown()


def test_scale_out_and_in_with_a_sliding_window_pool(tmp_path: Path) -> None:
    """A model whose layers all attend to a 6-token window keeps them in a window pool of its own under
    liquid scaling too: the pool moves its KV heads with the others, grows with the full-attention pool after
    the scale-out (the rank that joins builds it at rank 0's size) and shrinks back before the scale-in, and
    the greedy ids equal a run with no events."""
    folder = make_tiny_llama(
        tmp_path, arch="mistral", sliding_window=6, num_attention_heads=8, num_key_value_heads=4
    )
    prompts = _prompts(8, 12)
    want = _run(_engine(folder, 80, max_num_seqs=8), prompts)
    engine = _engine(folder, 80, max_num_seqs=8, liquid_gpu_range=[0, 1], liquid_total_num_shards=2)
    try:
        core = engine.engine_core
        assert [g.window for g in engine.runner.kv_groups] == [6]
        sizes: list[int] = []
        inner = core.liquid

        def liquid(target: int) -> list[dict]:
            events = inner(target)
            ((_, _, n, _),) = engine.scheduler.kv_group_pools()
            sizes.append(n)
            return events

        ((_, _, start, _),) = engine.scheduler.kv_group_pools()
        core.liquid = liquid  # type: ignore[method-assign]
        got = _run(engine, prompts, {3: 2, 9: 1})
        assert got == want
        assert sizes[0] > start and sizes[1] == start, (start, sizes)
        assert_pool_free(engine)
    finally:
        engine.shutdown()
