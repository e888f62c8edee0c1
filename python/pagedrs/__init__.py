"""pagedrs: PagedAttention LLM inference and serving engine.

from pagedrs import LLM, SamplingParams
llm = LLM()                                   # the embedded default model (SmolLM2-135M-Instruct)
outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
print(outs[0].outputs[0].text)
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING, Any

from pagedrs import _gomp  # noqa: F401 -- first: it sets libgomp's spin count before anything imports torch
from pagedrs.lora_request import LoRARequest
from pagedrs.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    RequestMetrics,
    RequestOutput,
)
from pagedrs.pooling_params import PoolingParams
from pagedrs.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

__all__ = [
    "LLM",
    "BeamSearchParams",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "EngineArgs",
    "LLMEngine",
    "LiquidRequest",
    "LiquidType",
    "LoRARequest",
    "Logprob",
    "PoolingParams",
    "RequestMetrics",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
]

__version__ = "0.1.0"

if TYPE_CHECKING:
    from pagedrs.engine.llm_engine import EngineArgs, LLMEngine
    from pagedrs.entrypoints.llm import LLM
    from pagedrs.executor.liquid.shards import LiquidRequest, LiquidType


def __getattr__(name: str) -> Any:
    # The engine (torch, the Rust core, the models) loads on first use, so `import pagedrs._core` or
    # `from pagedrs import SamplingParams` stays light.
    if name in ("LLMEngine", "EngineArgs"):
        from pagedrs.engine import llm_engine

        return getattr(llm_engine, name)
    if name == "LLM":
        from pagedrs.entrypoints.llm import LLM

        return LLM
    if name in ("LiquidRequest", "LiquidType"):
        from pagedrs.executor.liquid import shards as liquid

        return getattr(liquid, name)
    raise AttributeError(f"module 'pagedrs' has no attribute {name!r}")


def _configure_logging() -> None:
    """INFO lines of the "pagedrs" logger go to stderr, like vLLM's, unless the application configured
    logging itself (the root logger has handlers) or PAGEDRS_CONFIGURE_LOGGING=0."""
    if os.environ.get("PAGEDRS_CONFIGURE_LOGGING", "1") == "0":
        return
    log = logging.getLogger("pagedrs")
    if log.handlers or logging.getLogger().handlers:
        log.setLevel(os.environ.get("PAGEDRS_LOGGING_LEVEL", "INFO"))
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter("%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s", "%m-%d %H:%M:%S")
    )
    log.addHandler(handler)
    log.setLevel(os.environ.get("PAGEDRS_LOGGING_LEVEL", "INFO"))
    log.propagate = False


_configure_logging()
