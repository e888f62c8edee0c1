"""Executors: the model on one device (`UniProcExecutor`) or split over tensor-parallel ranks
(`TPExecutor` with `MpWorkers` or `RayWorkers`)."""

from pagedrs.executor.executor import ExecutorDeadError, TPExecutor, UniProcExecutor
from pagedrs.executor.workers import MpWorkers, RayWorkers, WorkerFailure

__all__ = ["ExecutorDeadError", "MpWorkers", "RayWorkers", "TPExecutor", "UniProcExecutor", "WorkerFailure"]
