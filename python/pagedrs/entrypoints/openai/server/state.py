"""What the routes share and how a route gets it: ``ServerState`` lives in ``app.state.server``; a
route asks for it with ``ServerDep`` and for its parsed body with ``JsonBody(Model)``."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Annotated, Any, Generic, TypeVar

from fastapi import Depends, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from pagedrs.engine.async_engine import AsyncLLMEngine
from pagedrs.entrypoints.cli_args import ServerArgs
from pagedrs.entrypoints.openai.batches.store import BatchStore
from pagedrs.entrypoints.openai.batches.worker import BatchRunner
from pagedrs.entrypoints.openai.chat.serving import OpenAIServingChat
from pagedrs.entrypoints.openai.completions.serving import OpenAIServingCompletion
from pagedrs.entrypoints.openai.embeddings.serving import OpenAIServingEmbedding
from pagedrs.entrypoints.openai.models.serving import ServingModels
from pagedrs.entrypoints.openai.protocol import parse_body
from pagedrs.entrypoints.openai.server.metrics import ServerMetrics
from pagedrs.entrypoints.sglang.serving_generate import SGLangServingGenerate

logger = logging.getLogger("pagedrs.server")

M = TypeVar("M", bound=BaseModel)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass
class ServerState:
    """The engine, the serving objects, the batch store and worker, and the drain state."""

    engine: AsyncLLMEngine
    args: ServerArgs
    served_model_names: list[str]
    metrics: ServerMetrics
    completions: OpenAIServingCompletion
    chat: OpenAIServingChat
    embeddings: OpenAIServingEmbedding
    generate: SGLangServingGenerate
    store: BatchStore
    runner: BatchRunner
    data_dir: str
    models: ServingModels  # the base model's names and the LoRA adapters'
    liquid_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    draining: bool = False
    drain_started: float = 0.0

    @property
    def grace_s(self) -> float:
        return self.args.shutdown_grace

    def grace_left(self) -> float:
        return max(0.0, self.grace_s - (time.monotonic() - self.drain_started))

    def begin_drain(self) -> None:
        """SIGTERM: no new requests or batch lines; what is in flight goes on."""
        if self.draining:
            return
        self.draining = True
        self.drain_started = time.monotonic()
        logger.info("draining: finishing in-flight requests (grace %.0fs)", self.grace_s)
        self.engine.begin_drain()
        self.runner.begin_drain()


async def get_server(request: Request) -> ServerState:
    # async: FastAPI would run a plain def dependency in a worker thread, a hop on every request
    state: ServerState = request.app.state.server
    return state


ServerDep = Annotated[ServerState, Depends(get_server)]


class JsonBody(Generic[M]):
    """A route dependency: the request body parsed as ``model`` and checked (``model.check()``), 400 in
    OpenAI's error shape otherwise. The body is read as JSON whatever its content type, as OpenAI's
    server does. The app's OpenAPI document names ``model`` as the route's request body."""

    media_type = "application/json"

    def __init__(self, model: type[M], *, empty_is_object: bool = False) -> None:
        self.model = model
        self.empty_is_object = empty_is_object  # an empty body reads as {} (admin routes)

    async def __call__(self, request: Request) -> M:
        raw = await request.body()
        return parse_body(self.model, raw or (b"{}" if self.empty_is_object else raw))


class SSEResponse(StreamingResponse):
    """Closes its generator however the response ends, so a dropped client's request is aborted
    at once rather than when the generator is garbage-collected."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose: Any = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


__all__ = ["SSE_HEADERS", "JsonBody", "SSEResponse", "ServerDep", "ServerState", "get_server"]
