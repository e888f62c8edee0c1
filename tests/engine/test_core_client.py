"""CoreClient against a stand-in core made of two bare ZeroMQ sockets: step messages reach `on_outputs`,
utility calls are answered by call_id (errors as ValueError), malformed frames are dropped without ending
the loop, and a core that goes away fails the calls still waiting."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from pagedrs.engine.client.core_client import CoreClient
from pagedrs.engine.core.messages import EngineCoreOutputs, UtilityCall, UtilityResult, input_decoder
from pagedrs.metrics import EngineStats


class StandInCore:
    """The core's ends of the channel: a PULL for the frontend's messages, a PUSH for its outputs."""

    def __init__(self, tmp: Path) -> None:
        ctx = zmq.Context.instance()
        self.input_addr, self.output_addr = f"ipc://{tmp}/in", f"ipc://{tmp}/out"
        self.pull = ctx.socket(zmq.PULL)
        self.pull.bind(self.input_addr)
        self.push = ctx.socket(zmq.PUSH)
        self.push.bind(self.output_addr)
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = input_decoder()

    def reader(self) -> zmq.Socket[bytes]:
        """The frontend's output socket, as `connect_ready` hands it over (a synchronous PULL)."""
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PULL)
        sock.connect(self.output_addr)
        return sock

    async def receive(self) -> Any:
        for _ in range(500):
            if self.pull.poll(0):
                return self.decoder.decode(self.pull.recv())
            await asyncio.sleep(0.01)
        raise AssertionError("nothing arrived from the client")

    def send(self, msg: Any) -> None:
        self.push.send(self.encoder.encode(msg))

    def close(self) -> None:
        self.pull.close(linger=0)
        self.push.close(linger=0)


async def _until(cond: Any) -> None:
    for _ in range(500):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


def test_outputs_calls_and_malformed_frames(tmp_path: Path) -> None:
    async def run() -> None:
        core = StandInCore(tmp_path)
        seen: list[EngineCoreOutputs] = []
        client = CoreClient(3, lambda msg, at: seen.append(msg))
        try:
            client.connect(core.input_addr, core.reader())
            assert client.connected
            core.push.send(b"\xc1 not msgpack")  # dropped, the loop goes on
            core.send(EngineCoreOutputs([], EngineStats(num_running=7), 1.0))
            await _until(lambda: len(seen) == 1)
            assert seen[0].stats.num_running == 7

            ok = asyncio.ensure_future(client.call("ping", [1, "x"], timeout=10))
            call = await core.receive()
            assert isinstance(call, UtilityCall)
            assert (call.method, call.args, call.client_index) == ("ping", [1, "x"], 3)
            core.send(UtilityResult(call.call_id, {"pong": True}))
            assert await ok == {"pong": True}

            bad = asyncio.ensure_future(client.call("resize", [0], timeout=10))
            call = await core.receive()
            core.send(UtilityResult(call.call_id, None, "no such size: 0"))
            with pytest.raises(ValueError, match="no such size: 0"):
                await bad
        finally:
            client.disconnect()
            core.close()
        assert not client.connected

    asyncio.run(run())


def test_waiting_calls_fail_when_the_core_is_gone(tmp_path: Path) -> None:
    async def run() -> None:
        core = StandInCore(tmp_path)
        client = CoreClient(0, lambda msg, at: None)
        try:
            client.connect(core.input_addr, core.reader())
            pending = asyncio.ensure_future(client.call("get_stats", [], timeout=30))
            await core.receive()  # asked, never answered
            client.fail_calls(RuntimeError("core died"))
            with pytest.raises(RuntimeError, match="core died"):
                await pending
            client.disconnect()
            client.send(UtilityCall(0, "ping"))  # dropped: nothing to send to
        finally:
            client.disconnect()
            core.close()

    asyncio.run(run())
