"""Structured-output requests wait here, outside the scheduler, until their grammar is compiled (in a
background thread), so a slow compile stalls nobody else."""

from __future__ import annotations

import concurrent.futures
from concurrent.futures import Future
from typing import Any

from pagedrs.engine.core.messages import EngineCoreRequest
from pagedrs.structured_outputs import StructuredOutputManager, StructuredOutputsParams

__all__ = ["GrammarQueue", "compiled_grammar"]

_IDLE_WAIT_S = 0.05  # with nothing else to run, how long a step waits for a compile to finish


def compiled_grammar(fut: Future[Any]) -> Any:
    """The compiled grammar of a finished compile; ValueError if the constraint did not compile."""
    try:
        return fut.result()
    except Exception as exc:  # the constraint is the caller's: any compile error is a bad request
        raise ValueError(f"structured outputs: cannot compile the constraint: {exc}") from None


class GrammarQueue:
    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._manager: StructuredOutputManager | None = None
        self._waiting: dict[str, tuple[EngineCoreRequest, Future[Any]]] = {}

    @property
    def manager(self) -> StructuredOutputManager:
        if self._manager is None:
            self._manager = StructuredOutputManager(self._tokenizer, self._vocab_size)
        return self._manager

    def compile(self, params: StructuredOutputsParams) -> Future[Any]:
        return self.manager.compile(params)

    def park(self, req: EngineCoreRequest, fut: Future[Any]) -> None:
        self._waiting[req.request_id] = (req, fut)

    def drop(self, request_id: str) -> None:
        self._waiting.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._waiting

    def __len__(self) -> int:
        return len(self._waiting)

    def take_ready(self, idle: bool) -> list[tuple[EngineCoreRequest, Future[Any]]]:
        """The parked requests whose compile has finished (removed from the queue). `idle`: nothing else
        runs, so wait a little for one instead of spinning."""
        if idle and self._waiting:
            concurrent.futures.wait([f for _, f in self._waiting.values()], timeout=_IDLE_WAIT_S)
        ready = [(rid, rf) for rid, rf in self._waiting.items() if rf[1].done()]
        for rid, _ in ready:
            del self._waiting[rid]
        return [rf for _, rf in ready]
