"""The engine cores' liveness as Prometheus series, read at scrape time: how long each core has held
requests without finishing a step (0 while it steps or is idle), and how many cores were killed and
restarted for staying stuck (`--engine-stall-restart-timeout`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = ["LivenessCollector"]


class LivenessCollector(Collector):
    """`engine`: the AsyncLLMEngine (its `stalled`, `num_replicas` and `stall_restarts`); with data
    parallelism (`per_engine`) each core is a sample with vLLM's ``engine`` label."""

    def __init__(self, engine: Any, model_name: str, *, per_engine: bool) -> None:
        self._engine = engine
        self._model = model_name
        self._per_engine = per_engine

    def collect(self) -> Iterator[Any]:
        stalled = {index: seconds for index, seconds, _ in self._engine.stalled(0.0)}
        labels = ["model_name", "engine"] if self._per_engine else ["model_name"]
        gauge = GaugeMetricFamily(
            "pagedrs:engine_core_stalled_seconds",
            "Seconds an engine core holding requests has gone without finishing a step (0: stepping or idle).",
            labels=labels,
        )
        restarts = CounterMetricFamily(
            "pagedrs:engine_core_stall_restarts",
            "Engine cores killed and restarted because they stopped stepping with requests in flight.",
            labels=labels,
        )
        kills = self._engine.stall_restarts
        if self._per_engine:
            for index in range(self._engine.num_replicas):
                gauge.add_metric([self._model, str(index)], stalled.get(index, 0.0))
                restarts.add_metric([self._model, str(index)], float(kills[index]))
        else:
            gauge.add_metric([self._model], max(stalled.values(), default=0.0))
            restarts.add_metric([self._model], float(sum(kills)))
        yield gauge
        yield restarts
