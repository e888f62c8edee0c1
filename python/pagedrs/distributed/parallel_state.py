"""vLLM's `parallel_state` names, for programs written against it (vLLM's continuous-batching notebook calls
`destroy_model_parallel()` before freeing an engine)."""

from __future__ import annotations

__all__ = ["destroy_distributed_environment", "destroy_model_parallel"]


def destroy_model_parallel() -> None:
    """Nothing to do: pagedrs keeps no process-wide model-parallel groups. Each engine's groups and
    worker processes end with `LLM.shutdown()` / `LLMEngine.shutdown()` (or when it is collected)."""


def destroy_distributed_environment() -> None:
    """As `destroy_model_parallel`: pagedrs never initializes torch's default process group."""
