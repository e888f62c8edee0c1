"""Data parallelism in the frontend: N engine cores (`CoreReplica`: a core handle, its channel and its
restart count), each a whole replica of the model, behind one `AsyncLLMEngine`, and the router that picks
the replica of each request (vLLM's `--data-parallel-size` with an internal load balancer; the routing by
exact prefix-cache state is the router's, fed by the `KVCacheEvents` of each replica's step messages).

A replica that dies is restarted alone; its in-flight requests fail, the router takes no request to it
until it is Ready again, and the others go on serving."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from typing import Any

from pagedrs.engine.client.core_client import CoreClient
from pagedrs.engine.client.core_handles import CoreHandle, EngineStartupError, connect_ready
from pagedrs.engine.core.messages import (
    AbortRequests,
    EngineCoreOutputs,
    EngineCoreRequest,
    KVCacheEvents,
    Ready,
)
from pagedrs.engine.core.prefix_hashes import core_request_block_hashes
from pagedrs.engine.dp.frontends import FrontendRouter
from pagedrs.engine.dp.router import NoReplicaAvailable
from pagedrs.engine.frontend.request_stream import EngineCoreDiedError, EngineDeadError
from pagedrs.metrics import EngineStats

__all__ = [
    "CoreReplica",
    "ReplicaSet",
    "SESSION_HEADER",
    "NoReplicaAvailable",
    "session_key",
    "sum_stats",
]

logger = logging.getLogger("pagedrs.async_engine")

_READY_TIMEOUT_S = 600.0
_MONITOR_INTERVAL_S = 0.2

# The session of the request being handled (the server sets it from the request's `user` or its
# X-Session-Id header); with session affinity on, the requests of one session go to one replica.
SESSION_HEADER = "X-Session-Id"
session_key: ContextVar[str | None] = ContextVar("pagedrs_session_key", default=None)


_SUMMED = (
    "num_running",
    "num_waiting",
    "num_swapped",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "prompt_tokens_total",
    "generation_tokens_total",
    "num_preemptions",
    "num_blocks",
    "num_free_blocks",
    "num_swap_blocks",
    "num_free_swap_blocks",
    "num_steps",
    "batch_size",
    "spec_num_drafts",
    "spec_num_draft_tokens",
    "spec_num_accepted_tokens",
    "spec_num_pauses",
    "kv_offload_blocks",
    "kv_offload_used_blocks",
    "external_prefix_cache_queries",
    "external_prefix_cache_hits",
    "kv_offload_bytes_stored",
    "kv_offload_bytes_loaded",
    "kv_offload_evicted_blocks",
)


def sum_stats(stats: Sequence[EngineStats | None]) -> EngineStats | None:
    """The engine-wide stats of several replicas: queues, pools and counters summed, the cache usage over
    all their blocks, the step times the slowest replica's."""
    known = [s for s in stats if s is not None]
    if not known:
        return None
    if len(known) == 1:
        return known[0]
    out = EngineStats(**{k: sum(getattr(s, k) for s in known) for k in _SUMMED})
    used = sum(s.kv_usage * s.num_blocks for s in known)
    out.kv_usage = used / out.num_blocks if out.num_blocks else max(s.kv_usage for s in known)
    # Replicas have the same pools: a pool's usage over all replicas is the mean of theirs.
    names = dict.fromkeys(k for s in known for k in s.kv_group_usage)
    for name in names:
        values = [s.kv_group_usage[name] for s in known if name in s.kv_group_usage]
        out.kv_group_usage[name] = sum(values) / len(values)
    out.step_time_s = max(s.step_time_s for s in known)
    out.send_time_s = max(s.send_time_s for s in known)
    return out


class CoreReplica:
    """One engine core of the frontend: `make_handle(ipc_dir, gen)` starts generation `gen` of it; `start()`
    (blocking: the model loads) waits for its Ready, `connect()` (on the event loop) starts reading its
    step messages, which go to `on_outputs(index, msg, received_at)`."""

    def __init__(
        self,
        index: int,
        make_handle: Callable[[str, int], CoreHandle],
        ipc_dir: str,
        client_index: int,
        on_outputs: Callable[[int, EngineCoreOutputs, float], None],
        max_restarts: int,
    ) -> None:
        self.index = index
        self.ipc_dir = ipc_dir
        self.client_index = client_index
        self.max_restarts = max_restarts
        self.gen = 0
        self.num_restarts = 0
        self.dead: BaseException | None = None  # set while the core is down
        self.restarting = False
        self.killed_for: str | None = None  # why the watch killed the live core (it was stuck)
        self.num_stall_kills = 0
        self.unkillable_logged = False
        self.stats: EngineStats | None = None
        self.ready: Ready | None = None
        self.handle: CoreHandle | None = None
        self._make_handle = make_handle
        self._ready_sock: Any = None  # the output socket that read Ready (kept: see `connect`)
        self.client = CoreClient(client_index, lambda msg, t: on_outputs(index, msg, t))

    @property
    def pid(self) -> int | None:
        return getattr(self.handle, "pid", None)

    @property
    def serving(self) -> bool:
        return self.dead is None and self.handle is not None and self.handle.alive()

    def state(self) -> str:
        """up | restarting | down (out of restarts) | stopped."""
        if self.dead is None:
            return "up" if self.handle is not None and self.handle.alive() else "stopped"
        return "restarting" if self.restarting or self.num_restarts < self.max_restarts else "down"

    def start(self, timeout: float) -> Ready:
        """Starts generation `self.gen` and waits for its Ready (EngineStartupError: nothing left running)."""
        self.launch()
        return self.wait_ready(timeout)

    def launch(self) -> None:
        """Starts generation `self.gen`'s process, not waiting for it. Call it from a thread that outlives
        the core: a core process is killed when the thread that started it ends (PR_SET_PDEATHSIG)."""
        handle = self._make_handle(self.ipc_dir, self.gen)
        handle.start()
        self.gen = max(self.gen, getattr(handle, "gen", self.gen))  # a supervisor may be ahead
        self.handle = handle

    def wait_ready(self, timeout: float) -> Ready:
        """Waits for the launched core's Ready (any thread); EngineStartupError, the core stopped, if none."""
        assert self.handle is not None
        try:
            self.ready, self._ready_sock = connect_ready(self.handle, timeout, self.client_index)
        except BaseException:
            self.handle.stop(5)
            raise
        return self.ready

    def connect(self) -> None:
        # The socket that read Ready goes on reading: one PULL peer per output address, ever.
        assert self.handle is not None
        self.client.connect(self.handle.input_addr, self._ready_sock)
        self._ready_sock = None  # the client's now

    def disconnect(self) -> None:
        self.client.disconnect()
        if self._ready_sock is not None:  # read Ready, never connected
            self._ready_sock.close(linger=0)
            self._ready_sock = None

    def stop(self, timeout: float) -> None:
        if self.handle is not None:
            self.handle.stop(timeout)
        self.disconnect()

    def kill(self, why: str) -> bool:
        """Kills a stuck core so it is restarted as a dead one (False, logged once: it cannot be, as a
        core in a thread of this process or one a supervisor process owns)."""
        if self.handle is None or not self.handle.kill():
            if not self.unkillable_logged:
                logger.error("%s; it cannot be restarted from here (not a process of this server)", why)
                self.unkillable_logged = True
            return False
        logger.error("%s: killed, to be restarted", why)
        self.killed_for = f"{why} (killed)"
        self.num_stall_kills += 1
        return True


class ReplicaSet:
    """The frontend's engine cores: their start, the router (with more than one), which core each request
    in flight is on, and the watch that restarts a core that died. `on_outputs(index, msg, received_at)`
    gets every core's step messages."""

    def __init__(
        self,
        makers: Sequence[Callable[[str, int], CoreHandle]],
        ipc_dir: str,
        client_index: int,
        on_outputs: Callable[[int, EngineCoreOutputs, float], None],
        max_restarts: int,
    ) -> None:
        self.max_restarts = max_restarts
        self.replicas = [
            CoreReplica(
                i,
                make,
                ipc_dir if len(makers) == 1 else os.path.join(ipc_dir, f"dp{i}"),
                client_index,
                on_outputs,
                max_restarts,
            )
            for i, make in enumerate(makers)
        ]
        self.client_index = client_index
        self.router: FrontendRouter | None = None
        self.routing = "round_robin"
        self.owner: dict[str, int] = {}  # request id -> its replica

    # ---- start and stop ----------------------------------------------------------------------------
    def start_all(self, load_tokenizer: Callable[[], Any] | None = None) -> Any:
        """Starts every core and waits for their Ready (the models load in parallel); `load_tokenizer` runs
        here meanwhile and its result is returned (None without one). A failure stops them all and raises
        EngineStartupError (or the tokenizer's error)."""
        reps = self.replicas
        try:
            for r in reps:  # from this thread: its core processes live as long as it does
                if len(reps) > 1:
                    os.makedirs(r.ipc_dir, mode=0o700, exist_ok=True)
                r.launch()
            tokenizer = load_tokenizer() if load_tokenizer is not None else None
            if len(reps) == 1:
                self._wait(reps[0])
                return tokenizer
            with ThreadPoolExecutor(len(reps)) as pool:
                errors = [f.exception() for f in [pool.submit(self._wait, r) for r in reps]]
        except BaseException:
            self.stop_all(5)
            raise
        failed = [(i, e) for i, e in enumerate(errors) if e is not None]
        if failed:
            self.stop_all(5)
            i, exc = failed[0]
            raise EngineStartupError(f"data-parallel replica {i}: {exc}") from exc
        return tokenizer

    def _start(self, replica: CoreReplica) -> None:
        replica.launch()
        self._wait(replica)

    def _wait(self, replica: CoreReplica) -> None:
        ready = replica.wait_ready(_READY_TIMEOUT_S)
        logger.info(
            "engine core %d ready: %s, %d KV blocks", replica.index, ready.model_name, ready.num_blocks
        )

    def make_router(
        self, routing: str, block_size: int, session_affinity: bool, tuning: dict[str, Any] | None = None
    ) -> None:
        """With more than one core, the router that picks each request's (`tuning`: its knobs)."""
        self.routing = routing
        if len(self.replicas) > 1:
            self.router = FrontendRouter(
                len(self.replicas), routing, block_size=block_size, sticky=session_affinity, **(tuning or {})
            )

    def stop_all(self, timeout: float) -> None:
        if len(self.replicas) == 1:
            self.replicas[0].stop(timeout)
            return
        with ThreadPoolExecutor(len(self.replicas)) as pool:
            list(pool.map(lambda r: r.stop(timeout), self.replicas))

    # ---- state -------------------------------------------------------------------------------------
    @property
    def serving(self) -> bool:
        return any(r.serving for r in self.replicas)

    @property
    def dead_error(self) -> BaseException | None:
        """Why no core serves (None while one does)."""
        dead = [r.dead for r in self.replicas]
        return None if any(d is None for d in dead) else dead[0]

    def states(self) -> list[dict[str, Any]]:
        """Each core: its index, state (up | restarting | down | stopped), pid, restarts, requests in flight."""
        inflight = [0] * len(self.replicas)
        for idx in self.owner.values():
            inflight[idx] += 1
        return [
            {
                "index": r.index,
                "state": r.state(),
                "pid": r.pid,
                "restarts": r.num_restarts,
                "num_requests": inflight[r.index],
            }
            for r in self.replicas
        ]

    # ---- requests ----------------------------------------------------------------------------------
    def route(self, request_id: str, req: EngineCoreRequest) -> int:
        """The core of a request (0 with one core), recorded as its owner; NoReplicaAvailable if none is up."""
        r = 0
        if self.router is not None:
            hashes = core_request_block_hashes(req, self.router.block_size) if self.routing == "cache" else []
            r = self.router.route(request_id, hashes, len(req.prompt_token_ids), session_key.get())
        self.owner[request_id] = r
        return r

    def send(self, replica: int, msg: Any) -> None:
        self.replicas[replica].client.send(msg)

    def forget(self, request_id: str, num_generated: int = 0) -> int | None:
        """The request's core, which no longer owns it (the router is told it is done)."""
        replica = self.owner.pop(request_id, None)
        if replica is not None and self.router is not None:
            self.router.finish(request_id, num_generated)
        return replica

    def abort(self, request_id: str) -> None:
        replica = self.forget(request_id)
        if replica is not None:
            self.send(replica, AbortRequests([request_id]))

    def observe(self, replica: int, msg: EngineCoreOutputs) -> None:
        """A step message's stats and prefix-cache changes."""
        self.replicas[replica].stats = msg.stats
        if self.router is not None and msg.kv_events is not None:
            self.router.apply_events(replica, msg.kv_events)
        if self.router is not None and msg.client_load is not None:  # other frontends route here too
            self.router.observe_load(replica, msg.client_load, self.client_index)

    async def call(self, method: str, args: list[Any], timeout: float) -> Any:
        """A utility call on every core that serves: the first one's answer (for bools, all of them)."""
        live = [r for r in self.replicas if r.serving]
        results = await asyncio.gather(*(r.client.call(method, args, timeout) for r in live))
        if len(results) > 1 and all(isinstance(x, bool) for x in results):
            return all(results)
        return results[0]

    def fail_calls(self, exc: BaseException) -> None:
        for r in self.replicas:
            r.client.fail_calls(exc)

    # ---- faults ------------------------------------------------------------------------------------
    async def watch(
        self,
        replica: CoreReplica,
        fail: Callable[[set[str], BaseException], None],
        restarted: Callable[[], None],
        closing: Callable[[], bool],
        stall: Callable[[int], str | None] = lambda index: None,
    ) -> None:
        """Watches one core: when it dies, `fail`s its requests in flight, keeps the router off it, and
        restarts it (at most `max_restarts` times), calling `restarted()` when it serves again. A core
        alive but stuck (`stall(index)` says why, None while it steps) is killed and treated as dead."""
        while not closing():
            await asyncio.sleep(_MONITOR_INTERVAL_S)
            handle = replica.handle
            if closing() or handle is None or replica.dead is not None:
                continue
            stuck = stall(replica.index) if handle.alive() else None
            if stuck is not None and not replica.kill(stuck):
                continue
            if handle.alive():
                continue
            why = replica.killed_for or handle.exit_description()
            replica.killed_for = None
            if self.router is not None:
                why = f"data-parallel replica {replica.index}: {why}"
                self.router.set_available(replica.index, False)
            mine = {rid for rid, idx in self.owner.items() if idx == replica.index}
            logger.error("%s; failing %d in-flight requests", why, len(mine))
            replica.dead = EngineCoreDiedError(why)
            replica.disconnect()
            fail(mine, EngineCoreDiedError(f"{why} while the request was running"))
            replica.client.fail_calls(EngineDeadError(why))
            await self._restart(replica, restarted, closing)

    async def _restart(
        self, replica: CoreReplica, restarted: Callable[[], None], closing: Callable[[], bool]
    ) -> None:
        while replica.dead is not None and not closing() and replica.num_restarts < self.max_restarts:
            replica.num_restarts += 1
            replica.gen += 1
            replica.restarting = True
            logger.warning(
                "restarting engine core %d (%d/%d)", replica.index, replica.num_restarts, self.max_restarts
            )
            try:
                await asyncio.to_thread(self._start, replica)
            except Exception as exc:  # counted; tried again or given up
                logger.error("engine core %d restart failed: %s", replica.index, exc)
                continue
            finally:
                replica.restarting = False
            if closing():
                replica.stop(5)
                return
            replica.connect()
            replica.dead = None
            replica.stats = None
            if self.router is not None:
                self.router.apply_events(replica.index, KVCacheEvents(cleared=True))  # a new, empty cache
                self.router.set_available(replica.index, True)
            restarted()
        if replica.dead is not None:
            logger.error("engine core %d is down and out of restarts (%d)", replica.index, self.max_restarts)
