"""The data-parallel router: which engine core (replica) takes a request.

It keeps, per replica, the exact set of prefix-cache block hashes the core holds (from the net changes in
its step messages, `KVCacheEvents`), the requests in flight there and their load in tokens, and picks a
replica by one of `ROUTING_POLICIES`.

A replica's load is the work its requests in flight still bring, in prompt tokens: per request
``request_tokens`` (its share of the decode steps) plus the prompt tokens it has still to prefill. Those
are the tokens past the prefix the replica's core reported cached when the request was routed to it (not
blocks only claimed by other requests in flight: the core computes a prefix again for requests scheduled
in the same step), counted until the core reports the prompt's last full block stored (its prefill is then
done); a prompt routed without its block hashes counts every prompt token until it finishes. So a request
whose prefix is cached, or that is past its prefill, weighs little, and a queued prefill weighs what it
will cost.

* ``cache``: the most cached prefix tokens (the longest run of the prompt's leading block hashes a replica
  holds, times the block size) minus ``load_penalty`` times the replica's load. A replica whose load
  exceeds the least loaded one's by more than ``balance_abs_tokens`` and by more than ``balance_ratio``
  times gets no new work, whatever its cache (SGLang's gateway balances its cache-aware policy on the same
  two thresholds). Ties go to the least loaded replica, then to the lowest index. Past a replica's cached
  prefix, the prompt's next blocks that its KV tiers hold (its host tier, medium ``CPU``, and disk tier,
  ``DISK``, from the tier net changes in its step messages) count as partial hits, up to the first block
  held nowhere there: each ``host_tier_hit_weight`` (or ``disk_tier_hit_weight``) of a cached block, as
  loading a block from host memory or disk is cheaper than computing it and dearer than a device hit.
* ``least_loaded``: the least load (then fewest requests, then the lowest index).
* ``round_robin``: the next replica that is up.

A routed prompt's block hashes count as cached on the chosen replica at once (optimistic entries, as
SGLang's approximate radix tree inserts a request's prefix when it routes it), so a burst of requests
with one prefix does not scatter before the core's first events arrive. An optimistic entry lasts while
a request that made it is in flight, unless an event removes that block (or clears the cache) first.

With ``sticky``, requests with the same ``sticky_key`` go to the replica the key was last routed to while
that replica is up and not guarded against (a bounded map, least recently used keys dropped first).

All state sits in plain dicts and sets; a route walks the prompt's hashes once against one map from
block hash to a bit mask of the replicas holding it, so it costs O(blocks in the prompt + replicas)
whatever the cache sizes; a step's events cost one more dict lookup per stored block (the prefills they
end). Every public method takes one lock, so the frontend may call from any thread.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedrs.config.router_tuning import check_tuning
from pagedrs.engine.core.messages import KVCacheEvents

__all__ = ["ROUTING_POLICIES", "DPRouter", "NoReplicaAvailable", "ReplicaState"]

ROUTING_POLICIES = ("cache", "least_loaded", "round_robin")

_CLAIM_BITS = 20
_CLAIM_MAX = (1 << _CLAIM_BITS) - 1  # claims of one block on one replica beyond this are not counted


class NoReplicaAvailable(RuntimeError):
    """Every replica is down: the request cannot be routed."""


@dataclass(frozen=True, slots=True)
class ReplicaState:
    """One replica as the router sees it."""

    index: int
    up: bool
    num_requests: int  # in flight (routed, not finished)
    load_tokens: int  # load of the requests in flight (prompt tokens still to prefill + request_tokens each)
    num_cached_blocks: int  # block hashes the core reported cached
    num_optimistic_blocks: int  # blocks counted as cached from routed prompts, not yet reported
    routed: int  # requests routed here since the router started
    hit_blocks_expected: int  # sum of the cached prefix blocks of the requests routed here
    finished: int  # requests finished or aborted here
    generated_tokens: int  # output tokens of the finished ones
    num_tier_blocks: dict[str, int] = field(default_factory=dict)  # medium -> blocks its KV tier holds


@dataclass(slots=True)
class _InFlight:
    replica: int
    prefill: int  # prompt tokens still to prefill (its load: this + request_tokens)
    marker: int | None  # the prompt's last full block: stored on the replica -> prefill done
    claimed: list[int]  # hashes this request holds optimistic entries for


@dataclass(slots=True)
class _Replica:
    up: bool = True
    cached: set[int] = field(default_factory=set)  # exact: from the core's events
    tiers: dict[str, set[int]] = field(default_factory=dict)  # medium -> block hashes its KV tier holds
    prefilling: dict[int, list[str]] = field(default_factory=dict)  # marker hash -> requests awaiting it
    load: int = 0  # of the requests in flight
    num_requests: int = 0
    routed: int = 0
    hit_blocks: int = 0
    finished: int = 0
    generated: int = 0


class DPRouter:
    """Routes requests among `num_replicas` engine cores by `policy` (one of `ROUTING_POLICIES`)."""

    def __init__(
        self,
        num_replicas: int,
        policy: str = "cache",
        *,
        block_size: int,
        sticky: bool = False,
        **tuning: Any,
    ) -> None:
        if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"num_replicas must be an int >= 1, got {num_replicas!r}")
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing policy must be one of {ROUTING_POLICIES}, got {policy!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        t = check_tuning(tuning)
        self.num_replicas = num_replicas
        self.policy = policy
        self.block_size = block_size
        self.sticky = bool(sticky)
        self.tuning: dict[str, Any] = t  # every knob, defaults included
        self._penalty = float(t["load_penalty"])
        self._request_tokens = int(t["request_tokens"])
        self._ratio = float(t["balance_ratio"])
        self._abs = float(t["balance_abs_tokens"])
        self._optimistic: bool = t["optimistic"]
        self._max_sticky: int = t["max_sticky_keys"]
        self._tier_weights = {
            "CPU": float(t["host_tier_hit_weight"]),
            "DISK": float(t["disk_tier_hit_weight"]),
        }
        self._replicas = [_Replica() for _ in range(num_replicas)]
        # _index: block hash -> packed int, so that a route reads one entry per block and a claim writes
        # one. Bits [0, n): replicas holding the block (the walk's mask); bits [n, 2n): replicas whose core
        # reported it (`_Replica.cached`); then per replica a _CLAIM_BITS field: its requests in flight that
        # hold an optimistic entry for it. INVARIANT: the holding bit of r is set iff r's exact bit is set
        # or its claim count is > 0; all three are 0 for a replica that is down; no entry is 0.
        self._index: dict[int, int] = {}
        self._exact = [1 << (num_replicas + r) for r in range(num_replicas)]
        self._claim_unit = [1 << (2 * num_replicas + _CLAIM_BITS * r) for r in range(num_replicas)]
        self._claim_field = [_CLAIM_MAX * u for u in self._claim_unit]
        self._up_mask = (1 << num_replicas) - 1
        self._requests: dict[str, _InFlight] = {}
        self._sticky_map: OrderedDict[str, int] = OrderedDict()
        self._next_rr = 0
        self._lock = threading.Lock()

    # --- routing ---------------------------------------------------------------------------------

    def route(
        self, request_id: str, block_hashes: Sequence[int], num_tokens: int, sticky_key: str | None = None
    ) -> int:
        """The replica for this request (its prompt's block hashes, `num_tokens` the tokens it brings);
        records it in flight there until `finish`. NoReplicaAvailable when every replica is down."""
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
        with self._lock:
            if request_id in self._requests:
                raise ValueError(f"request {request_id!r} is already in flight")
            if not self._up_mask:
                raise NoReplicaAvailable(f"all {self.num_replicas} data-parallel replicas are down")
            matched = self._match(block_hashes)
            key = sticky_key if self.sticky else None
            r = self._sticky_choice(key)
            if r is None:
                r = self._choose(matched, block_hashes)
                if key is not None:
                    self._remember_sticky(key, r)
            self._admit(request_id, r, block_hashes, num_tokens, matched[r])
            return r

    def _match(self, block_hashes: Sequence[int]) -> list[int]:
        """Per replica, how many of the leading blocks it holds (0 for a replica that is down)."""
        matched = [0] * self.num_replicas
        alive = self._up_mask
        get = self._index.get
        depth = 0
        for h in block_hashes:
            held = alive & get(h, 0)
            if held != alive:
                lost = alive & ~held
                while lost:
                    low = lost & -lost
                    matched[low.bit_length() - 1] = depth
                    lost ^= low
                alive = held
                if not alive:
                    break
            depth += 1
        while alive:
            low = alive & -alive
            matched[low.bit_length() - 1] = depth
            alive ^= low
        return matched

    def _eligible(self) -> list[int]:
        """The replicas that are up and not guarded against (the least loaded one always is eligible)."""
        up = [i for i, rep in enumerate(self._replicas) if rep.up]
        least = min(self._replicas[i].load for i in up)
        margin = max(self._abs, (self._ratio - 1.0) * least)
        return [i for i in up if self._replicas[i].load - least <= margin]

    def _choose(self, matched: list[int], block_hashes: Sequence[int]) -> int:
        reps = self._replicas
        if self.policy == "round_robin":
            n = self.num_replicas
            for step in range(n):
                i = (self._next_rr + step) % n
                if reps[i].up:
                    self._next_rr = (i + 1) % n
                    return i
            raise AssertionError("no replica up")  # route checked _up_mask
        up = [i for i, rep in enumerate(reps) if rep.up]
        if self.policy == "least_loaded":
            return min(up, key=lambda i: (reps[i].load, reps[i].num_requests, i))
        bs, lam = self.block_size, self._penalty
        eligible = self._eligible()
        hit = {i: matched[i] + self._tier_hit(i, block_hashes, matched[i]) for i in eligible}
        return max(eligible, key=lambda i: (hit[i] * bs - lam * reps[i].load, -reps[i].load, -i))

    def tier_hit(self, replica: int, block_hashes: Sequence[int]) -> float:
        """The prompt's blocks replica `replica`'s KV tiers hold past its cached prefix, each weighted by
        its tier's weight (what the `cache` policy adds to the cached prefix blocks)."""
        self._check_replica(replica)
        with self._lock:
            return self._tier_hit(replica, block_hashes, self._match(block_hashes)[replica])

    def _tier_hit(self, r: int, block_hashes: Sequence[int], start: int) -> float:
        tiers = [
            (held, self._tier_weights.get(m, 0.0)) for m, held in self._replicas[r].tiers.items() if held
        ]
        if not tiers:
            return 0.0
        total = 0.0
        for h in block_hashes[start:]:
            w = max((weight for held, weight in tiers if h in held), default=None)
            if w is None:
                break
            total += w
        return total

    def _sticky_choice(self, key: str | None) -> int | None:
        if key is None:
            return None
        r = self._sticky_map.get(key)
        if r is None or not self._replicas[r].up:
            return None
        if r not in self._eligible():
            return None
        self._sticky_map.move_to_end(key)
        return r

    def _remember_sticky(self, key: str, r: int) -> None:
        self._sticky_map[key] = r
        self._sticky_map.move_to_end(key)
        while len(self._sticky_map) > self._max_sticky:
            self._sticky_map.popitem(last=False)

    def _admit(self, request_id: str, r: int, block_hashes: Sequence[int], num_tokens: int, hit: int) -> None:
        rep = self._replicas[r]
        claimed: list[int] = []
        # the leading blocks the core reported (an optimistic entry's prefill may run in this one's step)
        computed = hit
        if self._optimistic:
            bit, exact, unit, claims = 1 << r, self._exact[r], self._claim_unit[r], self._claim_field[r]
            index = self._index
            computed = -1
            for i, h in enumerate(block_hashes):
                v = index.get(h, 0)
                if not v & exact and computed < 0:
                    computed = i
                if v & exact or v & claims == claims:
                    continue
                index[h] = (v | bit) + unit
                claimed.append(h)
            if computed < 0:
                computed = len(block_hashes)
        marker = None
        if computed < len(block_hashes):
            prefill = max(0, num_tokens - computed * self.block_size)
            marker = block_hashes[-1]
            rep.prefilling.setdefault(marker, []).append(request_id)
        else:  # the whole prompt's full blocks held there (or no hashes: counted till it finishes)
            prefill = num_tokens if not block_hashes else 0
        self._requests[request_id] = _InFlight(r, prefill, marker, claimed)
        rep.load += prefill + self._request_tokens
        rep.num_requests += 1
        rep.routed += 1
        rep.hit_blocks += hit

    # --- feedback from the cores -------------------------------------------------------------------

    def finish(self, request_id: str, num_generated: int = 0) -> None:
        """The request finished or was aborted: its load and optimistic entries go. Unknown ids (never
        routed, finished already, or dropped with a replica that went down) are ignored."""
        with self._lock:
            req = self._requests.pop(request_id, None)
            if req is None:
                return
            rep = self._replicas[req.replica]
            rep.load -= req.prefill + self._request_tokens
            rep.num_requests -= 1
            if req.marker is not None:
                rids = rep.prefilling[req.marker]
                rids.remove(request_id)
                if not rids:
                    del rep.prefilling[req.marker]
            rep.finished += 1
            rep.generated += max(0, int(num_generated))
            r = req.replica
            bit, exact, unit, claims = 1 << r, self._exact[r], self._claim_unit[r], self._claim_field[r]
            index = self._index
            for h in req.claimed:
                v = index.get(h, 0)
                if not v & claims:  # an event removed it first
                    continue
                v -= unit
                if not v & (claims | exact):
                    v &= ~bit
                if v:
                    index[h] = v
                else:
                    del index[h]

    def apply_events(self, replica: int, events: KVCacheEvents) -> None:
        """One step's net change to the replica's prefix cache: `cleared`, then `removed`, then `stored`
        (see `KVCacheEvents`). Events of a replica that is down are ignored (it restarts empty)."""
        self._check_replica(replica)
        with self._lock:
            rep = self._replicas[replica]
            if not rep.up:
                return
            if events.cleared:
                self._forget(replica)
                rep.tiers.pop("CPU", None)  # the host tier is emptied with the cache; disk files stay
            for medium, hashes in events.tier_removed.items():
                rep.tiers.get(medium, set()).difference_update(hashes)
            for medium, hashes in events.tier_stored.items():
                rep.tiers.setdefault(medium, set()).update(hashes)
            everything = self._all_bits(replica)
            for h in events.removed:
                rep.cached.discard(h)
                self._drop(h, everything)
            held = (1 << replica) | self._exact[replica]
            index = self._index
            for h in events.stored:
                rep.cached.add(h)
                index[h] = index.get(h, 0) | held
            if rep.prefilling:
                self._prefilled(rep, events.stored)

    def set_available(self, replica: int, up: bool) -> None:
        """Mark a replica up or down. Down: never routed to; its cache set, optimistic entries, in-flight
        requests and sticky keys are dropped (it comes back empty, as a restarted core is)."""
        self._check_replica(replica)
        with self._lock:
            rep = self._replicas[replica]
            bit = 1 << replica
            if up:
                rep.up = True
                self._up_mask |= bit
                return
            if not rep.up:
                return
            self._forget(replica)
            rep.tiers.clear()
            rep.up = False
            self._up_mask &= ~bit
            for rid in [rid for rid, req in self._requests.items() if req.replica == replica]:
                del self._requests[rid]
            rep.load = 0
            rep.num_requests = 0
            rep.prefilling.clear()
            for key in [k for k, r in self._sticky_map.items() if r == replica]:
                del self._sticky_map[key]

    def snapshot(self) -> list[ReplicaState]:
        """Every replica's state, in index order."""
        with self._lock:
            return [
                ReplicaState(
                    index=i,
                    up=rep.up,
                    num_requests=rep.num_requests,
                    load_tokens=rep.load,
                    num_cached_blocks=len(rep.cached),
                    num_optimistic_blocks=self._num_optimistic(i),
                    num_tier_blocks={m: len(held) for m, held in rep.tiers.items() if held},
                    routed=rep.routed,
                    hit_blocks_expected=rep.hit_blocks,
                    finished=rep.finished,
                    generated_tokens=rep.generated,
                )
                for i, rep in enumerate(self._replicas)
            ]

    def replica_of(self, request_id: str) -> int | None:
        """The replica a request in flight was routed to (None: not in flight)."""
        with self._lock:
            req = self._requests.get(request_id)
            return None if req is None else req.replica

    # --- helpers ---------------------------------------------------------------------------------

    def _check_replica(self, replica: int) -> None:
        if isinstance(replica, bool) or not isinstance(replica, int) or not 0 <= replica < self.num_replicas:
            raise ValueError(f"replica must be an int in [0, {self.num_replicas}), got {replica!r}")

    def _all_bits(self, r: int) -> int:
        return (1 << r) | self._exact[r] | self._claim_field[r]

    def _forget(self, r: int) -> None:
        """Empty replica r's exact and optimistic entries (its requests keep their lists; `finish` finds
        their claims gone and skips them)."""
        everything = self._all_bits(r)
        rep = self._replicas[r]
        for h in rep.cached:
            self._drop(h, everything)
        for req in self._requests.values():
            if req.replica == r:
                for h in req.claimed:
                    self._drop(h, everything)
        rep.cached.clear()

    def _prefilled(self, rep: _Replica, stored: Sequence[int]) -> None:
        """The requests whose prompt's last full block is among `stored` are past their prefill."""
        waiting, requests = rep.prefilling, self._requests
        for h in stored:
            rids = waiting.pop(h, None)
            if rids is None:
                continue
            for rid in rids:
                req = requests[rid]
                rep.load -= req.prefill
                req.prefill, req.marker = 0, None

    def _drop(self, h: int, bits: int) -> None:
        v = self._index.get(h)
        if v is None:
            return
        v &= ~bits
        if v:
            self._index[h] = v
        else:
            del self._index[h]

    def _num_optimistic(self, r: int) -> int:
        """Blocks replica r holds only by optimistic entries."""
        exact, claims, index = self._exact[r], self._claim_field[r], self._index
        claimed = {h for req in self._requests.values() if req.replica == r for h in req.claimed}
        n = 0
        for h in claimed:
            v = index.get(h, 0)
            if v & claims and not v & exact:
                n += 1
        return n
