"""The data-parallel router: each policy, the hot-spot guard, sticky keys, replicas going down, the cores'
cache events and the optimistic entries of routed prompts. Pure Python, synthetic block hashes except
one test that hashes real prompts as the scheduler does."""

from __future__ import annotations

import pytest

from pagedrs.engine.core.messages import KVCacheEvents
from pagedrs.engine.dp.router import ROUTING_POLICIES, DPRouter, NoReplicaAvailable

BS = 16


def blocks(tag: int, n: int) -> list[int]:
    """n synthetic block hashes of one prefix family (distinct across tags)."""
    return [tag * 1_000_003 + i for i in range(n)]


def store(router: DPRouter, replica: int, hashes: list[int]) -> None:
    router.apply_events(replica, KVCacheEvents(stored=hashes))


def test_policies_named() -> None:
    assert ROUTING_POLICIES == ("cache", "least_loaded", "round_robin")


@pytest.mark.parametrize(
    ("args", "kwargs", "named"),
    [
        ((0,), {"block_size": BS}, "num_replicas"),
        ((True,), {"block_size": BS}, "num_replicas"),
        ((2, "random"), {"block_size": BS}, "'random'"),
        ((2,), {"block_size": 0}, "block_size"),
        ((2,), {"block_size": BS, "load_penalty": -1}, "load_penalty"),
        ((2,), {"block_size": BS, "balance_ratio": 0.5}, "balance_ratio"),
        ((2,), {"block_size": BS, "balance_abs_tokens": -5}, "balance_abs_tokens"),
        ((2,), {"block_size": BS, "max_sticky_keys": 0}, "max_sticky_keys"),
        ((2,), {"block_size": BS, "request_tokens": -1}, "request_tokens"),
        ((2,), {"block_size": BS, "optimistic": "yes"}, "optimistic"),
        ((2,), {"block_size": BS, "loadpenalty": 1}, "loadpenalty"),
        ((2,), {"block_size": BS, "host_tier_hit_weight": 1.5}, "host_tier_hit_weight"),
        ((2,), {"block_size": BS, "disk_tier_hit_weight": -0.1}, "disk_tier_hit_weight"),
    ],
)
def test_bad_construction_names_value(args: tuple, kwargs: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        DPRouter(*args, **kwargs)


def test_bad_calls_name_value() -> None:
    router = DPRouter(2, block_size=BS)
    with pytest.raises(ValueError, match="num_tokens"):
        router.route("a", [], -1)
    router.route("a", [], 5)
    with pytest.raises(ValueError, match="'a'"):
        router.route("a", [], 5)
    with pytest.raises(ValueError, match="replica"):
        router.apply_events(2, KVCacheEvents())
    with pytest.raises(ValueError, match="replica"):
        router.set_available(-1, False)


def test_round_robin_cycles_and_skips_down() -> None:
    router = DPRouter(3, "round_robin", block_size=BS)
    store(router, 2, blocks(1, 4))  # a cache is no reason to break the cycle
    picks = [router.route(f"r{i}", blocks(1, 4), 64) for i in range(6)]
    assert picks == [0, 1, 2, 0, 1, 2]
    router.set_available(1, False)
    assert [router.route(f"s{i}", [], 1) for i in range(4)] == [0, 2, 0, 2]


def test_least_loaded_by_tokens_then_requests_then_index() -> None:
    router = DPRouter(3, "least_loaded", block_size=BS)
    store(router, 2, blocks(1, 8))
    assert router.route("a", blocks(1, 8), 100) == 0  # all empty: lowest index, cache ignored
    assert router.route("b", [], 50) == 1
    assert router.route("c", [], 50) == 2
    assert router.route("d", [], 10) == 1  # 1 and 2 tie on tokens and requests: lowest index
    assert router.route("e", [], 0) == 2  # 60 vs 100 vs 50 tokens
    router.finish("a")
    assert router.route("f", [], 1) == 0


def test_cache_prefers_longest_cached_prefix() -> None:
    router = DPRouter(3, block_size=BS)
    prompt = blocks(7, 10)
    store(router, 0, prompt[:3])
    store(router, 1, prompt[:8])
    store(router, 2, prompt[1:10])  # everything but the first block: no leading run
    assert router.route("a", prompt, 10 * BS) == 1
    states = router.snapshot()
    assert states[1].hit_blocks_expected == 8
    assert [s.num_cached_blocks for s in states] == [3, 8, 9]


def test_cache_without_hits_is_least_loaded() -> None:
    router = DPRouter(2, block_size=BS, balance_abs_tokens=10**9, request_tokens=0)
    assert router.route("a", blocks(1, 2), 500) == 0
    assert router.route("b", blocks(2, 2), 100) == 1
    assert router.route("c", blocks(3, 2), 100) == 1  # 500 vs 100: replica 1 again
    assert router.route("d", blocks(4, 2), 100) == 1  # 500 vs 200
    assert router.route("e", blocks(5, 2), 100) == 1  # 500 vs 300
    assert router.route("f", blocks(6, 2), 100) == 1  # 500 vs 400
    assert router.route("g", blocks(7, 2), 100) == 0  # 500 vs 500: tie -> lowest index


def test_load_penalty_trades_cache_for_load() -> None:
    router = DPRouter(2, block_size=BS, load_penalty=1.0, balance_abs_tokens=10**9, request_tokens=0)
    prompt = blocks(1, 4)  # 64 cached tokens on replica 0
    store(router, 0, prompt)
    assert router.route("busy", [], 60) == 0  # tie: lowest index
    assert router.route("a", prompt, 64) == 0  # 64 - 60 > 0 - 0
    router.finish("a")
    router.finish("busy")
    assert router.route("busier", [], 70) == 0
    assert router.route("b", prompt, 64) == 1  # 64 - 70 < 0 - 0


def test_hot_spot_guard_ratio_and_floor() -> None:
    router = DPRouter(
        2, block_size=BS, load_penalty=0.0, balance_ratio=2.0, balance_abs_tokens=100, request_tokens=50
    )
    prompt = blocks(3, 64)  # 1024 cached tokens on replica 0 outweigh any load (penalty 0)
    store(router, 0, prompt)  # nothing to prefill: each request weighs request_tokens
    for i in range(2):
        assert router.route(f"a{i}", prompt, 50) == 0  # excess 0, then 50 <= floor 100
    assert router.route("a2", prompt, 50) == 0  # excess 100 <= floor
    assert router.route("a3", prompt, 50) == 1  # excess 150 > floor and > (2 - 1) x 0: guarded
    router.finish("a3")
    router.finish("a0")
    assert router.route("a4", prompt, 50) == 0  # excess 100 again


def test_guard_ratio_lets_big_loads_differ() -> None:
    router = DPRouter(
        2, block_size=BS, load_penalty=0.0, balance_ratio=2.0, balance_abs_tokens=100, request_tokens=500
    )
    prompt = blocks(3, 64)
    store(router, 0, prompt)
    router.route("big0", [], 500)  # replica 0: no hashes, its 500 tokens count until it finishes
    router.route("big1", [], 500)  # replica 1
    router.route("p0", prompt, 500)  # replica 0: 1500 vs 1000, excess 500 <= 1 x 1000
    assert router.route("p1", prompt, 500) == 0  # 1500 vs 1000: still within the ratio
    assert router.route("p2", prompt, 500) == 0  # 2000 vs 1000: excess 1000 = (2 - 1) x 1000
    assert router.route("p3", prompt, 500) == 1  # 2500 vs 1000: guarded
    # p3 has its 500 prompt tokens to prefill on replica 1, where nothing of it is cached
    assert [s.load_tokens for s in router.snapshot()] == [2500, 2000]


def test_load_is_prefill_left_plus_request_tokens() -> None:
    router = DPRouter(2, block_size=BS, load_penalty=0.0, request_tokens=10)
    tenant = blocks(1, 4)
    store(router, 0, tenant)
    a = [*tenant, *blocks(2, 2)]  # the tenant's 4 cached blocks, then 2 of its own
    assert router.route("a", a, 100) == 0
    b = blocks(3, 6)  # cached nowhere: least loaded
    assert router.route("b", b, 96) == 1
    full = blocks(4, 3)
    store(router, 0, full)
    assert router.route("c", full, 50) == 0  # every full block cached: only request_tokens
    assert [s.load_tokens for s in router.snapshot()] == [(100 - 64 + 10) + 10, 96 + 10]
    store(router, 1, b[:5])  # prefill under way: still counted
    assert router.snapshot()[1].load_tokens == 106
    router.apply_events(1, KVCacheEvents(stored=[b[5]]))  # its last full block stored: prefill done
    store(router, 0, a[4:])
    assert [s.load_tokens for s in router.snapshot()] == [20, 10]
    router.finish("a")
    router.finish("b")
    router.finish("c")
    assert [s.load_tokens for s in router.snapshot()] == [0, 0]


def test_prefill_ended_by_finish_or_replica_down() -> None:
    router = DPRouter(2, block_size=BS, request_tokens=8)
    p, q = blocks(5, 3), blocks(6, 3)
    assert router.route("p", p, 48) == 0
    assert router.route("q", q, 48) == 1
    # the same prompt follows p (its blocks are claimed there), but they are not computed yet: it
    # counts its whole prompt, as the core may compute both in one step
    assert router.route("p2", p, 48) == 0
    assert [s.load_tokens for s in router.snapshot()] == [2 * (48 + 8), 56]
    router.finish("p")  # before its last block was reported
    store(router, 0, p)  # ends p2's prefill
    assert [s.load_tokens for s in router.snapshot()] == [8, 56]
    router.set_available(1, False)
    router.set_available(1, True)
    store(router, 1, q)  # the dropped request's block: nothing to end
    assert [s.load_tokens for s in router.snapshot()] == [8, 0]


def test_cached_requests_let_a_replica_keep_its_tenant() -> None:
    """Requests whose prefix is cached weigh only request_tokens, so a replica holding a tenant keeps its
    requests under a load of cached requests that would guard it were they counted in prompt tokens."""
    router = DPRouter(2, block_size=BS, request_tokens=32, balance_abs_tokens=256)
    tenant = blocks(7, 16)  # 256 tokens
    store(router, 0, tenant)
    picks = [router.route(f"t{i}", [*tenant, 9_000 + i], 272) for i in range(6)]
    assert picks == [0] * 6  # 6 x (16 + 32) = 288 tokens: within the floor over an idle replica
    assert router.route("cold", blocks(8, 17), 272) == 1  # cached nowhere: the least loaded


def test_sticky_key_follows_replica_until_down_or_guarded() -> None:
    router = DPRouter(
        3, "least_loaded", block_size=BS, sticky=True, balance_abs_tokens=1000, request_tokens=0
    )
    assert router.route("a", [], 10, sticky_key="alice") == 0
    assert router.route("b", [], 10, sticky_key="bob") == 1
    assert router.route("c", [], 10, sticky_key="alice") == 0  # least loaded would be 2
    assert router.route("d", [], 10) == 2
    assert router.route("e", [], 2000, sticky_key="alice") == 0
    assert router.route("f", [], 10, sticky_key="alice") == 1  # replica 0 is now hot: remapped
    assert router.route("g", [], 10, sticky_key="alice") == 1
    router.set_available(1, False)
    assert router.route("h", [], 10, sticky_key="alice") == 2
    router.set_available(1, True)
    assert router.route("i", [], 10, sticky_key="alice") == 2


def test_sticky_off_ignores_keys() -> None:
    router = DPRouter(2, "round_robin", block_size=BS)
    assert [router.route(f"r{i}", [], 1, sticky_key="k") for i in range(3)] == [0, 1, 0]


def test_sticky_keys_bounded_lru() -> None:
    router = DPRouter(2, "round_robin", block_size=BS, sticky=True, max_sticky_keys=2)
    assert router.route("a", [], 1, sticky_key="k1") == 0
    assert router.route("b", [], 1, sticky_key="k2") == 1
    assert router.route("c", [], 1, sticky_key="k1") == 0  # k1 most recent now
    assert router.route("d", [], 1, sticky_key="k3") == 0  # k2 dropped
    assert router.route("e", [], 1, sticky_key="k2") == 1  # round robin again: a new key
    assert router.route("f", [], 1, sticky_key="k3") == 0


def test_down_replica_never_routed_and_state_dropped() -> None:
    router = DPRouter(2, block_size=BS, load_penalty=0.0)
    prompt = blocks(1, 4)
    store(router, 0, prompt)
    assert router.route("a", prompt, 64) == 0
    router.set_available(0, False)
    s0 = router.snapshot()[0]
    assert (s0.up, s0.num_requests, s0.load_tokens, s0.num_cached_blocks, s0.num_optimistic_blocks) == (
        False,
        0,
        0,
        0,
        0,
    )
    router.apply_events(0, KVCacheEvents(stored=prompt))  # a late message of the dead core: ignored
    assert all(router.route(f"r{i}", prompt, 64) == 1 for i in range(3))
    router.finish("a")  # dropped with the replica: ignored
    router.set_available(0, True)
    assert router.snapshot()[0].num_cached_blocks == 0
    assert router.route("b", prompt, 64) == 1  # replica 1 holds the prompt (optimistic), 0 is empty
    router.set_available(1, False)
    router.set_available(0, False)
    with pytest.raises(NoReplicaAvailable):
        router.route("c", prompt, 64)


def test_events_cleared_then_removed_then_stored() -> None:
    router = DPRouter(2, block_size=BS, optimistic=False)
    store(router, 1, [1, 2, 3, 4])
    # one step: everything cleared, 9 removed (stored and evicted within the step's order), 5..9 stored
    router.apply_events(1, KVCacheEvents(stored=[5, 6, 7, 8, 9], removed=[9], cleared=True))
    assert router.snapshot()[1].num_cached_blocks == 5  # removed before stored: 9 is kept
    assert router.route("a", [1, 2], 32) == 0  # 1, 2 cleared: least loaded
    assert router.route("b", [5, 6, 7], 48) == 1
    router.apply_events(1, KVCacheEvents(removed=[6]))
    assert router.snapshot()[1].num_cached_blocks == 4
    router.finish("a")
    router.finish("b")
    assert router.route("c", [5, 6, 7], 48) == 1
    assert router.snapshot()[1].hit_blocks_expected == 3 + 1  # b: 5, 6, 7; c: 5 (6 removed)
    router.finish("c")
    router.apply_events(1, KVCacheEvents(stored=[6]))
    assert router.route("d", [5, 6, 7], 48) == 1
    assert router.snapshot()[1].hit_blocks_expected == 3 + 1 + 3


def tier(
    router: DPRouter, replica: int, medium: str, hashes: list[int], removed: tuple[int, ...] = ()
) -> None:
    router.apply_events(
        replica, KVCacheEvents(tier_stored={medium: hashes}, tier_removed={medium: list(removed)})
    )


def test_a_tier_hit_is_cheaper_than_a_miss_and_dearer_than_a_device_hit() -> None:
    router = DPRouter(4, block_size=BS, optimistic=False)
    prompt = blocks(3, 6)
    for r in range(4):
        store(router, r, prompt[:2])
    store(router, 0, prompt[2:4])  # the device pool holds 4 blocks
    tier(router, 1, "CPU", prompt[2:4])  # 2 + 2 in host memory
    tier(router, 2, "DISK", prompt[2:4])  # 2 + 2 on disk
    # replica 3: 2 blocks, then a host tier block that does not continue the prefix (no hit)
    tier(router, 3, "CPU", prompt[3:6])
    assert [router.tier_hit(r, prompt) for r in range(4)] == [0.0, 1.0, 0.5, 0.0]
    assert router.snapshot()[1].num_tier_blocks == {"CPU": 2}
    assert router.route("a", prompt, 6 * BS) == 0  # the device hit wins
    router.set_available(0, False)
    assert router.route("b", prompt, 6 * BS) == 1  # host tier over disk; replica 3's run is broken
    router.finish("b")
    tier(router, 1, "CPU", [], removed=(prompt[3],))  # evicted from the host tier: one block left
    assert router.tier_hit(1, prompt) == 0.5
    # A block in both tiers counts at the host tier's weight; a run may pass from one tier to the other.
    tier(router, 2, "CPU", prompt[3:5])
    assert router.tier_hit(2, prompt) == 0.25 + 0.5 + 0.5  # disk, both (host), host


def test_tier_weights_and_the_tiers_after_a_clear_or_a_restart() -> None:
    router = DPRouter(2, block_size=BS, optimistic=False, host_tier_hit_weight=0.0, disk_tier_hit_weight=1.0)
    prompt = blocks(5, 4)
    tier(router, 0, "CPU", prompt)
    assert router.tier_hit(0, prompt) == 0.0
    assert router.route("a", prompt, 4 * BS) == 0  # a weight of 0: a miss; tie -> lowest index
    router.finish("a")
    tier(router, 1, "DISK", prompt)
    assert router.route("b", prompt, 4 * BS) == 1  # a weight of 1: as good as a device hit
    router.finish("b")
    tier(router, 0, "DISK", prompt[:1])
    router.apply_events(0, KVCacheEvents(cleared=True))  # the host tier is emptied; files stay
    assert router.snapshot()[0].num_tier_blocks == {"DISK": 1}
    router.set_available(1, False)
    router.set_available(1, True)  # back empty
    assert router.snapshot()[1].num_tier_blocks == {} and router.tier_hit(1, prompt) == 0.0


def test_optimistic_entries_keep_a_burst_together() -> None:
    router = DPRouter(2, block_size=BS, balance_abs_tokens=10**6)
    prompt = blocks(4, 32)  # 512 tokens
    picks = [router.route(f"r{i}", prompt, 520) for i in range(4)]
    assert picks == [0, 0, 0, 0]  # no event yet: the first request's blocks count as cached on 0
    assert router.snapshot()[0].num_optimistic_blocks == 32
    off = DPRouter(2, block_size=BS, optimistic=False, balance_abs_tokens=10**6)
    assert [off.route(f"r{i}", prompt, 520) for i in range(4)] == [0, 1, 0, 1]


def test_optimistic_entries_end_with_requests_or_events() -> None:
    router = DPRouter(2, block_size=BS, load_penalty=0.0)
    prompt = blocks(4, 8)
    router.route("a", prompt, 128)  # replica 0 claims 8 blocks
    router.route("b", prompt, 128)  # 0 again; its claims stack
    router.finish("a")
    assert router.snapshot()[0].num_optimistic_blocks == 8  # b still claims them
    router.apply_events(0, KVCacheEvents(removed=prompt[4:]))  # evicted: the claims go
    assert router.snapshot()[0].num_optimistic_blocks == 4
    router.apply_events(0, KVCacheEvents(stored=prompt[:2]))  # reported: exact now
    s0 = router.snapshot()[0]
    assert (s0.num_cached_blocks, s0.num_optimistic_blocks) == (2, 2)
    router.finish("b")
    s0 = router.snapshot()[0]
    assert (s0.num_cached_blocks, s0.num_optimistic_blocks, s0.load_tokens) == (2, 0, 0)
    router.route("x", [], 1)  # replica 0 (tie on load -> lowest index): now 1 token there
    assert router.route("c", prompt, 128) == 0  # the 2 reported blocks still count; 1 has none
    router.finish("c")
    router.finish("x")
    router.apply_events(0, KVCacheEvents(cleared=True))
    router.route("y", [], 1)  # replica 0
    assert router.route("d", prompt, 128) == 1  # nothing cached anywhere: least loaded


def test_finish_unknown_and_counts() -> None:
    router = DPRouter(2, block_size=BS)
    router.finish("never-routed")
    r = router.route("a", [], 30)
    router.finish("a", num_generated=12)
    router.finish("a", num_generated=12)  # twice: ignored
    s = router.snapshot()[r]
    assert (s.routed, s.finished, s.generated_tokens, s.num_requests, s.load_tokens) == (1, 1, 12, 0, 0)
    assert router.replica_of("a") is None


def test_routes_real_prompt_hashes_to_their_blocks() -> None:
    from pagedrs.engine.core.prefix_hashes import request_block_hashes

    system = list(range(100, 164))  # 4 blocks of 16
    a = request_block_hashes([*system, 1, 2, 3], BS)
    b = request_block_hashes([*system, 7, 8, 9, 10], BS)
    other = request_block_hashes(list(range(500, 564)), BS)
    router = DPRouter(2, block_size=BS)
    store(router, 1, a)
    assert a == b  # the same full blocks: the tails are partial
    assert router.route("b", b, len(b) * BS + 4) == 1
    assert router.route("o", other, 64) == 0


class ReferenceHolds:
    """What the router should believe each replica holds, kept the plain way: exact sets from events and
    a count per (replica, block) of the optimistic entries of requests in flight."""

    def __init__(self, n: int) -> None:
        self.exact: list[set[int]] = [set() for _ in range(n)]
        self.claims: list[dict[int, int]] = [{} for _ in range(n)]
        self.requests: dict[str, tuple[int, list[int]]] = {}
        # per request in flight: [replica, prompt tokens left to prefill, the block that ends the prefill]
        self.prefill: dict[str, list] = {}

    def held_prefix(self, r: int, prompt: list[int]) -> int:
        n = 0
        for h in prompt:
            if h not in self.exact[r] and not self.claims[r].get(h):
                break
            n += 1
        return n

    def routed(self, rid: str, r: int, prompt: list[int], num_tokens: int) -> None:
        hit = 0  # the leading blocks the core reported: optimistic entries do not lighten the load
        while hit < len(prompt) and prompt[hit] in self.exact[r]:
            hit += 1
        if hit < len(prompt):
            self.prefill[rid] = [r, max(0, num_tokens - hit * BS), prompt[-1]]
        else:
            self.prefill[rid] = [r, 0 if prompt else num_tokens, None]
        claimed = [h for h in prompt if h not in self.exact[r]]
        for h in claimed:
            self.claims[r][h] = self.claims[r].get(h, 0) + 1
        self.requests[rid] = (r, claimed)

    def load(self, r: int, request_tokens: int) -> int:
        return sum(request_tokens + left for rr, left, _ in self.prefill.values() if rr == r)

    def finished(self, rid: str) -> None:
        del self.prefill[rid]
        r, claimed = self.requests.pop(rid)
        for h in claimed:
            if self.claims[r].get(h):
                self.claims[r][h] -= 1

    def events(self, r: int, ev: KVCacheEvents) -> None:
        if ev.cleared:
            self.exact[r].clear()
            self.claims[r].clear()
        for h in ev.removed:
            self.exact[r].discard(h)
            self.claims[r].pop(h, None)
        self.exact[r].update(ev.stored)
        for entry in self.prefill.values():
            if entry[0] == r and entry[2] in ev.stored:
                entry[1], entry[2] = 0, None


def test_random_operations_match_reference() -> None:
    import random

    rng = random.Random(1)
    n = 3
    router = DPRouter(n, block_size=BS, load_penalty=0.0, balance_abs_tokens=10**9, request_tokens=7)
    ref = ReferenceHolds(n)
    families = [blocks(t, 6) for t in range(5)]
    in_flight: list[str] = []
    for step in range(3000):
        op = rng.random()
        if op < 0.4:
            prompt = rng.choice(families)[: rng.randint(0, 6)]
            expect = [ref.held_prefix(r, prompt) for r in range(n)]
            loads = [s.load_tokens for s in router.snapshot()]
            best = max(range(n), key=lambda r: (expect[r], -loads[r], -r))
            before = router.snapshot()[best].hit_blocks_expected
            rid = f"q{step}"
            num_tokens = rng.randint(1, 120)
            assert router.route(rid, prompt, num_tokens) == best, step
            assert router.snapshot()[best].hit_blocks_expected - before == expect[best]
            ref.routed(rid, best, prompt, num_tokens)
            in_flight.append(rid)
        elif op < 0.7 and in_flight:
            rid = in_flight.pop(rng.randrange(len(in_flight)))
            router.finish(rid)
            ref.finished(rid)
        else:
            r = rng.randrange(n)
            pool = [h for fam in families for h in fam]
            ev = KVCacheEvents(
                stored=rng.sample(pool, rng.randint(0, 4)),
                removed=rng.sample(pool, rng.randint(0, 4)),
                cleared=rng.random() < 0.02,
            )
            router.apply_events(r, ev)
            ref.events(r, ev)
        for r, state in enumerate(router.snapshot()):
            assert state.num_cached_blocks == len(ref.exact[r])
            held = {h for h, c in ref.claims[r].items() if c} - ref.exact[r]
            assert state.num_optimistic_blocks == len(held), step
            assert state.load_tokens == ref.load(r, 7), step
