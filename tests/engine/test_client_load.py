"""Several API servers over data-parallel cores: what a core reports of each client's load
(`ClientLoadTracker`, in the router's measure) and how a frontend's router adds the other frontends' load
to its own (`FrontendRouter.observe_load`). Pure Python."""

from __future__ import annotations

from typing import Any

import msgspec

from pagedrs.engine.core.client_load import ClientLoadTracker
from pagedrs.engine.core.messages import (
    ClientLoad,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    output_decoder,
)
from pagedrs.engine.core.proc import EngineCoreProc
from pagedrs.engine.dp.frontends import FrontendRouter
from pagedrs.metrics import EngineStats
from pagedrs.sampling_params import SamplingParams

BS = 16
REQ = 32  # the router's request_tokens in these tests


def pairs(tracker: ClientLoadTracker) -> list[tuple[int, int]]:
    return [(c.requests, c.prefill_tokens) for c in tracker.loads()]


def test_tracker_counts_prefill_left_per_client() -> None:
    t = ClientLoadTracker(2)
    t.add("a", 0, 100)
    t.add("b", 1, 40)
    t.add("c", 1, 60)
    assert pairs(t) == [(1, 100), (2, 100)]
    # first scheduled: 64 of a's 100 prompt tokens were cached
    t.observe(EngineCoreOutput("a", 0, num_cached_tokens=64))
    assert pairs(t) == [(1, 36), (2, 100)]
    # a chunk later, nothing new: unchanged; b's first token ends its prefill
    t.observe(EngineCoreOutput("a", 0))
    t.observe(EngineCoreOutput("b", 0, new_token_ids=[7], num_cached_tokens=0))
    assert pairs(t) == [(1, 36), (2, 60)]
    # a stale cached count cannot raise the prefill left again
    t.observe(EngineCoreOutput("b", 0, num_cached_tokens=0))
    assert pairs(t) == [(1, 36), (2, 60)]
    assert t.client_of("c") == 1 and t.client_of("zz") is None
    assert t.forget("c") == 1 and t.forget("c") is None
    assert pairs(t) == [(1, 36), (1, 0)]
    t.add("a", 1, 10)  # an id sent again replaces the old request
    assert pairs(t) == [(0, 0), (2, 10)]
    assert sorted(t.request_ids()) == ["a", "b"]


def test_tracker_embedding_and_finish_end_prefill() -> None:
    t = ClientLoadTracker(1)
    t.add("e", 0, 50)
    t.add("f", 0, 30)
    t.observe(EngineCoreOutput("e", 0, embedding=[0.5, 0.25]))
    t.observe(EngineCoreOutput("f", 0, finish_reason=FinishReason.ABORT, error="too long"))
    assert pairs(t) == [(2, 0)]
    t.observe(EngineCoreOutput("unknown", 0, new_token_ids=[1]))  # not tracked: ignored
    assert pairs(t) == [(2, 0)]


def test_client_load_survives_the_wire() -> None:
    msg = EngineCoreOutputs([], EngineStats(), 1.0, client_load=[ClientLoad(2, 300), ClientLoad(0, 0)])
    back = output_decoder().decode(msgspec.msgpack.encode(msg))
    assert back.client_load == [ClientLoad(2, 300), ClientLoad(0, 0)]


def router() -> FrontendRouter:
    return FrontendRouter(2, "cache", block_size=BS, request_tokens=REQ)


def load(r: FrontendRouter, replica: int) -> int:
    return r.snapshot()[replica].load_tokens


def test_peer_load_in_the_routers_measure() -> None:
    r = router()
    # this frontend is client 0; client 1 has 3 requests with 500 tokens to prefill on replica 0
    r.observe_load(0, [ClientLoad(9, 9999), ClientLoad(3, 500)], 0)
    assert r.peer_load(0) == 500 + 3 * REQ
    assert load(r, 0) == 500 + 3 * REQ
    # a later report replaces the earlier one (not added to it)
    r.observe_load(0, [ClientLoad(0, 0), ClientLoad(1, 0)], 0)
    assert load(r, 0) == REQ
    # this frontend's own requests add to the peers'
    assert r.route("x", [], 80) == 1  # replica 1 is the less loaded
    assert load(r, 1) == 80 + REQ
    r.observe_load(1, [ClientLoad(1, 80), ClientLoad(2, 100)], 0)  # own share ignored in the report
    assert load(r, 1) == 80 + REQ + 100 + 2 * REQ


def test_peer_load_steers_cold_prompts_and_goes_with_a_dead_replica() -> None:
    r = router()
    r.observe_load(0, [ClientLoad(0, 0), ClientLoad(4, 1100)], 0)
    assert [r.route(f"q{i}", [], 40) for i in range(3)] == [1, 1, 1]
    r.set_available(0, False)
    assert r.peer_load(0) == 0
    r.observe_load(0, [ClientLoad(0, 0), ClientLoad(4, 1100)], 0)  # a down replica's report is ignored
    assert r.peer_load(0) == 0
    r.set_available(0, True)
    assert r.route("q3", [], 40) == 0  # back up, empty: the least loaded


class _FakeCore:
    """Holds requests until a step finishes them; what `EngineCoreProc` asks of a core here."""

    def __init__(self) -> None:
        self.requests: set[str] = set()

    def add_request(self, req: EngineCoreRequest) -> None:
        self.requests.add(req.request_id)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.requests


def test_core_proc_reports_each_clients_load(tmp_path: Any) -> None:
    proc = EngineCoreProc(f"ipc://{tmp_path}/in", [f"ipc://{tmp_path}/out0", f"ipc://{tmp_path}/out1"])
    proc.bind()
    try:
        core = _FakeCore()
        for rid, client, n in (("a", 0, 100), ("b", 1, 60), ("c", 1, 30)):
            req = EngineCoreRequest(rid, list(range(n)), SamplingParams(), 4, 0.0, client_index=client)
            proc._add(core, req)  # type: ignore[arg-type]
        step = [
            EngineCoreOutput("a", 0, num_cached_tokens=64),
            EngineCoreOutput("b", 0, new_token_ids=[5], num_cached_tokens=48),
        ]
        proc._publish(core, EngineCoreOutputs(step, EngineStats(), 1.0))  # type: ignore[arg-type]
        core.requests.discard("c")
        proc._publish(
            core,
            EngineCoreOutputs(
                [EngineCoreOutput("c", 0, finish_reason=FinishReason.ABORT)], EngineStats(), 2.0
            ),
        )  # type: ignore[arg-type]
        sent = [proc._outputs.get_nowait() for _ in range(4)]
        assert [(i, [o.request_id for o in m.outputs]) for i, m in sent] == [
            (0, ["a"]),
            (1, ["b"]),
            (0, []),
            (1, ["c"]),
        ]
        first, last = sent[0][1].client_load, sent[3][1].client_load
        assert first == [ClientLoad(1, 36), ClientLoad(2, 30)]  # a: 36 left; b prefilled; c: all 30
        assert last == [ClientLoad(1, 36), ClientLoad(1, 0)]  # c finished
    finally:
        proc.close()
