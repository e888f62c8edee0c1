"""AsyncLLMEngine over the fake core (in a thread, behind the ZeroMQ channel): streams, merged deltas,
rejection, abort, a failed step, a dead core and its restart, drain."""

from __future__ import annotations

import asyncio

import pytest
from fake_engine import FakeEngine

from pagedrs import SamplingParams
from pagedrs.engine.async_engine import (
    AsyncLLMEngine,
    EngineCoreDiedError,
    EngineDeadError,
    EngineDrainingError,
)
from pagedrs.sampling_params import RequestOutputKind

DELTA = RequestOutputKind.DELTA


def _run(coro_fn):  # tiny helper
    return asyncio.run(coro_fn())


async def _wait(pred, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if pred():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not met in time")


def test_outputs_rejection_and_duplicate_id() -> None:
    async def main() -> None:
        eng = AsyncLLMEngine(FakeEngine(step_delay=0.001))
        eng.start()
        try:
            outs = [o async for o in eng.generate("a", [1, 2], SamplingParams(max_tokens=4))]
            assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4  # cumulative
            deltas = [
                o async for o in eng.generate("d", [1, 2], SamplingParams(max_tokens=6, output_kind=DELTA))
            ]
            ids = [t for o in deltas for t in o.outputs[0].token_ids]
            assert ids == outs[-1].outputs[0].token_ids + [ord("g"), ord("h")]
            assert "".join(o.outputs[0].text for o in deltas) == bytes(ids).decode()
            keep = await eng.add_request("dup", [1], SamplingParams(max_tokens=50))
            with pytest.raises(ValueError, match="already in use"):
                await eng.add_request("dup", [1], SamplingParams(max_tokens=2))
            with pytest.raises(ValueError, match="empty"):
                await eng.add_request("e", [], SamplingParams())
            got = [o async for o in keep]  # the first "dup" was not aborted by the rejected one
            assert got[-1].finished and len(got[-1].outputs[0].token_ids) == 50
            eng.release(keep)
            assert eng.num_inflight == 0
        finally:
            eng.shutdown()

    _run(main)


def test_slow_reader_gets_merged_deltas() -> None:
    async def main() -> None:
        eng = AsyncLLMEngine(FakeEngine(step_delay=0.001))
        eng.start()
        try:
            stream = await eng.add_request("s", [3], SamplingParams(max_tokens=40, output_kind=DELTA))
            await _wait(lambda: stream._pending is not None and stream._pending.finished)
            reads = [o async for o in stream]  # the reader never read while the request ran
            eng.release(stream)
            assert len(reads) == 1 and reads[0].finished
            assert len(reads[0].outputs[0].token_ids) == 40 and len(reads[0].outputs[0].text) == 40
        finally:
            eng.shutdown()

    _run(main)


def test_early_exit_aborts_and_frees() -> None:
    async def main() -> None:
        fake = FakeEngine(step_delay=0.002)
        eng = AsyncLLMEngine(fake)
        eng.start()
        try:
            async for out in eng.generate("x", [5], SamplingParams(max_tokens=100)):
                if len(out.outputs[0].token_ids) >= 3:
                    break
            await _wait(lambda: not fake.requests and eng.get_stats().num_running == 0)
            assert eng.num_inflight == 0
        finally:
            eng.shutdown()

    _run(main)


def test_failed_step_fails_its_requests_and_keeps_serving() -> None:
    async def main() -> None:
        fake = FakeEngine(step_delay=0.002)
        eng = AsyncLLMEngine(fake)
        eng.start()
        try:
            stream = await eng.add_request("r", [1], SamplingParams(max_tokens=100))
            fake.fail_next_step = RuntimeError("boom")
            with pytest.raises(ValueError, match="boom"):
                async for _ in stream:
                    pass
            eng.release(stream)
            assert eng.is_healthy
            outs = [o async for o in eng.generate("after", [1], SamplingParams(max_tokens=3))]
            assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3
        finally:
            eng.shutdown()

    _run(main)


def test_dead_core_fails_in_flight_then_restarts() -> None:
    async def main() -> None:
        fake = FakeEngine(step_delay=0.002)
        eng = AsyncLLMEngine(fake, max_restarts=1)
        eng.start()
        try:
            stream = await eng.add_request("r", [1], SamplingParams(max_tokens=120))
            fake.die_next_step = RuntimeError("crash")
            with pytest.raises(EngineCoreDiedError):
                async for _ in stream:
                    pass
            eng.release(stream)
            await _wait(lambda: eng.is_healthy)  # restarted
            assert eng.num_restarts == 1
            fake.requests.clear()  # the old core's state (a real restart starts from scratch)
            outs = [o async for o in eng.generate("after", [1], SamplingParams(max_tokens=3))]
            assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3
            fake.die_next_step = RuntimeError("again")  # out of restarts: stays down
            s2 = await eng.add_request("r2", [1], SamplingParams(max_tokens=120))
            with pytest.raises(EngineCoreDiedError):
                async for _ in s2:
                    pass
            eng.release(s2)
            await asyncio.sleep(0.5)
            assert eng.errored and not eng.is_healthy
            with pytest.raises(EngineDeadError):
                await eng.add_request("s", [1], SamplingParams())
        finally:
            eng.shutdown()

    _run(main)


def test_drain() -> None:
    async def main() -> None:
        eng = AsyncLLMEngine(FakeEngine(step_delay=0.002))
        eng.start()
        s2 = await eng.add_request("a", [1], SamplingParams(max_tokens=10))
        eng.begin_drain()
        with pytest.raises(EngineDrainingError):
            await eng.add_request("b", [1], SamplingParams())

        async def consume() -> None:
            async for _ in s2:
                pass
            eng.release(s2)

        task = asyncio.create_task(consume())
        assert await eng.drain(timeout=5)
        await task
        eng.shutdown()

    _run(main)
