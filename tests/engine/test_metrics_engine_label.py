"""With data parallelism each request's timings carry the replica it was routed to: the output processor
hands the request's `engine` to every observer call, and the server's Prometheus series label it."""

from __future__ import annotations

from typing import Any

from pagedrs.engine.core.messages import EngineCoreOutput, EngineCoreOutputs, FinishReason
from pagedrs.engine.dp.client import sum_stats
from pagedrs.engine.frontend.output_processor import OutputProcessor
from pagedrs.entrypoints.openai.server.metrics import ServerMetrics
from pagedrs.metrics import EngineStats
from pagedrs.sampling_params import SamplingParams


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def on_first_token(self, ttft_s: float, engine: int | None) -> None:
        self.calls.append(("first", engine))

    def on_tokens(self, itl_s: float, num_tokens: int, engine: int | None) -> None:
        self.calls.append(("tokens", engine))

    def on_finished(self, reason: str, e2e_s: float, engine: int | None) -> None:
        self.calls.append(("finished", reason, engine))


def _step(*outs: EngineCoreOutput) -> EngineCoreOutputs:
    return EngineCoreOutputs(list(outs), EngineStats(), 0.0)


def test_observer_calls_carry_each_requests_engine() -> None:
    rec = _Recorder()
    proc = OutputProcessor(None, rec)
    params = SamplingParams(max_tokens=2, detokenize=False)
    proc.add_request("a", None, [1, 2], params, 0.0, engine=1)
    proc.add_request("b", None, [3], params, 0.0, engine=0)
    proc.add_request("c", None, [4], params, 0.0)  # one engine core: no replica
    proc.process_outputs(_step(EngineCoreOutput("a", 0, [5]), EngineCoreOutput("b", 0, [6])))
    proc.process_outputs(
        _step(EngineCoreOutput("a", 0, [7], finish_reason=FinishReason.LENGTH), EngineCoreOutput("c", 0, [8]))
    )
    proc.abort_requests(["b", "c"])
    assert rec.calls == [
        ("first", 1),
        ("first", 0),
        ("tokens", 1),
        ("finished", "length", 1),
        ("first", None),
        ("finished", "abort", 0),
        ("finished", "abort", None),
    ]


def _sample(metrics: ServerMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, {"model_name": "m", **labels})


def test_server_series_take_the_engine_of_each_call() -> None:
    m = ServerMetrics("m", lambda: EngineStats(), get_replica_stats=lambda: [EngineStats(), EngineStats()])
    m.on_first_token(0.5, 1)
    m.on_first_token(0.25, 0)
    m.on_first_token(0.125, 1)
    m.on_finished("stop", 1.0, 1)
    m.on_step(EngineStats(), 0.001, 0)
    ttft = "pagedrs:time_to_first_token_seconds_count"
    assert (_sample(m, ttft, engine="0"), _sample(m, ttft, engine="1")) == (1.0, 2.0)
    assert _sample(m, "pagedrs:time_to_first_token_seconds_sum", engine="1") == 0.625
    assert _sample(m, "pagedrs:request_success_total", engine="1", finished_reason="stop") == 1.0
    assert _sample(m, "pagedrs:request_success_total", engine="0", finished_reason="stop") == 0.0
    one = ServerMetrics("m", lambda: EngineStats())  # one engine core: no engine label
    one.on_first_token(0.5, None)
    assert _sample(one, ttft) == 1.0


def test_each_kv_cache_group_has_its_usage_gauge() -> None:
    usage = {"full": 0.25, "window:8": 0.75}
    m = ServerMetrics("m", lambda: EngineStats(kv_usage=0.75, kv_group_usage=usage))
    name = "pagedrs:kv_cache_group_usage_perc"
    assert _sample(m, name, kv_group="full") == 0.25
    assert _sample(m, name, kv_group="window:8") == 0.75
    assert _sample(m, "pagedrs:kv_cache_usage_perc") == 0.75  # vLLM's overall figure, unchanged
    # With data parallelism each replica's pools carry its engine label; the sum is their mean.
    a = EngineStats(num_blocks=8, kv_usage=0.5, kv_group_usage={"full": 0.5, "window:8": 0.25})
    b = EngineStats(num_blocks=8, kv_usage=1.0, kv_group_usage={"full": 1.0, "window:8": 0.75})
    dp = ServerMetrics("m", lambda: sum_stats([a, b]), get_replica_stats=lambda: [a, b])
    assert _sample(dp, name, engine="1", kv_group="window:8") == 0.75
    merged = sum_stats([a, b])
    assert merged is not None and merged.kv_group_usage == {"full": 0.75, "window:8": 0.5}
    # A snapshot without per-group figures (an older core) serves its overall usage as the full pool's.
    old = ServerMetrics("m", lambda: EngineStats(kv_usage=0.5))
    assert _sample(old, name, kv_group="full") == 0.5
