"""AsyncLLMEngine over the fake engine: per-request queues, rejection, abort, fault, drain."""

from __future__ import annotations

import asyncio

import pytest
from fake_engine import FakeEngine

from pagedrs import SamplingParams
from pagedrs.engine.async_engine import AsyncLLMEngine, EngineDeadError, EngineDrainingError


def _run(coro_fn):  # noqa: ANN001, ANN202 - tiny helper
    return asyncio.run(coro_fn())


def test_outputs_rejection_and_duplicate_id() -> None:
    async def main() -> None:
        eng = AsyncLLMEngine(FakeEngine(step_delay=0.001))
        eng.start()
        try:
            outs = [o async for o in eng.generate("a", [1, 2], SamplingParams(max_tokens=4))]
            assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4
            assert [len(o.outputs[0].token_ids) for o in outs] == [1, 2, 3, 4]  # cumulative
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


def test_early_exit_aborts_and_frees() -> None:
    async def main() -> None:
        fake = FakeEngine(step_delay=0.002)
        eng = AsyncLLMEngine(fake)
        eng.start()
        try:
            async for out in eng.generate("x", [5], SamplingParams(max_tokens=100)):
                if len(out.outputs[0].token_ids) >= 3:
                    break
            for _ in range(200):
                if not fake.requests and eng.get_stats().num_running == 0:
                    break
                await asyncio.sleep(0.005)
            assert not fake.requests and eng.get_stats().num_running == 0
            assert eng.num_inflight == 0
        finally:
            eng.shutdown()

    _run(main)


def test_fault_and_drain() -> None:
    async def main() -> None:
        fake = FakeEngine(step_delay=0.002)
        eng = AsyncLLMEngine(fake)
        eng.start()
        stream = await eng.add_request("r", [1], SamplingParams(max_tokens=100))
        fake.fail_next_step = RuntimeError("boom")
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        eng.release(stream)
        assert eng.errored and not eng.is_healthy
        with pytest.raises(EngineDeadError):
            await eng.add_request("s", [1], SamplingParams())
        eng.shutdown()

        eng2 = AsyncLLMEngine(FakeEngine(step_delay=0.002))
        eng2.start()
        s2 = await eng2.add_request("a", [1], SamplingParams(max_tokens=10))
        eng2.begin_drain()
        with pytest.raises(EngineDrainingError):
            await eng2.add_request("b", [1], SamplingParams())

        async def consume() -> None:
            async for _ in s2:
                pass
            eng2.release(s2)

        task = asyncio.create_task(consume())
        assert await eng2.drain(timeout=5)
        await task
        eng2.shutdown()

    _run(main)
