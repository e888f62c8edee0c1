"""AsyncLLMEngine: the LLMEngine stepping in its own thread, one asyncio queue per request.

The event loop never calls into the engine: it sends commands (add, abort) through a
thread-safe queue, and the engine thread feeds each request's asyncio queue through
``loop.call_soon_threadsafe``. Engine state the server reads (stats) is a snapshot the engine
thread publishes after every step, so no other thread touches the scheduler.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

logger = logging.getLogger("pagedrs.async_engine")

_FINISHED = object()  # end-of-stream marker put after the last output


def _consume_exception(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()


class EngineDeadError(RuntimeError):
    """The engine thread failed; every request is errored and no new one is accepted."""


class EngineDrainingError(RuntimeError):
    """The server is shutting down and accepts no new requests."""


class RequestAbortedError(RuntimeError):
    """The request was aborted before it finished."""


class RequestObserver(Protocol):
    """Receives per-request timings from the engine thread (e.g. Prometheus histograms)."""

    def on_first_token(self, ttft_s: float) -> None: ...
    def on_tokens(self, itl_s: float, num_tokens: int) -> None: ...
    def on_finished(self, reason: str, e2e_s: float) -> None: ...


@dataclass
class _Tracker:
    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    num_tokens: int = 0


class RequestStream:
    """Outputs of one request, in order; iterate with ``async for``."""

    def __init__(self, request_id: str, engine: AsyncLLMEngine) -> None:
        self.request_id = request_id
        self.finished = False
        self._engine = engine
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._accepted: asyncio.Future[None] = self._loop.create_future()

    # -- called from the engine thread --
    def _call(self, fn: Callable[..., None], *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # loop already closed
            self._loop.call_soon_threadsafe(fn, *args)

    def _put(self, item: Any) -> None:
        self._call(self._queue.put_nowait, item)

    def _set_accepted(self, exc: BaseException | None) -> None:
        def done() -> None:
            if self._accepted.done():
                return
            if exc is None:
                self._accepted.set_result(None)
            else:
                self._accepted.set_exception(exc)

        self._call(done)

    # -- event loop side --
    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Any:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is _FINISHED:
            self.finished = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if getattr(item, "finished", False):
            self.finished = True
        return item

    def abort(self) -> None:
        """Aborts the request unless it already finished (idempotent)."""
        if not self.finished:
            self.finished = True
            self._engine._abort_stream(self)


@dataclass
class _Command:
    kind: str  # "add" | "abort" | "stop"
    request_id: str = ""
    stream: RequestStream | None = None
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


class AsyncLLMEngine:
    """Wraps an ``LLMEngine``; ``start()`` must be called from the serving event loop."""

    def __init__(self, engine: Any, *, observer: RequestObserver | None = None) -> None:
        self.engine = engine
        self.observer = observer
        self.max_model_len: int = int(engine.max_model_len)
        self.model_name: str = str(getattr(engine, "model_name", "default"))
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # engine-thread only
        self._trackers: dict[str, _Tracker] = {}  # engine-thread only
        self._num_inflight = 0  # event-loop only
        self._thread: threading.Thread | None = None
        self._closed = False  # set by the engine thread as it exits; guarded by _cmd_lock
        self._cmd_lock = threading.Lock()
        self._dead: BaseException | None = None
        self._draining = False
        self._stats: Any = None

    @classmethod
    def from_engine_args(cls, engine_args: Any, **kwargs: Any) -> AsyncLLMEngine:
        from pagedrs import LLMEngine

        return cls(LLMEngine.from_engine_args(engine_args), **kwargs)

    # ------------------------------------------------------------------ state
    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

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

    def get_stats(self) -> Any:
        """The engine stats as of the latest step (a snapshot; never touches the engine)."""
        return self._stats

    def get_tokenizer(self) -> Any:
        return self.engine.get_tokenizer()

    # -------------------------------------------------------------- lifecycle
    def start(self) -> None:
        if self._thread is not None:
            return
        self._refresh_stats()
        self._thread = threading.Thread(target=self._run, name="pagedrs-engine", daemon=True)
        self._thread.start()

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
        """Aborts what is left and joins the engine thread."""
        self._draining = True
        if self._thread is None:
            return
        self._commands.put(_Command("stop"))
        self._thread.join(timeout)
        self._thread = None

    # --------------------------------------------------------------- requests
    async def add_request(
        self, request_id: str, prompt: Any, params: Any, *, priority: int = 0
    ) -> RequestStream:
        """Submits a request; raises ValueError for invalid input (from the engine),
        EngineDeadError after a fault, EngineDrainingError while shutting down."""
        if self._dead is not None:
            raise EngineDeadError(f"engine failed: {self._dead!r}")
        if self._draining:
            raise EngineDrainingError("server is shutting down")
        if not self.is_running:
            raise EngineDeadError("engine is not running")
        stream = RequestStream(request_id, self)
        self._num_inflight += 1
        try:
            with self._cmd_lock:
                if self._closed:
                    raise EngineDeadError(f"engine is not running: {self._dead!r}")
                self._commands.put(
                    _Command(
                        "add",
                        request_id,
                        stream,
                        (prompt, params),
                        {"arrival_time": time.time(), "priority": priority},
                    )
                )
            await stream._accepted
        except BaseException:
            # cancelled while waiting (client gone) or rejected: the engine must not keep it.
            stream._accepted.add_done_callback(_consume_exception)
            stream.abort()
            self._num_inflight -= 1
            raise
        return stream

    def release(self, stream: RequestStream) -> None:
        """Called once by the consumer when it is done with a stream (aborts if unfinished)."""
        stream.abort()
        self._num_inflight -= 1

    async def generate(self, request_id: str, prompt: Any, params: Any) -> AsyncIterator[Any]:
        """Yields the request's cumulative outputs; aborts it if the consumer stops early."""
        stream = await self.add_request(request_id, prompt, params)
        try:
            async for out in stream:
                yield out
        finally:
            self.release(stream)

    def abort(self, request_id: str) -> None:
        """Thread-safe; the engine frees the request's blocks before its next step."""
        self._commands.put(_Command("abort", request_id))

    def _abort_stream(self, stream: RequestStream) -> None:
        # Names the stream: a rejected duplicate id must not abort the request that owns the id.
        self._commands.put(_Command("abort", stream.request_id, stream))

    # ------------------------------------------------------------ engine thread
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                busy = engine.has_unfinished_requests()
                if not self._handle_commands(block=not busy):
                    break
                if not engine.has_unfinished_requests():
                    continue
                outputs = engine.step()  # the engine logs its own periodic stats line
                now = time.time()
                for out in outputs:
                    self._dispatch(out, now)
                self._refresh_stats()
        except BaseException as exc:  # noqa: BLE001 - any engine failure is fatal to the engine
            logger.exception("engine thread failed")
            self._dead = exc
            self._abort_all(EngineDeadError(f"engine failed: {exc!r}"))
            self._reject_pending(EngineDeadError(f"engine failed: {exc!r}"))
            return
        self._abort_all(RequestAbortedError("server shut down"))
        self._reject_pending(EngineDrainingError("server is shutting down"))

    def _handle_commands(self, block: bool) -> bool:
        """Applies queued commands; returns False on stop."""
        changed = False
        try:
            while True:
                try:
                    cmd = self._commands.get(timeout=1.0) if block else self._commands.get_nowait()
                except queue.Empty:
                    return True
                block = False
                if cmd.kind == "stop":
                    return False
                changed = True
                if cmd.kind == "add":
                    self._apply_add(cmd)
                elif cmd.kind == "abort":
                    self._apply_abort(cmd.request_id, cmd.stream)
        finally:
            if changed:  # queues and blocks changed: publish before the (long) next step
                self._refresh_stats()

    def _apply_add(self, cmd: _Command) -> None:
        stream = cmd.stream
        assert stream is not None  # INVARIANT: add commands always carry their stream
        if stream.finished:  # aborted before the engine saw it
            return
        try:
            self.engine.add_request(cmd.request_id, *cmd.args, **cmd.kwargs)
        except Exception as exc:  # noqa: BLE001 - rejected input belongs to this request only
            stream._set_accepted(exc)
            return
        self._streams[cmd.request_id] = stream
        self._trackers[cmd.request_id] = _Tracker(arrival=cmd.kwargs["arrival_time"])
        stream._set_accepted(None)

    def _apply_abort(self, request_id: str, only: RequestStream | None = None) -> None:
        stream = self._streams.get(request_id)
        if stream is None or (only is not None and stream is not only):
            return
        del self._streams[request_id]
        self.engine.abort_request(request_id)
        tracker = self._trackers.pop(request_id, None)
        if self.observer is not None and tracker is not None:
            self.observer.on_finished("abort", time.time() - tracker.arrival)
        stream._put(RequestAbortedError(f"request {request_id} aborted"))

    def _dispatch(self, out: Any, now: float) -> None:
        rid = out.request_id
        stream = self._streams.get(rid)
        if stream is None:
            return
        tracker = self._trackers.get(rid)
        if tracker is not None:
            self._observe(tracker, out, now)
        stream._put(out)
        if out.finished:
            self._streams.pop(rid, None)
            self._trackers.pop(rid, None)
            stream._put(_FINISHED)

    def _observe(self, tracker: _Tracker, out: Any, now: float) -> None:
        num_tokens = sum(len(c.token_ids) for c in out.outputs)
        new_tokens = num_tokens - tracker.num_tokens
        obs = self.observer
        if new_tokens > 0:
            if tracker.first_token is None:
                tracker.first_token = now
                if obs is not None:
                    obs.on_first_token(now - tracker.arrival)
            elif obs is not None and tracker.last_token is not None:
                per_seq = max(1, len(out.outputs))
                obs.on_tokens((now - tracker.last_token), max(1, new_tokens // per_seq))
            tracker.last_token = now
            tracker.num_tokens = num_tokens
        if out.finished and obs is not None:
            reasons = [c.finish_reason for c in out.outputs if c.finish_reason]
            obs.on_finished(reasons[0] if reasons else "stop", now - tracker.arrival)

    def _refresh_stats(self) -> None:
        try:
            self._stats = self.engine.get_stats()
        except Exception:  # noqa: BLE001 - stats are best effort
            logger.debug("get_stats failed", exc_info=True)

    def _reject_pending(self, exc: BaseException) -> None:
        # Adds that raced with the end of the thread: reject them so no caller waits forever.
        with self._cmd_lock:
            self._closed = True
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if cmd.stream is not None:
                cmd.stream._set_accepted(exc)

    def _abort_all(self, exc: BaseException) -> None:
        for rid, stream in list(self._streams.items()):
            with contextlib.suppress(Exception):
                self.engine.abort_request(rid)
            stream._put(exc)
        self._streams.clear()
        self._trackers.clear()
        self._refresh_stats()
