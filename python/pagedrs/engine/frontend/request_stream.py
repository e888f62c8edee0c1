"""What the server's frontend hands out for a request: `RequestStream` (its outputs in order, deltas
merged for a slow reader) and the errors a request or the engine may end with."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Generic, Protocol, TypeVar

from pagedrs.engine.frontend.output_processor import RequestObserver
from pagedrs.metrics import EngineStats
from pagedrs.outputs import EmbeddingRequestOutput, RequestOutput
from pagedrs.sampling_params import RequestOutputKind

__all__ = [
    "EngineCoreDiedError",
    "EngineDeadError",
    "EngineDrainingError",
    "RequestAbortedError",
    "RequestStream",
    "StepObserver",
    "merge_delta",
]


class _Aborter(Protocol):
    def _abort_stream(self, stream: RequestStream[Any]) -> None: ...


class EngineDeadError(RuntimeError):
    """The engine core is not running (failed, restarting, or out of restarts); no request is accepted."""


class EngineCoreDiedError(EngineDeadError):
    """The engine core process died while this request was in flight."""


class EngineDrainingError(RuntimeError):
    """The server is shutting down and accepts no new requests."""


class RequestAbortedError(RuntimeError):
    """The request was aborted before it finished."""


class StepObserver(RequestObserver, Protocol):
    """Also told of each step message, with the core (data-parallel replica) that sent it, and where each
    request was routed."""

    def on_step(self, stats: EngineStats, frontend_s: float, engine: int | None) -> None: ...
    def on_routed(self, index: int) -> None: ...


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

    def __init__(self, request_id: str, engine: _Aborter, kind: RequestOutputKind) -> None:
        self.request_id = request_id
        self.finished = False
        self.submitted_at = time.monotonic()  # when the frontend handed it to a core (stall checks)
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
