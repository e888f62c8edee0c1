"""Prometheus metrics of the server: engine gauges and counters, per-request latency histograms.

Every ``pagedrs:`` series vLLM V1 has an equivalent of is also served under vLLM's name (`VLLM_NAMES`),
with the same samples plus vLLM's ``engine`` label, so dashboards, autoscaler rules and routers written
for vLLM read this server unchanged.

With several API server processes (`--api-server-count`, `PROMETHEUS_MULTIPROC_DIR` set by the
supervisor before this module is imported) the histograms and counters of every process are summed at
scrape time; the engine's figures come from the core's step messages, the same in every process, and
are reported once."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

disable_created_metrics()  # no *_created series: they double the output and nobody graphs them

_TTFT_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_ITL_BUCKETS = (
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
)
_E2E_BUCKETS = (
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
)


_STEP_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
)


class _EngineStatsCollector(Collector):
    """Reads the engine's latest stats snapshot at scrape time (cumulative counters included)."""

    def __init__(
        self,
        get_stats: Callable[[], Any],
        model_name: str,
        get_replica_stats: Callable[[], list[Any]] | None = None,
    ) -> None:
        self._get_stats = get_stats
        self._model = model_name
        self._get_replica_stats = get_replica_stats

    def collect(self) -> Iterator[Any]:
        """One sample per family, or with data parallelism one per replica (vLLM's ``engine`` label)."""
        if self._get_replica_stats is None:
            rows: list[tuple[list[str], Any]] = [([self._model], self._get_stats())]
            labels = ["model_name"]
        else:
            stats = self._get_replica_stats()
            rows = [([self._model, str(i)], s) for i, s in enumerate(stats)]
            labels = ["model_name", "engine"]

        def fill(m: Any, key: str) -> Any:
            for values, s in rows:
                m.add_metric(values, float(getattr(s, key, 0) or 0) if s is not None else 0.0)
            return m

        def g(name: str, doc: str, key: str) -> GaugeMetricFamily:
            return fill(GaugeMetricFamily(name, doc, labels=labels), key)

        def c(name: str, doc: str, key: str) -> CounterMetricFamily:
            return fill(CounterMetricFamily(name, doc, labels=labels), key)

        yield g("pagedrs:num_requests_running", "Requests in the running batch.", "num_running")
        yield g("pagedrs:num_requests_waiting", "Requests waiting to be scheduled.", "num_waiting")
        yield g("pagedrs:num_requests_swapped", "Requests swapped out to CPU.", "num_swapped")
        yield g("pagedrs:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).", "kv_usage")
        yield self._group_usage(rows, labels)
        yield c(
            "pagedrs:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            "prefix_cache_queries",
        )
        yield c(
            "pagedrs:prefix_cache_hits",
            "Prompt tokens served from the prefix cache.",
            "prefix_cache_hits",
        )
        yield c("pagedrs:prompt_tokens", "Prompt tokens processed.", "prompt_tokens_total")
        yield c("pagedrs:generation_tokens", "Generated tokens.", "generation_tokens_total")
        yield c("pagedrs:num_preemptions", "Preemptions.", "num_preemptions")
        # vLLM's spec_decode counters: verifications, draft tokens proposed, draft tokens accepted.
        yield c("pagedrs:spec_decode_num_drafts", "Speculative verifications.", "spec_num_drafts")
        yield c("pagedrs:spec_decode_num_draft_tokens", "Draft tokens proposed.", "spec_num_draft_tokens")
        yield c(
            "pagedrs:spec_decode_num_accepted_tokens",
            "Draft tokens accepted.",
            "spec_num_accepted_tokens",
        )
        yield c(
            "pagedrs:spec_decode_num_pauses",
            "Engine-wide pauses of speculation measured slower than decoding without it.",
            "spec_num_pauses",
        )
        yield from self._tier_families(g, c)

    @staticmethod
    def _tier_families(g: Any, c: Any) -> Iterator[Any]:
        """The host KV tier (`kv_offloading_size`): vLLM's external prefix-cache counters and the tier's own."""
        yield c(
            "pagedrs:external_prefix_cache_queries",
            "Prompt tokens looked up in the host KV tier.",
            "external_prefix_cache_queries",
        )
        yield c(
            "pagedrs:external_prefix_cache_hits",
            "Prompt tokens loaded from the host KV tier.",
            "external_prefix_cache_hits",
        )
        yield g(
            "pagedrs:kv_offload_usage_perc",
            "Fraction of host KV tier blocks in use (0..1).",
            "kv_offload_usage",
        )
        yield c(
            "pagedrs:kv_offload_bytes_stored",
            "Bytes copied into the host KV tier (per rank).",
            "kv_offload_bytes_stored",
        )
        yield c(
            "pagedrs:kv_offload_bytes_loaded",
            "Bytes copied from the host KV tier (per rank).",
            "kv_offload_bytes_loaded",
        )
        yield c(
            "pagedrs:kv_offload_evicted_blocks",
            "Host KV tier blocks dropped to make room.",
            "kv_offload_evicted_blocks",
        )

    @staticmethod
    def _group_usage(rows: list[tuple[list[str], Any]], labels: list[str]) -> GaugeMetricFamily:
        """Each KV pool's usage by KV-cache group (label `kv_group`: `full`, `window:W`, `recurrent`); a snapshot
        without the per-group figures serves its overall usage as the `full` pool's."""
        m = GaugeMetricFamily(
            "pagedrs:kv_cache_group_usage_perc",
            "Fraction of each KV-cache group's blocks in use (0..1).",
            labels=[*labels, "kv_group"],
        )
        for values, s in rows:
            if s is None:
                continue
            usage = getattr(s, "kv_group_usage", None) or {"full": float(s.kv_usage or 0)}
            for name, u in usage.items():
                m.add_metric([*values, name], float(u))
        return m


# pagedrs family -> the names vLLM V1 serves it under (vllm/v1/metrics/loggers.py; counters get their
# `_total` sample suffix from the family, as there). `vllm:num_requests_swapped` is vLLM V0's (V1 does not
# swap); `vllm:gpu_cache_usage_perc` and `vllm:time_per_output_token_seconds` are the older names V1 still
# serves beside `kv_cache_usage_perc` and `inter_token_latency_seconds`.
VLLM_NAMES: dict[str, tuple[str, ...]] = {
    "pagedrs:num_requests_running": ("vllm:num_requests_running",),
    "pagedrs:num_requests_waiting": ("vllm:num_requests_waiting",),
    "pagedrs:num_requests_swapped": ("vllm:num_requests_swapped",),
    "pagedrs:kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "pagedrs:prefix_cache_queries": ("vllm:prefix_cache_queries",),
    "pagedrs:prefix_cache_hits": ("vllm:prefix_cache_hits",),
    "pagedrs:external_prefix_cache_queries": ("vllm:external_prefix_cache_queries",),
    "pagedrs:external_prefix_cache_hits": ("vllm:external_prefix_cache_hits",),
    "pagedrs:prompt_tokens": ("vllm:prompt_tokens",),
    "pagedrs:generation_tokens": ("vllm:generation_tokens",),
    "pagedrs:num_preemptions": ("vllm:num_preemptions",),
    "pagedrs:spec_decode_num_drafts": ("vllm:spec_decode_num_drafts",),
    "pagedrs:spec_decode_num_draft_tokens": ("vllm:spec_decode_num_draft_tokens",),
    "pagedrs:spec_decode_num_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens",),
    "pagedrs:time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    "pagedrs:inter_token_latency_seconds": (
        "vllm:inter_token_latency_seconds",
        "vllm:time_per_output_token_seconds",
    ),
    "pagedrs:e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
    "pagedrs:request_success": ("vllm:request_success",),
}
# The pagedrs families vLLM has no series for, and why (the twin test checks this list is complete).
NO_VLLM_NAME: dict[str, str] = {
    "pagedrs:spec_decode_num_pauses": "vLLM never pauses speculation",
    "pagedrs:kv_cache_group_usage_perc": "vLLM serves one usage over its KV-cache groups' shared pool",
    "pagedrs:http_requests": "vLLM counts HTTP requests with prometheus-fastapi-instrumentator, unprefixed",
    "pagedrs:engine_step_seconds": "vLLM has no per-step time histogram",
    "pagedrs:output_send_seconds": "vLLM has no output-send time histogram",
    "pagedrs:frontend_step_seconds": "vLLM has no frontend per-step time histogram",
    "pagedrs:step_batch_size": "vLLM's iteration_tokens_total counts tokens per step, not sequences",
    "pagedrs:engine_core_stalled_seconds": "vLLM does not watch its core for stalls",
    "pagedrs:engine_core_stall_restarts": "vLLM does not restart a stalled core",
    "pagedrs:kv_offload_usage_perc": "vLLM reports its offloading connector through KV-connector stats",
    "pagedrs:kv_offload_bytes_stored": "vLLM reports its offloading connector through KV-connector stats",
    "pagedrs:kv_offload_bytes_loaded": "vLLM reports its offloading connector through KV-connector stats",
    "pagedrs:kv_offload_evicted_blocks": "vLLM reports its offloading connector through KV-connector stats",
}
# Served only with data parallelism (vLLM's balancer does not count its choices): requests per replica.
DP_ONLY_FAMILIES = ("pagedrs:dp_routed_requests",)
VLLM_ENGINE_INDEX = "0"  # vLLM's `engine` label of a server with one engine core


def vllm_twins(families: Iterable[Metric]) -> Iterator[Metric]:
    """The families of `VLLM_NAMES` again under vLLM's names: same type, documentation and samples
    (values, labels), plus the ``engine`` label."""
    for family in families:
        for name in VLLM_NAMES.get(family.name, ()):
            twin = Metric(name, family.documentation, family.type, family.unit)
            for s in family.samples:
                labels = {**s.labels, "engine": s.labels.get("engine", VLLM_ENGINE_INDEX)}
                twin.samples.append(
                    Sample(name + s.name[len(family.name) :], labels, s.value, s.timestamp, s.exemplar)
                )
            yield twin


class _VllmNames(Collector):
    """Serves a registry's families again under vLLM's names (read at scrape time, so equal)."""

    def __init__(self, source: CollectorRegistry) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        return vllm_twins(self._source.collect())


def exposition(registry: CollectorRegistry) -> bytes:
    """Prometheus text of `registry` followed by its families under vLLM's names."""
    twins = CollectorRegistry(auto_describe=False)
    twins.register(_VllmNames(registry))
    return generate_latest(registry) + generate_latest(twins)


class ServerMetrics:
    """One registry per app; also the AsyncLLMEngine's StepObserver."""

    def __init__(
        self,
        model_name: str,
        get_stats: Callable[[], Any],
        *,
        core_histograms: bool = True,
        get_replica_stats: Callable[[], list[Any]] | None = None,
    ) -> None:
        """`core_histograms`: observe the core's per-step figures (step time, send time, batch size).
        Every API server process gets every step message; one of them observes these, so the summed
        histograms count each step once. With data parallelism, `get_replica_stats` gives each replica's
        stats: every engine-level series (the engine's gauges and counters, the request histograms and
        counters, the step histograms) then carries vLLM's ``engine`` label, the replica's index, and
        the requests routed to each replica are counted.
        Every metric is declared here, one per statement, with vLLM's names."""
        self.core_histograms = core_histograms
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self._engine_collector = _EngineStatsCollector(get_stats, model_name, get_replica_stats)
        # With data parallelism the request and step series carry the engine label (vLLM's); one engine
        # serves them without it, and vLLM's names add engine="0" (`vllm_twins`).
        self.num_engines = len(get_replica_stats()) if get_replica_stats is not None else 0
        labels = ["model_name", "engine"] if self.num_engines else ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry)

        self.ttft = histogram("pagedrs:time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self.itl = histogram(
            "pagedrs:inter_token_latency_seconds", "Time between output tokens.", _ITL_BUCKETS
        )
        self.e2e = histogram(
            "pagedrs:e2e_request_latency_seconds", "End-to-end request latency.", _E2E_BUCKETS
        )
        self.finished = Counter(
            "pagedrs:request_success",
            "Finished requests by finish reason.",
            [*labels, "finished_reason"],
            registry=self.registry,
        )
        self.http = Counter(
            "pagedrs:http_requests",
            "HTTP requests by route and status.",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self.engine_step = histogram(
            "pagedrs:engine_step_seconds",
            "Engine core wall time per step (schedule + execute + update).",
            _STEP_BUCKETS,
        )
        self.output_send = histogram(
            "pagedrs:output_send_seconds",
            "Engine core time to encode and send one step's output message.",
            _STEP_BUCKETS,
        )
        self.frontend_step = histogram(
            "pagedrs:frontend_step_seconds",
            "API server time to process one step message (detokenize, stop strings, fan-out).",
            _STEP_BUCKETS,
        )
        self.step_batch = histogram(
            "pagedrs:step_batch_size",
            "Sequences that sampled a token in a step.",
            (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
        )
        # A counter in every API server process (summed at scrape time), unlike the router's own count.
        self.routed = (
            Counter(
                "pagedrs:dp_routed_requests",
                "Requests the data-parallel router sent to each replica.",
                ["model_name", "engine"],
                registry=self.registry,
            )
            if self.num_engines
            else None
        )
        for engine in range(max(1, self.num_engines)):
            for reason in ("stop", "length", "abort"):
                self.finished.labels(*self._labels(engine), reason)
            if self.routed is not None:
                self.routed.labels(model_name, str(engine))
        self.registry.register(self._engine_collector)
        self._scrape_collectors: list[Collector] = [self._engine_collector]

    def add_collector(self, collector: Collector) -> None:
        """Another collector read at scrape time (also in the multi-process exposition)."""
        self.registry.register(collector)
        self._scrape_collectors.append(collector)

    def _labels(self, engine: int | None) -> tuple[str, ...]:
        if not self.num_engines:
            return (self.model_name,)
        return (self.model_name, VLLM_ENGINE_INDEX if engine is None else str(engine))

    # StepObserver (called on the engine's event loop; prometheus_client is thread-safe)
    def on_routed(self, index: int) -> None:
        if self.routed is not None:
            self.routed.labels(self.model_name, str(index)).inc()

    def on_first_token(self, ttft_s: float, engine: int | None = None) -> None:
        self.ttft.labels(*self._labels(engine)).observe(ttft_s)

    def on_tokens(self, itl_s: float, num_tokens: int, engine: int | None = None) -> None:
        child = self.itl.labels(*self._labels(engine))
        for _ in range(num_tokens):
            child.observe(itl_s / num_tokens)

    def on_finished(self, reason: str, e2e_s: float, engine: int | None = None) -> None:
        self.finished.labels(*self._labels(engine), reason).inc()
        if reason != "abort":
            self.e2e.labels(*self._labels(engine)).observe(e2e_s)

    def on_step(self, stats: Any, frontend_s: float, engine: int | None = None) -> None:
        """One step message from an engine core (`engine`, with data parallelism): its timings and the
        frontend's."""
        lbl = self._labels(engine)
        self.frontend_step.labels(*lbl).observe(frontend_s)
        if not self.core_histograms:
            return
        self.engine_step.labels(*lbl).observe(stats.step_time_s)
        if stats.send_time_s:
            self.output_send.labels(*lbl).observe(stats.send_time_s)
        if stats.batch_size:
            self.step_batch.labels(*lbl).observe(stats.batch_size)

    def observe_http(self, method: str, route: str, status: int) -> None:
        self.http.labels(method, route, str(status)).inc()

    def render(self) -> bytes:
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):  # every API server process's values, summed
            from prometheus_client import multiprocess

            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            for collector in self._scrape_collectors:
                registry.register(collector)
            return exposition(registry)
        return exposition(self.registry)
