"""CoreClient: the frontend's end of the channel to one engine core. It owns the two sockets (a PUSH for
requests, aborts and utility calls; the PULL that read the core's Ready), msgspec encoding and decoding,
the task that reads the core's one-message-per-step outputs, and the futures of utility calls. What the
messages mean (streams, detokenization) is the caller's: each step message goes to `on_outputs`.

After a core restart the caller connects the same client to the new core (`connect` again)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from pagedrs.engine.core.messages import EngineCoreOutputs, UtilityCall, UtilityResult, output_decoder

__all__ = ["CoreClient"]

logger = logging.getLogger("pagedrs.core_client")


class CoreClient:
    """`on_outputs(msg, received_at)` is called on the event loop for every step message, with the
    `time.perf_counter()` at which it was received."""

    def __init__(self, client_index: int, on_outputs: Callable[[EngineCoreOutputs, float], None]) -> None:
        self.client_index = client_index
        self._on_outputs = on_outputs
        self._ctx: zmq.asyncio.Context | None = None
        self._in_sock: Any = None
        self._out_sock: Any = None
        self._ready_sock: Any = None
        self._output_task: asyncio.Task[None] | None = None
        self._encoder = msgspec.msgpack.Encoder()
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count()

    @property
    def connected(self) -> bool:
        return self._in_sock is not None

    def connect(self, input_addr: str, ready_sock: Any) -> None:
        """Starts reading from `ready_sock` (the socket that read the core's Ready: it goes on reading, since
        a second socket on the same address would be a second PUSH peer of the core's round robin) and
        sending to `input_addr`. Call on the event loop."""
        self.disconnect()
        self._ctx = self._ctx or zmq.asyncio.Context()
        self._in_sock = self._ctx.socket(zmq.PUSH)
        self._in_sock.setsockopt(zmq.LINGER, 0)
        self._in_sock.connect(input_addr)
        self._ready_sock = ready_sock
        self._out_sock = zmq.asyncio.Socket.shadow(ready_sock.underlying)
        self._output_task = asyncio.create_task(self._output_loop(), name="pagedrs-outputs")

    def disconnect(self) -> None:
        """Stops the output task and closes both sockets (calls in flight stay pending: see `fail_calls`)."""
        if self._output_task is not None:
            self._output_task.cancel()
            self._output_task = None
        for s in (self._in_sock, self._out_sock, self._ready_sock):
            if s is not None:
                s.close(linger=0)
        self._in_sock = self._out_sock = self._ready_sock = None

    def send(self, msg: Any) -> None:
        """Sends one message to the core; dropped when not connected (the core is down: its requests
        have already been failed)."""
        if self._in_sock is None:
            return
        data = self._encoder.encode(msg)
        try:  # PUSH to a connected peer does not block below the high-water mark
            self._in_sock.send(data, flags=zmq.NOBLOCK)
        except zmq.Again:
            fut = self._in_sock.send(data)
            fut.add_done_callback(lambda f: f.exception())

    async def call(self, method: str, args: list[Any], timeout: float) -> Any:
        """Runs one of the core's utility methods; its error comes back as a ValueError."""
        call_id = next(self._call_ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        self.send(UtilityCall(call_id, method, list(args), self.client_index))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._calls.pop(call_id, None)

    def fail_calls(self, exc: BaseException) -> None:
        """Fails every utility call still waiting for its answer (the core that would answer is gone)."""
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(exc)

    async def _output_loop(self) -> None:
        decoder = output_decoder()
        sock = self._out_sock
        while True:
            raw = await sock.recv(copy=False)
            received_at = time.perf_counter()
            try:
                msg = decoder.decode(raw.buffer)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                logger.warning("dropped a malformed message from the core: %s", exc)
                continue
            if isinstance(msg, EngineCoreOutputs):
                self._on_outputs(msg, received_at)
            elif isinstance(msg, UtilityResult):
                fut = self._calls.get(msg.call_id)
                if fut is not None and not fut.done():
                    if msg.error is None:
                        fut.set_result(msg.result)
                    else:
                        fut.set_exception(ValueError(msg.error))
