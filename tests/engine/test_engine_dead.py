"""A Rust panic in the scheduler (or a scheduler poisoned by one) marks the engine dead instead of being
recovered silently: the step raises ExecutorDeadError, which ends a core process (the server restarts
it), and the scheduler itself refuses further use."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pagedrs import SamplingParams, _core
from pagedrs.executor import ExecutorDeadError
from tests.engine.conftest import make_engine
from tests.helpers import make_tiny_llama


class _Scheduler:
    """Delegates to the real scheduler; `schedule()` raises `exc` (the frozen pyclass takes no patch)."""

    def __init__(self, inner: Any, exc: BaseException) -> None:
        self._inner, self._exc = inner, exc

    def schedule(self) -> Any:
        raise self._exc

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class PanicException(BaseException):
    """Stands in for pyo3's PanicException (a BaseException named so)."""


@pytest.mark.parametrize(
    "exc",
    [
        _core.SchedulerPoisonedError("the scheduler panicked in an earlier call"),
        PanicException("index out of bounds"),
    ],
    ids=["poisoned", "panic"],
)
def test_panic_or_poison_is_fatal(tmp_path: Path, exc: BaseException) -> None:
    engine = make_engine(make_tiny_llama(tmp_path))
    engine.add_request("a", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4))
    core = engine.engine_core
    core.scheduler = _Scheduler(core.scheduler, exc)
    with pytest.raises(ExecutorDeadError, match="engine dead"):
        engine.step()


def test_poisoned_error_is_a_pagedrs_error() -> None:
    assert issubclass(_core.SchedulerPoisonedError, _core.PagedrsError)
    assert not issubclass(_core.SchedulerPoisonedError, ValueError)  # not the caller's fault: no 400
