"""Executors: the model on one device (`UniProcExecutor`) or split over tensor-parallel ranks
(`TPExecutor` with `MpRanks` or `RayRanks`)."""

from pagedrs.executor.executor import ExecutorDeadError, TPExecutor, UniProcExecutor
from pagedrs.executor.rank_processes import MpRanks, RankFailure, RayRanks

__all__ = ["ExecutorDeadError", "MpRanks", "RayRanks", "TPExecutor", "UniProcExecutor", "RankFailure"]
