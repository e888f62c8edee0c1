"""AsyncLLMEngine: the server's frontend to an engine core that runs in its own process (or, for an engine
object handed in, in a thread behind the same channel).

The event loop never calls into the engine. Requests are validated and tokenized here (InputProcessor) and
sent through a `CoreClient` (ZeroMQ + msgspec); its task receives the core's one-message-per-step outputs,
and this engine runs the OutputProcessor (detokenization, stop strings) and feeds each request's `RequestStream`. A stream
whose reader is slow gets its deltas merged: the next read returns everything since the previous one.

A dead core process is detected: every in-flight request gets `EngineCoreDiedError`, the engine reports
unhealthy, and the core is restarted (at most `max_restarts` times) so that new requests are served.

With data parallelism (`data_parallel_size` N > 1) the engine holds N cores (`dp_client.CoreReplica`) and
a router (`dp_router.DPRouter`) that sends each request to one of them; a dead replica is restarted alone
and the engine stays healthy while one replica serves.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, overload

from pagedrs.engine.core_handles import CoreHandle, EngineStartupError, RemoteCore, ThreadCore
from pagedrs.engine.dp_client import (
    CoreReplica,
    NoReplicaAvailable,
    make_core_handle,
    make_router,
    replica_engine_args,
    session_key,
    sum_stats,
)
from pagedrs.engine.input_processor import InputError, InputProcessor
from pagedrs.engine.messages import AbortRequests, EngineCoreOutputs, KVCacheEvents
from pagedrs.engine.output_processor import OutputProcessor
from pagedrs.engine.prefix_hashes import core_request_block_hashes
from pagedrs.engine.request_stream import (
    EngineCoreDiedError,
    EngineDeadError,
    EngineDrainingError,
    RequestAbortedError,
    RequestStream,
    StepObserver,
)
from pagedrs.lora_request import LoRARequest
from pagedrs.metrics import EngineStats
from pagedrs.outputs import EmbeddingRequestOutput, RequestOutput
from pagedrs.pooling_params import PoolingParams
from pagedrs.sampling_params import RequestOutputKind, SamplingParams

__all__ = [
    "AsyncLLMEngine",
    "EngineCoreDiedError",
    "EngineDeadError",
    "EngineDrainingError",
    "EngineStartupError",
    "RequestAbortedError",
    "RequestStream",
]

logger = logging.getLogger("pagedrs.async_engine")

_READY_TIMEOUT_S = 600.0
_MONITOR_INTERVAL_S = 0.2


def _frontend_tokenizer(engine_args: Any) -> Any:
    """The tokenizer the frontend validates, tokenizes and detokenizes with (None: skip_tokenizer_init)."""
    if engine_args.skip_tokenizer_init:
        return None
    from pagedrs.loader import load_tokenizer

    return load_tokenizer(engine_args.model, engine_args.tokenizer, engine_args.load_options())


class AsyncLLMEngine:
    """`from_engine_args` runs the core (or `data_parallel_size` cores) in its own process; `AsyncLLMEngine(
    engine)` runs a given engine (an `LLMEngine`, an `EngineCore` or a stand-in with its methods) in a
    thread behind the same channel. `from_supervised_core` is one of several API server processes sharing a
    core that a supervisor runs. The cores start (and the model loads) in the constructor; `start()` must
    then be called from the serving event loop."""

    def __init__(
        self,
        engine: Any = None,
        *,
        observer: StepObserver | None = None,
        tokenizer: Any = None,
        max_restarts: int = 3,
        client_index: int = 0,
        ipc_dir: str | None = None,
        _make_handle: Callable[[str, int], CoreHandle]
        | Sequence[Callable[[str, int], CoreHandle]]
        | None = None,
        routing: str = "round_robin",
        session_affinity: bool = False,
    ) -> None:
        self.observer = observer
        self.max_restarts = max_restarts
        self.client_index = client_index
        self._owns_ipc_dir = ipc_dir is None
        self._ipc_dir = ipc_dir or tempfile.mkdtemp(prefix="pagedrs-ipc-")  # mode 0700
        if _make_handle is None:
            core = getattr(engine, "engine_core", engine)  # an LLMEngine runs its core
            tokenizer = tokenizer if tokenizer is not None else engine.get_tokenizer()
            _make_handle = lambda ipc_dir, gen: ThreadCore(core, ipc_dir, gen)  # noqa: E731
        makers = [_make_handle] if callable(_make_handle) else list(_make_handle)
        self.tokenizer = tokenizer
        self._replicas = [
            CoreReplica(
                i,
                make,
                self._ipc_dir if len(makers) == 1 else _replica_dir(self._ipc_dir, i),
                client_index,
                self._on_outputs,
                max_restarts,
            )
            for i, make in enumerate(makers)
        ]
        self._start_all()  # raises EngineStartupError
        ready = self.ready
        self.model_name = ready.model_name
        self.max_model_len = ready.max_model_len
        self.vocab_size = ready.vocab_size or len(tokenizer)
        self.input_processor = InputProcessor(
            tokenizer,
            max_model_len=ready.max_model_len,
            vocab_size=self.vocab_size,
            max_logprobs=ready.max_logprobs,
            strict=True,
            embedding_size=ready.embedding_size,
            task=ready.task,
        )
        self.embedding_size = ready.embedding_size
        self.output_processor = OutputProcessor(tokenizer, observer)
        self.routing = routing
        self.router = (
            make_router(len(makers), routing, ready.block_size, session_affinity) if len(makers) > 1 else None
        )
        self._streams: dict[str, RequestStream[Any]] = {}
        self._owner: dict[str, int] = {}  # request id -> its replica
        self._num_inflight = 0
        self._draining = False
        self._closing = False
        self._started = False
        self._tasks: list[asyncio.Task[None]] = []
        self._restart_listeners: list[Callable[[], None]] = []

    @classmethod
    def from_engine_args(cls, engine_args: Any, **kwargs: Any) -> AsyncLLMEngine:
        """The core in its own process (`data_parallel_size` of them: each a replica, its own process or Ray
        actor), loading the model there; the tokenizer is loaded here."""
        engine_args.early_configs()  # bad arguments fail here, before any process starts
        # A Hub name is fetched here, once: the tokenizer below and the core process read the local copy.
        engine_args = engine_args.with_local_model()
        dp = engine_args.data_parallel_config()
        if dp.size == 1 and dp.backend == "mp":
            makers = [lambda ipc_dir, gen: make_core_handle("mp", engine_args, ipc_dir, gen)]
        else:
            makers = [_maker(dp.backend, replica_engine_args(engine_args, i)) for i in range(dp.size)]
        return cls(
            tokenizer=_frontend_tokenizer(engine_args),
            _make_handle=makers,
            routing=dp.routing,
            session_affinity=dp.session_affinity,
            **kwargs,
        )

    @classmethod
    def from_supervised_core(
        cls, engine_args: Any, ipc_dir: str, client_index: int, **kwargs: Any
    ) -> AsyncLLMEngine:
        """Client `client_index` of the core that this process's parent supervises in `ipc_dir`
        (`--api-server-count N`): the parent starts and restarts the core; this frontend follows it."""
        return cls(
            tokenizer=_frontend_tokenizer(engine_args),
            client_index=client_index,
            ipc_dir=ipc_dir,
            _make_handle=lambda ipc_dir, gen: RemoteCore(ipc_dir, gen, client_index),
            **kwargs,
        )

    def _start_all(self) -> None:
        """Starts every replica at once (their models load in parallel); any failure stops them all."""
        reps = self._replicas
        if len(reps) == 1:
            self._start_replica(reps[0])
            return
        for r in reps:
            os.makedirs(r.ipc_dir, mode=0o700, exist_ok=True)
        try:
            for r in reps:  # from this thread: its core processes live as long as it does
                r.launch()
            with ThreadPoolExecutor(len(reps)) as pool:
                futures = [pool.submit(self._wait_replica, r) for r in reps]
                errors = [f.exception() for f in futures]
        except BaseException:
            for r in reps:
                r.stop(5)
            raise
        failed = [(i, e) for i, e in enumerate(errors) if e is not None]
        if failed:
            for r in reps:
                r.stop(5)
            i, exc = failed[0]
            raise EngineStartupError(f"data-parallel replica {i}: {exc}") from exc

    def _start_replica(self, replica: CoreReplica) -> None:
        replica.launch()
        self._wait_replica(replica)

    def _wait_replica(self, replica: CoreReplica) -> None:
        ready = replica.wait_ready(_READY_TIMEOUT_S)
        logger.info(
            "engine core %d ready: %s, %d KV blocks", replica.index, ready.model_name, ready.num_blocks
        )

    # ------------------------------------------------------------------ state
    @property
    def ready(self) -> Any:
        """The Ready of the first core (every replica runs the same model)."""
        return self._replicas[0].ready

    @property
    def num_replicas(self) -> int:
        return len(self._replicas)

    @property
    def is_running(self) -> bool:
        return self._started and not self._closing and any(r.serving for r in self._replicas)

    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    @property
    def dead_error(self) -> BaseException | None:
        """Why no core serves (None while one does)."""
        dead = [r.dead for r in self._replicas]
        return None if any(d is None for d in dead) else dead[0]

    @property
    def is_healthy(self) -> bool:
        return self.dead_error is None and self.is_running and not self._draining

    @property
    def num_restarts(self) -> int:
        return sum(r.num_restarts for r in self._replicas)

    @property
    def num_inflight(self) -> int:
        return self._num_inflight

    @property
    def core_pid(self) -> int | None:
        return self._replicas[0].pid

    @property
    def core_pids(self) -> list[int | None]:
        return [r.pid for r in self._replicas]

    def replica_states(self) -> list[dict[str, Any]]:
        """Each core: its index, state (up | restarting | down | stopped), pid, restarts, requests in flight."""
        inflight = [0] * len(self._replicas)
        for idx in self._owner.values():
            inflight[idx] += 1
        return [
            {
                "index": r.index,
                "state": r.state(),
                "pid": r.pid,
                "restarts": r.num_restarts,
                "num_requests": inflight[r.index],
            }
            for r in self._replicas
        ]

    def get_stats(self) -> EngineStats | None:
        """The engine stats as of the latest step message (summed over the replicas)."""
        return sum_stats([r.stats for r in self._replicas])

    def get_replica_stats(self) -> list[EngineStats | None]:
        """Each replica's stats as of its latest step message."""
        return [r.stats for r in self._replicas]

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def set_observer(self, observer: StepObserver | None) -> None:
        self.observer = observer
        self.output_processor.observer = observer

    def add_restart_listener(self, fn: Callable[[], None]) -> None:
        """Called (on the event loop) after a core was restarted and serves again."""
        self._restart_listeners.append(fn)

    # -------------------------------------------------------------- lifecycle
    def start(self) -> None:
        if self._started:
            return
        self._started = True
        for r in self._replicas:
            r.connect()
            self._tasks.append(asyncio.create_task(self._monitor(r), name=f"pagedrs-core-monitor-{r.index}"))

    def begin_drain(self) -> None:
        """Stops accepting new requests; in-flight ones go on."""
        self._draining = True

    async def drain(self, timeout: float) -> bool:
        """Waits up to ``timeout`` s for in-flight requests; True when all finished."""
        self.begin_drain()
        deadline = time.monotonic() + timeout
        while self._num_inflight > 0 and time.monotonic() < deadline and not self.errored:
            await asyncio.sleep(0.05)
        return self._num_inflight == 0

    def shutdown(self, timeout: float = 10.0) -> None:
        """Aborts what is left, stops the cores (their processes exit; a supervised core is left to its
        supervisor) and closes the channels."""
        if self._closing:
            return
        self._draining = self._closing = True
        for t in self._tasks:
            t.cancel()
        self._fail_all(RequestAbortedError("server shut down"))
        if len(self._replicas) == 1:
            self._replicas[0].stop(timeout)
        else:
            with ThreadPoolExecutor(len(self._replicas)) as pool:
                list(pool.map(lambda r: r.stop(timeout), self._replicas))
        if self._owns_ipc_dir:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)

    # --------------------------------------------------------------- requests
    @overload
    async def add_request(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams,
        *,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream[RequestOutput]: ...
    @overload
    async def add_request(
        self,
        request_id: str,
        prompt: Any,
        params: PoolingParams,
        *,
        priority: int = 0,
        lora_request: LoRARequest | None = None,  # refused: embeddings run the base model
    ) -> RequestStream[EmbeddingRequestOutput]: ...
    async def add_request(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams | PoolingParams,
        *,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream[Any]:
        """Submits a request (with `lora_request`: under that adapter, carried to the core in the
        request message); raises InputError (a ValueError) for invalid input, EngineDeadError while no
        core serves, EngineDrainingError while shutting down."""
        dead = self.dead_error
        if dead is not None:
            raise EngineDeadError(f"the engine core is not running: {dead}")
        if self._draining:
            raise EngineDrainingError("server is shutting down")
        if not self.is_running:
            raise EngineDeadError("the engine core is not running")
        request_id = str(request_id)
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if lora_request is not None and isinstance(params, PoolingParams):
            raise InputError("embedding requests run the base model, not a LoRA adapter", "model")
        text, req = self.input_processor.process(
            request_id,
            prompt,
            params,
            priority=priority,
            client_index=self.client_index,
            lora_request=lora_request,
        )
        replica = self._route(request_id, req)
        if isinstance(params, PoolingParams):
            self.output_processor.add_pooling_request(request_id, text, req.prompt_token_ids)
            kind = RequestOutputKind.FINAL_ONLY
        else:
            self.output_processor.add_request(
                request_id, text, req.prompt_token_ids, params, req.arrival_time
            )
            kind = params.output_kind
        stream: RequestStream[Any] = RequestStream(request_id, self, kind)
        self._streams[request_id] = stream
        self._owner[request_id] = replica
        self._num_inflight += 1
        self._replicas[replica].client.send(req)
        return stream

    def _route(self, request_id: str, req: Any) -> int:
        """The replica of a request (0 without data parallelism)."""
        if self.router is None:
            return 0
        hashes = core_request_block_hashes(req, self.router.block_size) if self.routing == "cache" else []
        try:
            return self.router.route(request_id, hashes, len(req.prompt_token_ids), session_key.get())
        except NoReplicaAvailable as exc:
            raise EngineDeadError(str(exc)) from None

    async def encode(self, request_id: str, prompt: Any, params: PoolingParams) -> EmbeddingRequestOutput:
        """The embedding of one prompt (an embedding request: no tokens are generated)."""
        stream = await self.add_request(request_id, prompt, params)
        try:
            async for out in stream:
                if out.finished:
                    return out
            raise RequestAbortedError(f"request {request_id} was aborted")
        finally:
            self.release(stream)

    def release(self, stream: RequestStream[Any]) -> None:
        """Called once by the consumer when it is done with a stream (aborts if unfinished)."""
        stream.abort()
        self._num_inflight -= 1

    async def generate(
        self, request_id: str, prompt: Any, params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Yields the request's outputs (as `params.output_kind` asks); aborts it if the consumer stops."""
        stream = await self.add_request(request_id, prompt, params)
        try:
            async for out in stream:
                yield out
        finally:
            self.release(stream)

    def abort(self, request_id: str) -> None:
        """Aborts a request in flight; the core frees its blocks before its next step."""
        stream = self._streams.get(request_id)
        if stream is not None:
            self._abort(stream)

    def _abort_stream(self, stream: RequestStream[Any]) -> None:
        # Names the stream: a rejected duplicate id must not abort the request that owns the id.
        if self._streams.get(stream.request_id) is stream:
            self._abort(stream)

    def _abort(self, stream: RequestStream[Any]) -> None:
        rid = stream.request_id
        del self._streams[rid]
        self.output_processor.abort_requests([rid])
        stream._fail(RequestAbortedError(f"request {rid} aborted"))
        self._send_abort(rid)

    def _send_abort(self, rid: str) -> None:
        replica = self._forget(rid)
        if replica is not None:
            self._replicas[replica].client.send(AbortRequests([rid]))

    def _forget(self, rid: str, num_generated: int = 0) -> int | None:
        """The request's replica, no longer its owner (the router told it is done)."""
        replica = self._owner.pop(rid, None)
        if replica is not None and self.router is not None:
            self.router.finish(rid, num_generated)
        return replica

    async def call_utility(self, method: str, *args: Any, timeout: float = 60.0) -> Any:
        """Run one of the core's utility methods (get_stats, resize, reset_prefix_cache, ping); with
        several replicas, on every one that serves: the first one's answer (for a bool, all of them)."""
        dead = self.dead_error
        if dead is not None or not self.is_running:
            raise EngineDeadError(f"the engine core is not running: {dead}")
        live = [r for r in self._replicas if r.serving]
        results = await asyncio.gather(*(r.client.call(method, list(args), timeout) for r in live))
        if all(isinstance(x, bool) for x in results):
            return all(results)
        return results[0]

    # ------------------------------------------------------------ outputs
    def _on_outputs(self, replica: int, msg: EngineCoreOutputs, received_at: float) -> None:
        try:
            self._process(replica, msg)
        except Exception as exc:  # a frontend bug fails these requests, not the loop
            logger.exception("processing a step message failed")
            self._fail_requests({o.request_id for o in msg.outputs}, exc)
        if self.observer is not None:
            self.observer.on_step(msg.stats, time.perf_counter() - received_at)

    def _process(self, replica: int, msg: EngineCoreOutputs) -> None:
        self._replicas[replica].stats = msg.stats
        if self.router is not None and msg.kv_events is not None:
            self.router.apply_events(replica, msg.kv_events)
        processed = self.output_processor.process_outputs(msg)
        for rid, error in processed.errors.items():
            self._forget(rid)
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream._fail(ValueError(error))
        for out in processed.outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream._put(out)
            if out.finished:
                del self._streams[out.request_id]
                num = sum(len(c.token_ids) for c in getattr(out, "outputs", ()) if hasattr(c, "token_ids"))
                self._forget(out.request_id, num)
        if processed.abort_seqs:  # stop strings found here: the core stops those samples
            self._replicas[replica].client.send(AbortRequests([], processed.abort_seqs))

    # ------------------------------------------------------------ faults
    async def _monitor(self, replica: CoreReplica) -> None:
        while not self._closing:
            await asyncio.sleep(_MONITOR_INTERVAL_S)
            handle = replica.handle
            if self._closing or handle is None or handle.alive() or replica.dead is not None:
                continue
            why = handle.exit_description()
            if self.router is not None:
                why = f"data-parallel replica {replica.index}: {why}"
                self.router.set_available(replica.index, False)
            mine = {rid for rid, idx in self._owner.items() if idx == replica.index}
            logger.error("%s; failing %d in-flight requests", why, len(mine))
            replica.dead = EngineCoreDiedError(why)
            replica.disconnect()
            self._fail_requests(mine, EngineCoreDiedError(f"{why} while the request was running"))
            replica.client.fail_calls(EngineDeadError(why))
            await self._restart(replica)

    async def _restart(self, replica: CoreReplica) -> None:
        while replica.dead is not None and not self._closing and replica.num_restarts < self.max_restarts:
            replica.num_restarts += 1
            replica.gen += 1
            replica.restarting = True
            logger.warning(
                "restarting engine core %d (%d/%d)", replica.index, replica.num_restarts, self.max_restarts
            )
            try:
                await asyncio.to_thread(self._start_replica, replica)
            except Exception as exc:  # counted; tried again or given up
                logger.error("engine core %d restart failed: %s", replica.index, exc)
                continue
            finally:
                replica.restarting = False
            if self._closing:
                replica.stop(5)
                return
            replica.connect()
            replica.dead = None
            replica.stats = None
            if self.router is not None:
                self.router.apply_events(replica.index, KVCacheEvents(cleared=True))
                self.router.set_available(replica.index, True)
            for fn in self._restart_listeners:
                fn()
        if replica.dead is not None:
            logger.error("engine core %d is down and out of restarts (%d)", replica.index, self.max_restarts)

    def _fail_requests(self, request_ids: set[str], exc: BaseException) -> None:
        for rid in request_ids:
            stream = self._streams.pop(rid, None)
            if stream is not None:
                self.output_processor.abort_requests([rid])
                stream._fail(exc)
            self._send_abort(rid)

    def _fail_all(self, exc: BaseException) -> None:
        streams, self._streams = self._streams, {}
        self.output_processor.abort_requests(list(streams))
        for rid in list(self._owner):
            self._forget(rid)
        for stream in streams.values():
            stream._fail(exc)
        for r in self._replicas:
            r.client.fail_calls(EngineDeadError(str(exc)))


def _replica_dir(ipc_dir: str, index: int) -> str:
    return os.path.join(ipc_dir, f"dp{index}")


def _maker(backend: str, engine_args: Any) -> Callable[[str, int], CoreHandle]:
    return lambda ipc_dir, gen: make_core_handle(backend, engine_args, ipc_dir, gen)
