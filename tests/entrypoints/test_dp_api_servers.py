"""`pagedrs serve --api-server-count 2 -dp 2`: two API server processes, each routing over both engine
cores. Greedy text as DP=1 offline through both API servers, both replicas used; a prefix-sharing sequence
sent through both API servers lands on the one replica that holds the prefix (each core's prefix-cache
changes and load reach every API server); a killed replica fails only its requests and comes back under
both API servers; SIGTERM leaves no process. Tiny model, CPU."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import SubprocessServer, wait_until

from pagedrs import LLM, SamplingParams
from tests.entrypoints.helpers_dp import (
    SHARED,
    ApiConnection,
    connect_to,
    dp_flags,
    per_engine,
    start_dp_server,
    tree,
)
from tests.helpers import child_pids, cmdline, make_tiny_llama, process_gone

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

TWO_BY_TWO = ["--api-server-count", "2"]
DISTINCT = [f"prompt number {i} about {w}" for i, w in enumerate(["cats", "rain", "maps", "jazz"])]
ROUTED = "pagedrs:dp_routed_requests_total"
FRESH = [  # no block in common: routed by load alone
    "Zebras run fast.",
    "Quiet lakes freeze.",
    "Mighty oaks grow.",
    "Violet skies glow.",
    "Brave owls hoot.",
    "Cold winds howl.",
    "Green frogs leap.",
    "Loud drums beat.",
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("pagedrs._core")
    return make_tiny_llama(tmp_path_factory.mktemp("dp-asc-model"), arch="qwen2")


@pytest.fixture(scope="module")
def server(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SubprocessServer]:
    s = SubprocessServer(tmp_path_factory.mktemp("dp-asc"), dp_flags(tiny, *TWO_BY_TWO))
    start_dp_server(s)
    yield s
    s.kill()


def _kids(server: SubprocessServer) -> tuple[list[int], list[int]]:
    """(engine core pids, API server pids) of the supervisor."""
    assert server.proc is not None
    kids = child_pids(server.proc.pid)
    cores = [k for k in kids if "pagedrs.engine.core.proc" in cmdline(k)]
    apis = [k for k in kids if "pagedrs.entrypoints.openai.server.multi_server" in cmdline(k)]
    assert len(cores) == 2 and len(apis) == 2, (cores, apis)
    return cores, apis


def _routed(server: SubprocessServer) -> dict[str, float]:
    with server.http() as http:
        return per_engine(http.get("/metrics").text)[ROUTED]


def test_greedy_text_through_both_api_servers_on_both_replicas(server: SubprocessServer, tiny: Path) -> None:
    prompts = [SHARED + "a", SHARED + "b", *DISTINCT]
    llm = LLM(str(tiny), device="cpu", dtype="float32", block_size=4, num_kv_blocks=64, num_threads=1)
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = [o.outputs[0].text for o in llm.generate(prompts, sp, use_tqdm=False)]
    llm.shutdown()
    conns = [connect_to(server, i) for i in (0, 1)]
    try:  # each API server answers every prompt, the two at once
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(lambda c: [c.complete(p, 8) for p in prompts], conns))
    finally:
        for c in conns:
            c.close()
    for got in answers:
        assert [code for code, _ in got] == [200] * len(prompts)
        assert [body["choices"][0]["text"] for _, body in got] == want
    before = _routed(server)

    def one(i: int) -> int:
        c = connect_to(server, i % 2)
        try:
            return c.complete(FRESH[i], 12)[0]
        finally:
            c.close()

    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # at once, no block shared: both replicas
        codes = list(pool.map(one, range(len(FRESH))))
    assert codes == [200] * len(FRESH)
    after = _routed(server)
    deltas = {e: after[e] - before.get(e, 0.0) for e in ("0", "1")}
    assert sum(deltas.values()) == len(FRESH) and min(deltas.values()) > 0, deltas


def _first_on_idle_replica(server: SubprocessServer, a: ApiConnection, b: ApiConnection, tenant: str) -> str:
    """A long request through API server 0 keeps one replica busy; the tenant's first request, through API
    server 1, must go to the other one (server 1 knows that load only from the core's report): the
    replica it went to. Empty when the long request finished first (a slow machine: try again)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        before = _routed(server)
        long_job = pool.submit(a.complete, "A long story about the sea, told slowly:", 200)
        busy = wait_until(lambda: [e for e, v in _routed(server).items() if v > before.get(e, 0.0)])
        time.sleep(0.05)  # the core's next step message reports the load
        assert b.complete(tenant + "question 0", 2)[0] == 200
        raced = long_job.done()
        assert long_job.result()[0] == 200
    if raced:
        return ""
    idle = "1" if busy == ["0"] else "0"
    after = _routed(server)
    assert {e: after[e] - before.get(e, 0.0) for e in ("0", "1")} == {busy[0]: 1, idle: 1}
    return idle


def test_prefix_sequence_through_both_api_servers_lands_on_one_replica(server: SubprocessServer) -> None:
    a, b = connect_to(server, 0), connect_to(server, 1)
    try:
        for attempt in range(3):
            tenant = f"Tenant {attempt}'s own system prompt, which no other request of this module sends. "
            home = _first_on_idle_replica(server, a, b, tenant)
            if home:
                break
        assert home, "the long request always finished before the next one was routed"
        # Both replicas are idle now: the rest of the sequence, alternating API servers, goes where the
        # prefix is cached (API server 0 never routed it: it knows from the core's prefix-cache events).
        start = _routed(server)
        with server.http() as http:
            hits_before = per_engine(http.get("/metrics").text)["pagedrs:prefix_cache_hits_total"]
        for i in range(1, 7):
            assert (a if i % 2 else b).complete(tenant + f"question {i}", 2)[0] == 200
        end = _routed(server)
        assert {e: end[e] - start[e] for e in ("0", "1")} == {home: 6, "1" if home == "0" else "0": 0}
        with server.http() as http:
            hits = per_engine(http.get("/metrics").text)["pagedrs:prefix_cache_hits_total"]
        assert hits[home] - hits_before[home] >= 6 * 4  # each found at least a block of the prefix cached
    finally:
        a.close()
        b.close()


def test_kill_replica_restart_then_sigterm(tiny: Path, tmp_path: Path) -> None:
    s = SubprocessServer(tmp_path, dp_flags(tiny, *TWO_BY_TWO))
    start_dp_server(s)
    assert s.proc is not None
    try:
        cores, apis = _kids(s)
        with s.http() as http:
            victim = http.get("/health").json()["replicas"][0]["pid"]
            assert victim in cores
            os.kill(victim, signal.SIGKILL)

            def both_up_again() -> bool:  # under both API servers
                for index in (0, 1):
                    c = connect_to(s, index)
                    status, body = c.get("/health")
                    c.close()
                    replicas = json.loads(body).get("replicas", [])
                    states = [(r["state"], r["restarts"]) for r in replicas]
                    if status != 200 or states != [("up", 1), ("up", 0)]:
                        return False
                return True

            wait_until(both_up_again, timeout=120, interval=0.5)
            new_cores, new_apis = _kids(s)
            assert victim not in new_cores and new_apis == apis and process_gone(victim)
            for index in (0, 1):  # each API server serves on both replicas again
                c = connect_to(s, index)
                codes = [c.complete(p, 2)[0] for p in DISTINCT]
                c.close()
                assert codes == [200] * len(DISTINCT)
        pids = tree(s.proc.pid)
        assert len(pids) >= 4
        assert s.terminate(60) == 0
        assert wait_until(lambda: all(process_gone(p) for p in pids), timeout=30)
    finally:
        s.kill()
