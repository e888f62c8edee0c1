"""AsyncLLMEngine: the server's frontend to an engine core that runs in its own process (or, for an engine
object handed in, in a thread behind the same channel).

The event loop never calls into the engine. Requests are validated and tokenized here (InputProcessor) and
sent through a `CoreClient` (ZeroMQ + msgspec); its task receives the core's one-message-per-step outputs,
and this engine runs the OutputProcessor (detokenization, stop strings) and feeds each request's `RequestStream`. A stream
whose reader is slow gets its deltas merged: the next read returns everything since the previous one.

A dead core process is detected: every in-flight request gets `EngineCoreDiedError`, the engine reports
unhealthy, and the core is restarted (at most `max_restarts` times) so that new requests are served.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Generic, Protocol, TypeVar, overload

from pagedrs.engine.core_client import CoreClient
from pagedrs.engine.core_handles import (
    CoreHandle,
    EngineStartupError,
    ProcessCore,
    RemoteCore,
    ThreadCore,
    connect_ready,
)
from pagedrs.engine.input_processor import InputError, InputProcessor
from pagedrs.engine.messages import AbortRequests, EngineCoreOutputs
from pagedrs.engine.output_processor import OutputProcessor, RequestObserver
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


class EngineDeadError(RuntimeError):
    """The engine core is not running (failed, restarting, or out of restarts); no request is accepted."""


class EngineCoreDiedError(EngineDeadError):
    """The engine core process died while this request was in flight."""


class EngineDrainingError(RuntimeError):
    """The server is shutting down and accepts no new requests."""


class RequestAbortedError(RuntimeError):
    """The request was aborted before it finished."""


class StepObserver(RequestObserver, Protocol):
    def on_step(self, stats: EngineStats, frontend_s: float) -> None: ...


def merge_delta(prev: RequestOutput, new: RequestOutput) -> RequestOutput:
    """`prev` followed by `new`, both delta outputs of one request (in place on `prev`)."""
    by_index = {c.index: c for c in prev.outputs}
    for c in new.outputs:
        old = by_index.get(c.index)
        if old is None:
            prev.outputs.append(c)
            by_index[c.index] = c
            continue
        old.text += c.text
        old.token_ids = old.token_ids + c.token_ids
        if old.logprobs is not None and c.logprobs is not None:
            old.logprobs = old.logprobs + c.logprobs
        old.cumulative_logprob = c.cumulative_logprob
        old.finish_reason, old.stop_reason = c.finish_reason, c.stop_reason
    prev.finished = new.finished
    prev.num_cached_tokens = new.num_cached_tokens
    return prev


OutT = TypeVar("OutT", RequestOutput, EmbeddingRequestOutput)


class RequestStream(Generic[OutT]):
    """Outputs of one request, in order; iterate with ``async for``. Delta outputs not yet read are merged
    into one, so a slow reader never has a backlog of per-token items."""

    def __init__(self, request_id: str, engine: AsyncLLMEngine, kind: RequestOutputKind) -> None:
        self.request_id = request_id
        self.finished = False
        self._engine = engine
        self._kind = kind
        self._pending: OutT | None = None
        self._error: BaseException | None = None
        self._event = asyncio.Event()

    def _put(self, out: OutT) -> None:
        pending = self._pending
        if (
            isinstance(pending, RequestOutput)
            and isinstance(out, RequestOutput)
            and self._kind == RequestOutputKind.DELTA
        ):
            merge_delta(pending, out)
        else:
            self._pending = out
        self._event.set()

    def _fail(self, exc: BaseException) -> None:
        self._error = exc
        self._event.set()

    def __aiter__(self) -> RequestStream[OutT]:
        return self

    async def __anext__(self) -> OutT:
        while True:
            if self._pending is not None:
                out, self._pending = self._pending, None
                if out.finished:
                    self.finished = True
                return out
            if self._error is not None:
                self.finished = True
                err, self._error = self._error, None
                raise err
            if self.finished:
                raise StopAsyncIteration
            self._event.clear()
            await self._event.wait()

    def abort(self) -> None:
        """Aborts the request unless it already finished (idempotent)."""
        if not self.finished:
            self.finished = True
            self._engine._abort_stream(self)


def _frontend_tokenizer(engine_args: Any) -> Any:
    """The tokenizer the frontend validates, tokenizes and detokenizes with (None: skip_tokenizer_init)."""
    if engine_args.skip_tokenizer_init:
        return None
    from pagedrs.loader import load_tokenizer

    return load_tokenizer(engine_args.model, engine_args.tokenizer, engine_args.load_options())


class AsyncLLMEngine:
    """`from_engine_args` runs the core in its own process; `AsyncLLMEngine(engine)` runs a given engine
    (an `LLMEngine`, an `EngineCore` or a stand-in with its methods) in a thread behind the same channel.
    `from_supervised_core` is one of several API server processes sharing a core that a supervisor runs.
    The core starts (and the model loads) in the constructor; `start()` must then be called from the
    serving event loop."""

    def __init__(
        self,
        engine: Any = None,
        *,
        observer: StepObserver | None = None,
        tokenizer: Any = None,
        max_restarts: int = 3,
        client_index: int = 0,
        ipc_dir: str | None = None,
        _make_handle: Callable[[str, int], CoreHandle] | None = None,
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
        self._make_handle = _make_handle
        self.tokenizer = tokenizer
        self._gen = 0
        self.num_restarts = 0
        self._ready_sock: Any = None  # the output socket that read Ready (kept: see _connect)
        self._handle = self._start_core()  # raises EngineStartupError
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
        self._streams: dict[str, RequestStream[Any]] = {}
        self._num_inflight = 0
        self._dead: BaseException | None = None
        self._draining = False
        self._closing = False
        self._started = False
        self._stats: EngineStats | None = None
        self._client = CoreClient(client_index, self._on_outputs)
        self._tasks: list[asyncio.Task[None]] = []
        self._restart_listeners: list[Callable[[], None]] = []

    @classmethod
    def from_engine_args(cls, engine_args: Any, **kwargs: Any) -> AsyncLLMEngine:
        """The core in its own process, loading the model there; the tokenizer is loaded here."""
        engine_args.early_configs()  # bad arguments fail here, before any process starts
        # A Hub name is fetched here, once: the tokenizer below and the core process read the local copy.
        engine_args = engine_args.with_local_model()
        return cls(
            tokenizer=_frontend_tokenizer(engine_args),
            _make_handle=lambda ipc_dir, gen: ProcessCore(engine_args, ipc_dir, gen),
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

    def _start_core(self) -> CoreHandle:
        handle = self._make_handle(self._ipc_dir, self._gen)
        handle.start()
        self._gen = max(self._gen, getattr(handle, "gen", self._gen))  # a supervisor may be ahead
        try:
            self.ready, self._ready_sock = connect_ready(handle, _READY_TIMEOUT_S, self.client_index)
        except BaseException:
            handle.stop(5)
            raise
        logger.info("engine core ready: %s, %d KV blocks", self.ready.model_name, self.ready.num_blocks)
        return handle

    # ------------------------------------------------------------------ state
    @property
    def is_running(self) -> bool:
        return self._started and not self._closing and self._handle.alive()

    @property
    def errored(self) -> bool:
        return self._dead is not None

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead

    @property
    def is_healthy(self) -> bool:
        return self._dead is None and self.is_running and not self._draining

    @property
    def num_inflight(self) -> int:
        return self._num_inflight

    @property
    def core_pid(self) -> int | None:
        return getattr(self._handle, "pid", None)

    def get_stats(self) -> EngineStats | None:
        """The engine stats as of the latest step message."""
        return self._stats

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def set_observer(self, observer: StepObserver | None) -> None:
        self.observer = observer
        self.output_processor.observer = observer

    def add_restart_listener(self, fn: Callable[[], None]) -> None:
        """Called (on the event loop) after the core was restarted and serves again."""
        self._restart_listeners.append(fn)

    # -------------------------------------------------------------- lifecycle
    def start(self) -> None:
        if self._started:
            return
        self._started = True
        self._connect()
        self._tasks.append(asyncio.create_task(self._monitor(), name="pagedrs-core-monitor"))

    def _connect(self) -> None:
        # The socket that read Ready goes on reading: one PULL peer per output address, ever.
        self._client.connect(self._handle.input_addr, self._ready_sock)
        self._ready_sock = None  # the client's now

    def _disconnect(self) -> None:
        self._client.disconnect()
        if self._ready_sock is not None:  # read Ready, never connected
            self._ready_sock.close(linger=0)
            self._ready_sock = None

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
        """Aborts what is left, stops the core (its process exits; a supervised core is left to its
        supervisor) and closes the channel."""
        if self._closing:
            return
        self._draining = self._closing = True
        for t in self._tasks:
            t.cancel()
        self._fail_all(RequestAbortedError("server shut down"))
        self._handle.stop(timeout)
        self._disconnect()
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
        request message); raises InputError (a ValueError) for invalid input, EngineDeadError while the
        core is down, EngineDrainingError while shutting down."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine core is not running: {self._dead}")
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
        self._num_inflight += 1
        self._send(req)
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
        self._send(AbortRequests([rid]))

    async def call_utility(self, method: str, *args: Any, timeout: float = 60.0) -> Any:
        """Run one of the core's utility methods (get_stats, resize, reset_prefix_cache, ping)."""
        if self._dead is not None or not self.is_running:
            raise EngineDeadError(f"the engine core is not running: {self._dead}")
        return await self._client.call(method, list(args), timeout)

    def _send(self, msg: Any) -> None:
        self._client.send(msg)

    # ------------------------------------------------------------ outputs
    def _on_outputs(self, msg: EngineCoreOutputs, received_at: float) -> None:
        try:
            self._process(msg)
        except Exception as exc:  # a frontend bug fails these requests, not the loop
            logger.exception("processing a step message failed")
            self._fail_requests({o.request_id for o in msg.outputs}, exc)
        if self.observer is not None:
            self.observer.on_step(msg.stats, time.perf_counter() - received_at)

    def _process(self, msg: EngineCoreOutputs) -> None:
        self._stats = msg.stats
        processed = self.output_processor.process_outputs(msg)
        for rid, error in processed.errors.items():
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
        if processed.abort_seqs:  # stop strings found here: the core stops those samples
            self._send(AbortRequests([], processed.abort_seqs))

    # ------------------------------------------------------------ faults
    async def _monitor(self) -> None:
        while not self._closing:
            await asyncio.sleep(_MONITOR_INTERVAL_S)
            if self._closing or self._handle.alive() or self._dead is not None:
                continue
            why = self._handle.exit_description()
            logger.error("%s; failing %d in-flight requests", why, len(self._streams))
            self._dead = EngineCoreDiedError(why)
            self._disconnect()
            self._fail_all(EngineCoreDiedError(f"{why} while the request was running"))
            while self._dead is not None and not self._closing and self.num_restarts < self.max_restarts:
                self.num_restarts += 1
                self._gen += 1
                logger.warning("restarting the engine core (%d/%d)", self.num_restarts, self.max_restarts)
                try:
                    self._handle = await asyncio.to_thread(self._start_core)
                except Exception as exc:  # counted; tried again or given up
                    logger.error("engine core restart failed: %s", exc)
                    continue
                if self._closing:
                    self._handle.stop(5)
                    return
                self._connect()
                self._dead = None
                for fn in self._restart_listeners:
                    fn()
            if self._dead is not None:
                logger.error("the engine core is down and out of restarts (%d)", self.max_restarts)

    def _fail_requests(self, request_ids: set[str], exc: BaseException) -> None:
        for rid in request_ids:
            stream = self._streams.pop(rid, None)
            if stream is not None:
                self.output_processor.abort_requests([rid])
                stream._fail(exc)
                self._send(AbortRequests([rid]))

    def _fail_all(self, exc: BaseException) -> None:
        streams, self._streams = self._streams, {}
        self.output_processor.abort_requests(list(streams))
        for stream in streams.values():
            stream._fail(exc)
        self._client.fail_calls(EngineDeadError(str(exc)))
