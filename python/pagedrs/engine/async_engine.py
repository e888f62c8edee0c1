"""AsyncLLMEngine: the server's frontend to an engine core that runs in its own process (or, for an engine
object handed in, in a thread behind the same channel).

The event loop never calls into the engine. Requests are validated and tokenized here (InputProcessor) and
sent through a `CoreClient` (ZeroMQ + msgspec); its task receives the core's one-message-per-step outputs,
and this engine runs the OutputProcessor (detokenization, stop strings) and feeds each request's `RequestStream`. A stream
whose reader is slow gets its deltas merged: the next read returns everything since the previous one.

A dead core process is detected: every in-flight request gets `EngineCoreDiedError`, the engine reports
unhealthy, and the core is restarted (at most `max_restarts` times) so that new requests are served.

With data parallelism (`data_parallel_size` N > 1) the engine holds N cores (`dp.client.CoreReplica`) and
a router (`dp.router.DPRouter`) that sends each request to one of them; a dead replica is restarted alone
and the engine stays healthy while one replica serves.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, overload

from pagedrs.engine.arg_utils import EngineArgs
from pagedrs.engine.client.core_handles import CoreHandle, EngineStartupError, RemoteCore, ThreadCore
from pagedrs.engine.core.messages import AbortRequests, EngineCoreOutputs
from pagedrs.engine.dp.client import NoReplicaAvailable, ReplicaSet, sum_stats
from pagedrs.engine.factory import core_makers
from pagedrs.engine.frontend.image_inputs import image_settings, image_settings_of
from pagedrs.engine.frontend.input_processor import InputError, InputProcessor
from pagedrs.engine.frontend.output_processor import OutputProcessor
from pagedrs.engine.frontend.request_stream import (
    EngineCoreDiedError,
    EngineDeadError,
    EngineDrainingError,
    RequestAbortedError,
    RequestStream,
    StepObserver,
)
from pagedrs.launch_config import LaunchConfig
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


def _frontend(config: LaunchConfig) -> dict[str, Any]:
    """What a frontend of `config`'s cores is built with: the tokenizer it validates, tokenizes and
    detokenizes with (None: skip_tokenizer_init), the image settings, the data-parallel routing."""
    from pagedrs.loader import load_tokenizer

    dp = config.data_parallel
    model, tok, load = config.model.model, config.model.tokenizer, config.load
    return {  # the tokenizer loads while the cores load the model
        "load_tokenizer": (lambda: load_tokenizer(model, tok, load)) if config.with_tokenizer else None,
        "inputs": image_settings(config),
        "routing": dp.routing,
        "session_affinity": dp.session_affinity,
        "router_tuning": dp.router_tuning,
    }


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
        router_tuning: dict[str, Any] | None = None,
        inputs: dict[str, Any] | None = None,
        load_tokenizer: Callable[[], Any] | None = None,
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
        self._cores = ReplicaSet(makers, self._ipc_dir, client_index, self._on_outputs, max_restarts)
        loaded = self._cores.start_all(load_tokenizer)  # raises EngineStartupError
        self.tokenizer = tokenizer = loaded if load_tokenizer is not None else tokenizer
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
            **(inputs if inputs is not None else image_settings_of(engine)),
        )
        self.embedding_size = ready.embedding_size
        self.output_processor = OutputProcessor(tokenizer, observer)
        self._cores.make_router(routing, ready.block_size, session_affinity, router_tuning)
        self.router = self._cores.router
        self._streams: dict[str, RequestStream[Any]] = {}
        self._stepped_at: dict[int, float] = {}  # replica -> when its last step message arrived
        # Seconds a core with requests may go without a step before it is killed and restarted as a dead
        # one (0: never; the server sets it from --engine-stall-restart-timeout).
        self.stall_restart_timeout = 0.0
        self._num_inflight = 0
        self._draining = False
        self._closing = False
        self._started = False
        self._tasks: list[asyncio.Task[None]] = []
        self._restart_listeners: list[Callable[[], None]] = []

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **kwargs: Any) -> AsyncLLMEngine:
        """`from_config` of the arguments' config. Bad arguments fail here, before any process starts; a
        Hub name is fetched here, once: the tokenizer and the core processes read the local copy."""
        return cls.from_config(engine_args.with_local_model().launch_config(), **kwargs)

    @classmethod
    def from_config(cls, config: LaunchConfig, **kwargs: Any) -> AsyncLLMEngine:
        """The core in its own process (`data_parallel.size` of them: each a replica, its own process or Ray
        actor: `factory.core_makers`), loading the model there; the tokenizer is loaded here."""
        return cls(_make_handle=core_makers(config), **_frontend(config), **kwargs)

    @classmethod
    def from_supervised_core(
        cls, config: LaunchConfig, ipc_dir: str, client_index: int, **kwargs: Any
    ) -> AsyncLLMEngine:
        """Client `client_index` of the core (with `data_parallel_size` M, of each of the M cores) that
        this process's parent supervises in `ipc_dir` (`--api-server-count N`): the parent starts and
        restarts the cores; this frontend follows them and routes its requests over all of them."""
        return cls(
            client_index=client_index,
            ipc_dir=ipc_dir,
            _make_handle=[lambda ipc_dir, gen: RemoteCore(ipc_dir, gen, client_index)]
            * config.data_parallel.size,
            **_frontend(config),
            **kwargs,
        )

    # ------------------------------------------------------------------ state
    @property
    def ready(self) -> Any:
        """The Ready of the first core (every replica runs the same model)."""
        return self._cores.replicas[0].ready

    @property
    def num_replicas(self) -> int:
        return len(self._cores.replicas)

    @property
    def is_running(self) -> bool:
        return self._started and not self._closing and self._cores.serving

    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    @property
    def dead_error(self) -> BaseException | None:
        """Why no core serves (None while one does)."""
        return self._cores.dead_error

    @property
    def is_healthy(self) -> bool:
        return self.dead_error is None and self.is_running and not self._draining

    def stalled(self, timeout: float) -> list[tuple[int, float, int]]:
        """(replica, seconds without a step, requests in flight) of each core that holds requests but has
        sent no step message for more than `timeout` seconds, counted from its last step message or from
        when its oldest request in flight was handed to it, whichever is later: a core that stopped
        stepping (a deadlock, a stuck grammar, a paused process) while its process is alive. A core
        steps, and sends a message, after every step; an idle core holds no requests."""
        now = time.monotonic()
        oldest: dict[int, float] = {}
        count: dict[int, int] = {}
        for rid, replica in self._cores.owner.items():
            stream = self._streams.get(rid)
            if stream is not None:
                count[replica] = count.get(replica, 0) + 1
                oldest[replica] = min(oldest.get(replica, now), stream.submitted_at)
        since = {r: now - max(t, self._stepped_at.get(r, 0.0)) for r, t in oldest.items()}
        return [(r, s, count[r]) for r, s in sorted(since.items()) if s > timeout]

    def _stall_reason(self, replica: int) -> str | None:
        """Why core `replica` is to be killed and restarted (None: it steps, or stall restarts are off)."""
        if self.stall_restart_timeout <= 0:
            return None
        for index, seconds, inflight in self.stalled(self.stall_restart_timeout):
            if index == replica:
                core = "the engine core" if self.num_replicas == 1 else f"engine core {replica}"
                return f"{core} stalled: no step for {seconds:.0f} s with {inflight} requests in flight"
        return None

    @property
    def stall_restarts(self) -> list[int]:
        """Per core: times it was killed (to be restarted) for not stepping with requests in flight."""
        return [r.num_stall_kills for r in self._cores.replicas]

    @property
    def num_restarts(self) -> int:
        return sum(r.num_restarts for r in self._cores.replicas)

    @property
    def num_inflight(self) -> int:
        return self._num_inflight

    @property
    def core_pid(self) -> int | None:
        return self._cores.replicas[0].pid

    @property
    def core_pids(self) -> list[int | None]:
        return [r.pid for r in self._cores.replicas]

    def replica_states(self) -> list[dict[str, Any]]:
        """Each core: its index, state (up | restarting | down | stopped), pid, restarts, requests in flight."""
        return self._cores.states()

    def replica_of(self, request_id: str) -> int | None:
        """The core a request in flight runs on."""
        return self._cores.owner.get(request_id)

    def get_stats(self) -> EngineStats | None:
        """The engine stats as of the latest step message (summed over the replicas)."""
        return sum_stats(self.get_replica_stats())

    def get_replica_stats(self) -> list[EngineStats | None]:
        """Each replica's stats as of its latest step message."""
        return [r.stats for r in self._cores.replicas]

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
        for r in self._cores.replicas:
            r.connect()
            watch = self._cores.watch(
                r, self._fail_requests, self._restarted, lambda: self._closing, self._stall_reason
            )
            self._tasks.append(asyncio.create_task(watch, name=f"pagedrs-core-monitor-{r.index}"))

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
        self._cores.stop_all(timeout)
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
        try:
            replica = self._cores.route(request_id, req)
        except NoReplicaAvailable as exc:
            raise EngineDeadError(str(exc)) from None
        if self.observer is not None and self.router is not None:
            self.observer.on_routed(replica)
        if isinstance(params, PoolingParams):
            self.output_processor.add_pooling_request(request_id, text, req.prompt_token_ids)
            kind = RequestOutputKind.FINAL_ONLY
        else:
            self.output_processor.add_request(
                request_id,
                text,
                req.prompt_token_ids,
                params,
                req.arrival_time,
                replica,
            )
            kind = params.output_kind
        stream: RequestStream[Any] = RequestStream(request_id, self, kind)
        self._streams[request_id] = stream
        self._num_inflight += 1
        self._cores.send(replica, req)
        return stream

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
        self._cores.abort(rid)

    async def call_utility(self, method: str, *args: Any, timeout: float = 60.0) -> Any:
        """Run one of the core's utility methods (get_stats, resize, reset_prefix_cache, ping); with
        several replicas, on every one that serves: the first one's answer (for a bool, all of them)."""
        dead = self.dead_error
        if dead is not None or not self.is_running:
            raise EngineDeadError(f"the engine core is not running: {dead}")
        return await self._cores.call(method, list(args), timeout)

    # ------------------------------------------------------------ outputs
    def _on_outputs(self, replica: int, msg: EngineCoreOutputs, received_at: float) -> None:
        self._stepped_at[replica] = time.monotonic()
        try:
            self._process(replica, msg)
        except Exception as exc:  # a frontend bug fails these requests, not the loop
            logger.exception("processing a step message failed")
            self._fail_requests({o.request_id for o in msg.outputs}, exc)
        if self.observer is not None:
            self.observer.on_step(msg.stats, time.perf_counter() - received_at, replica)

    def _process(self, replica: int, msg: EngineCoreOutputs) -> None:
        self._cores.observe(replica, msg)
        processed = self.output_processor.process_outputs(msg)
        for rid, error in processed.errors.items():
            self._cores.forget(rid)
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
                # an embedding request generates nothing; its `outputs` is one EmbeddingOutput
                num = sum(len(c.token_ids) for c in out.outputs) if isinstance(out, RequestOutput) else 0
                self._cores.forget(out.request_id, num)
        if processed.abort_seqs:  # stop strings found here: the core stops those samples
            self._cores.send(replica, AbortRequests([], processed.abort_seqs))

    # ------------------------------------------------------------ faults
    def _restarted(self) -> None:
        for fn in self._restart_listeners:
            fn()

    def _fail_requests(self, request_ids: set[str], exc: BaseException) -> None:
        for rid in request_ids:
            stream = self._streams.pop(rid, None)
            if stream is not None:
                self.output_processor.abort_requests([rid])
                stream._fail(exc)
            self._cores.abort(rid)

    def _fail_all(self, exc: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for rid in streams:
            self.output_processor.abort_requests([rid])
        for rid in list(self._cores.owner):
            self._cores.forget(rid)
        for stream in streams.values():
            stream._fail(exc)
        self._cores.fail_calls(EngineDeadError(str(exc)))
