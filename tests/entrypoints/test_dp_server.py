"""`pagedrs serve -dp 2`: two engine core processes behind one endpoint. Greedy text as DP=1 offline, a
prefix-sharing sequence on one replica and concurrent distinct prompts on both (per-engine counters in
/metrics), per-replica engine series and /health body; session affinity (X-Session-Id, `user`); SIGKILL of a replica under load fails only its
requests, later ones succeed and it comes back; SIGTERM leaves no process. Tiny model, CPU."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import SubprocessServer, wait_until

from pagedrs import LLM, SamplingParams
from tests.entrypoints.helpers_dp import SHARED, dp_flags, per_engine, routed, start_dp_server, tree
from tests.helpers import make_tiny_llama, process_gone

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

DISTINCT = [f"prompt number {i} about {w}" for i, w in enumerate(["cats", "rain", "maps", "jazz"])]
FRESH = [
    "Zebras run fast.",
    "Quiet lakes freeze.",
    "Mighty oaks grow.",
    "Violet skies glow.",
]  # no shared block


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("pagedrs._core")
    return make_tiny_llama(tmp_path_factory.mktemp("dp-model"), arch="qwen2")


@pytest.fixture(scope="module")
def server(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SubprocessServer]:
    s = SubprocessServer(tmp_path_factory.mktemp("dp-server"), dp_flags(tiny))
    start_dp_server(s)
    yield s
    s.kill()


def _complete(http: httpx.Client, prompt: str, max_tokens: int = 6, **extra: object) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}
    return http.post("/v1/completions", json=body)


def test_greedy_text_equals_dp1(server: SubprocessServer, tiny: Path) -> None:
    prompts = [SHARED + "a", SHARED + "b", *DISTINCT]
    llm = LLM(str(tiny), device="cpu", dtype="float32", block_size=4, num_kv_blocks=64, num_threads=1)
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    want = [o.outputs[0].text for o in llm.generate(prompts, sp, use_tqdm=False)]
    llm.shutdown()
    with server.http() as http, concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda p: _complete(http, p).json()["choices"][0]["text"], prompts))
    assert got == want


def test_routing_counters_and_health(server: SubprocessServer) -> None:
    with server.http() as http:
        before = routed(http.get("/metrics").text)
        for i in range(4):  # one after the other, sharing a long prefix: where it is cached
            assert _complete(http, SHARED + f"question {i}", max_tokens=2).status_code == 200
        after = routed(http.get("/metrics").text)
        deltas = sorted(after[k] - before.get(k, 0) for k in ("0", "1"))
        assert deltas == [0, 4], (before, after)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:  # concurrent, distinct: both replicas
            codes = list(pool.map(lambda p: _complete(http, p, max_tokens=12).status_code, FRESH))
        assert codes == [200] * 4
        final = routed(http.get("/metrics").text)
        assert min(final[k] - after[k] for k in ("0", "1")) > 0, (after, final)
        text = http.get("/metrics").text
        for engine in ("0", "1"):  # per-replica series, as vLLM's data parallelism labels them
            assert f'engine="{engine}"' in text.split("pagedrs:num_requests_running{", 1)[1].split("\n#")[0]
            assert f'vllm:num_requests_running{{engine="{engine}"' in text
        health = http.get("/health")
        assert health.status_code == 200
        assert [(r["index"], r["state"]) for r in health.json()["replicas"]] == [(0, "up"), (1, "up")]


# Engine-level samples: each must carry the engine label of the replica that served (as vLLM's DP does).
ENGINE_COUNTS = [
    f"{prefix}:{name}"
    for prefix in ("pagedrs", "vllm")
    for name in (
        "time_to_first_token_seconds_count",
        "e2e_request_latency_seconds_count",
        "request_success_total",
    )
]


def test_request_histograms_and_prefix_counters_per_engine(server: SubprocessServer) -> None:
    with server.http() as http:
        before = per_engine(http.get("/metrics").text)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:  # concurrent, distinct: both replicas
            answers = list(pool.map(lambda p: _complete(http, "Again: " + p, max_tokens=12), FRESH))
        assert [a.status_code for a in answers] == [200] * 4
        prompt_tokens = sum(a.json()["usage"]["prompt_tokens"] for a in answers)
        after = per_engine(http.get("/metrics").text)
    for name, label_free in after.items():  # every engine-level sample carries the label
        if name.startswith(("pagedrs:", "vllm:")) and not name.startswith("pagedrs:http_requests"):
            assert "-" not in label_free, name

    def delta(name: str) -> dict[str, float]:
        return {e: v - before.get(name, {}).get(e, 0.0) for e, v in after[name].items()}

    for name in ENGINE_COUNTS:
        d = delta(name)
        assert set(d) == {"0", "1"} and sum(d.values()) == 4, (name, d)
        assert min(d.values()) > 0, (name, d)  # both replicas served, each counted under its own label
    for name in ("pagedrs:prefix_cache_queries_total", "vllm:prefix_cache_queries_total"):
        d = delta(name)
        assert set(d) == {"0", "1"} and sum(d.values()) == prompt_tokens, (name, d)
    assert set(after["vllm:prefix_cache_hits_total"]) == {"0", "1"}
    for name in ("pagedrs:engine_step_seconds_count", "pagedrs:inter_token_latency_seconds_count"):
        assert min(delta(name).values()) > 0, name


def _session_counts(http: httpx.Client) -> list[float]:
    """Round robin would alternate; each session's 3 requests stay on one replica."""
    before = routed(http.get("/metrics").text)
    for i in range(3):
        r = http.post(
            "/v1/completions", json={"prompt": f"x{i}", "max_tokens": 1}, headers={"X-Session-Id": "a"}
        )
        assert r.status_code == 200
    for i in range(3):
        assert _complete(http, f"y{i}", max_tokens=1, user="bob").status_code == 200
    after = routed(http.get("/metrics").text)
    return sorted(after[k] - before.get(k, 0) for k in ("0", "1"))


def test_session_affinity_kill_replica_under_load_then_sigterm(tiny: Path, tmp_path: Path) -> None:
    s = SubprocessServer(tmp_path, dp_flags(tiny, "--dp-routing", "round_robin", "--dp-session-affinity"))
    start_dp_server(s)
    assert s.proc is not None
    try:
        with s.http() as http:
            assert _session_counts(http) in ([0, 6], [3, 3])
            victim = http.get("/health").json()["replicas"][0]["pid"]
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                jobs = [pool.submit(_complete, http, p, 200) for p in DISTINCT]
                wait_until(lambda: http.get("/metrics").text.count("pagedrs:num_requests_running") > 0)
                wait_until(lambda: all(r["num_requests"] > 0 for r in http.get("/health").json()["replicas"]))
                os.kill(victim, signal.SIGKILL)
                codes = sorted(j.result().status_code for j in jobs)
            assert codes[:2] == [200, 200] and all(c >= 500 for c in codes[2:]), codes
            health = http.get("/health")
            assert health.status_code == 200  # replica 1 serves meanwhile
            after = [_complete(http, p, max_tokens=2).status_code for p in DISTINCT]
            assert after == [200] * 4
            back = wait_until(
                lambda: (r := http.get("/health").json()["replicas"][0])["state"] == "up" and r, timeout=90
            )
            assert back["restarts"] == 1 and back["pid"] != victim
        pids = tree(s.proc.pid)
        assert len(pids) >= 2
        assert s.terminate(60) == 0
        assert wait_until(lambda: all(process_gone(p) for p in pids), timeout=30)
    finally:
        s.kill()
