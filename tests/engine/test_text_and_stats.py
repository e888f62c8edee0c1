"""Incremental detokenization, stop strings, the stats line and the batch picture."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest

from pagedrs.engine.frontend.sequence import IncrementalDetokenizer, check_stop_strings
from pagedrs.metrics import EngineStats, StatLogger, visualize_batch
from tests.helpers import make_tokenizer
from tests.helpers_vllm_logs import HIT_RATE_LINE, STATS_LINE


@pytest.mark.parametrize("text", ["héllo wörld, ünïcode ✓ 🙂 done", "plain ascii text"])
def test_incremental_detokenization_matches_full_decode(text: str) -> None:
    tok = make_tokenizer()
    prompt = tok.encode("prompt: ")
    ids = tok.encode(text) + [257]  # </s> is skipped
    det = IncrementalDetokenizer(tok, prompt, skip_special_tokens=True)
    for t in ids:
        det.add([t])
    assert det.text == text == tok.decode(ids, skip_special_tokens=True)


def test_slow_detokenizer_fallback_matches() -> None:
    tok = make_tokenizer()

    class Slow:  # a tokenizer without the Rust backend
        def decode(self, ids, skip_special_tokens=True):
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    text = "naïve café ✓"
    det = IncrementalDetokenizer(Slow(), tok.encode("abc"), skip_special_tokens=True)
    for t in tok.encode(text):
        det.add([t])
    assert det.text == text


def test_stop_strings() -> None:
    assert check_stop_strings("hello world", 3, ["wor"], False) == ("wor", 6)
    assert check_stop_strings("hello world", 3, ["wor"], True) == ("wor", 9)
    assert check_stop_strings("hello wor", 3, ["wor"], True) == ("wor", -1)
    assert check_stop_strings("hello world", 2, ["llo"], False) is None  # not in the new text's reach
    assert check_stop_strings("hello world", 0, ["o"], False) is None
    assert check_stop_strings("abc", 1, ["x", "bc"], False) == ("bc", 1)


def test_stats_line_format() -> None:
    log = logging.getLogger("test.stats")
    sl = StatLogger(interval=5.0, log=log)
    sl.last_time = 0.0
    stats = EngineStats(
        num_running=3,
        num_waiting=2,
        num_swapped=1,
        kv_usage=0.25,
        prefix_cache_queries=100,
        prefix_cache_hits=40,
        prompt_tokens_total=500,
        generation_tokens_total=50,
        num_swap_blocks=200,
        num_free_swap_blocks=150,
    )
    assert sl.maybe_log(stats, now=4.0) is None
    line = sl.maybe_log(stats, now=10.0)
    assert line == (
        "Avg prompt throughput: 50.0 tokens/s, Avg generation throughput: 5.0 tokens/s, Running: 3 reqs, "
        "Swapped: 1 reqs, Pending: 2 reqs, GPU KV cache usage: 25.0%, CPU KV cache usage: 25.0%"
    )
    m = STATS_LINE.match(line)  # vLLM 0.4's line: the device pool as "GPU", the swap pool as "CPU"
    assert m is not None and (m["gpu"], m["cpu"], m["swapped"], m["pending"]) == ("25.0", "25.0", "1", "2")
    assert sl.last_hit_rate_line == "Prefix cache hit rate: GPU: 40.00%, CPU: 0.00%"
    assert HIT_RATE_LINE.match(sl.last_hit_rate_line)
    no_swap = EngineStats(
        num_running=1, kv_usage=0.5
    )  # no swap pool: 0% swap usage, no lookups: no rate line
    sl2 = StatLogger(interval=5.0, log=log)
    m = STATS_LINE.match(sl2.log_now(no_swap, now=sl2.last_time + 5.0))
    assert m is not None and (m["gpu"], m["cpu"]) == ("50.0", "0.0") and sl2.last_hit_rate_line is None
    stats.generation_tokens_total = 100
    line = sl.log_now(stats, now=20.0)
    assert "Avg generation throughput: 5.0 tokens/s" in line and "Avg prompt throughput: 0.0" in line


def test_batch_picture() -> None:
    plan = SimpleNamespace(
        req_ids=np.array([3, 4, 5]),
        num_scheduled_tokens=np.array([14, 1, 1]),
        num_computed_tokens=np.array([0, 30, 8]),
        num_prompt_tokens=np.array([20, 10, 8]),
        preempted=np.array([], dtype=np.int64),
    )
    line = visualize_batch(plan, step=7, token_budget=32, width=32)
    assert line.startswith("step 7 |AAAAAAAAAAAAAAbc")
    assert "16/32 tok" in line and "A=seq 3 prefill 0..14/20" in line and "decode b=4 c=5" in line
