"""The FastAPI application: ``build_app(engine, args)``."""

from __future__ import annotations

import asyncio
import json
import logging
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedrs.engine.async_engine import AsyncLLMEngine
from pagedrs.entrypoints.openai.batch_store import BatchStore
from pagedrs.entrypoints.openai.batch_worker import BatchRunner
from pagedrs.entrypoints.openai.errors import (
    APIError,
    bad_request,
    error_body,
    internal,
    not_found,
    unavailable,
)
from pagedrs.entrypoints.openai.files_batches import build_router
from pagedrs.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from pagedrs.entrypoints.openai.middleware import ServerMiddleware
from pagedrs.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    parse_body,
)
from pagedrs.entrypoints.openai.serving_base import ClientDisconnected
from pagedrs.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedrs.entrypoints.openai.serving_completions import OpenAIServingCompletion
from pagedrs.entrypoints.openai.serving_embedding import OpenAIServingEmbedding

logger = logging.getLogger("pagedrs.server")

DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class SSEResponse(StreamingResponse):
    """Closes its generator however the response ends, so a dropped client's request is aborted
    at once rather than when the generator is garbage-collected."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


class ServerState:
    """What the routes and the shutdown path share (``app.state.server``)."""

    def __init__(
        self,
        engine: AsyncLLMEngine,
        metrics: ServerMetrics,
        store: BatchStore,
        runner: BatchRunner,
        grace_s: float,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.store = store
        self.runner = runner
        self.grace_s = grace_s
        self.draining = False
        self.drain_started = 0.0

    def begin_drain(self) -> None:
        """SIGTERM: no new requests or batch lines; what is in flight goes on."""
        if self.draining:
            return
        self.draining = True
        self.drain_started = time.monotonic()
        logger.info("draining: finishing in-flight requests (grace %.0fs)", self.grace_s)
        self.engine.begin_drain()
        self.runner.begin_drain()


def _arg(args: Any, name: str, default: Any) -> Any:
    value = getattr(args, name, None) if args is not None else None
    return default if value is None else value


def build_app(engine: Any, args: Any = None) -> FastAPI:
    """The server app around an ``AsyncLLMEngine`` (an ``LLMEngine`` or a core object is wrapped: its core
    then runs in a thread of this process behind the same channel).

    ``args`` (an argparse namespace or any object) may carry served_model_name (str or list),
    api_key, data_dir, max_body_bytes, max_batch_concurrency, shutdown_grace, and, for one of several
    API server processes, api_server_count and api_server_index (batch jobs run in process 0, which
    polls the shared store for jobs and cancellations made through the others).
    """
    if not isinstance(engine, AsyncLLMEngine):
        engine = AsyncLLMEngine(engine)
    names = _arg(args, "served_model_name", None) or [engine.model_name]
    served_model_names = [names] if isinstance(names, str) else list(names)
    index = int(_arg(args, "api_server_index", 0))
    metrics = ServerMetrics(served_model_names[0], engine.get_stats, core_histograms=index == 0)
    engine.set_observer(metrics)
    completions = OpenAIServingCompletion(engine, served_model_names)
    chat = OpenAIServingChat(engine, served_model_names, tokenizer=completions.tokenizer)
    embeddings = OpenAIServingEmbedding(engine, served_model_names, tokenizer=completions.tokenizer)
    data_dir = _arg(args, "data_dir", None) or tempfile.mkdtemp(prefix="pagedrs-data-")
    store = BatchStore(data_dir)
    num_servers = int(_arg(args, "api_server_count", 1))
    runs_batches = index == 0
    runner = BatchRunner(
        store,
        completions,
        chat,
        max_concurrency=int(_arg(args, "max_batch_concurrency", 64)),
        embeddings=embeddings,
        poll_interval=0.5 if num_servers > 1 else None,
    )
    engine.add_restart_listener(runner.notify)  # unanswered batch lines run again on the new core
    state = ServerState(engine, metrics, store, runner, float(_arg(args, "shutdown_grace", 30.0)))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        if runs_batches:
            runner.start()
        logger.info(
            "serving %s (max_model_len %d), data dir %s",
            served_model_names[0],
            engine.max_model_len,
            data_dir,
        )
        try:
            yield
        finally:
            state.begin_drain()
            left = max(0.0, state.grace_s - (time.monotonic() - state.drain_started))
            await runner.stop(timeout=left)
            await engine.drain(timeout=max(0.0, state.grace_s - (time.monotonic() - state.drain_started)))
            engine.shutdown()
            store.close()

    app = FastAPI(title="pagedrs", version="0.1.0", lifespan=lifespan)
    app.state.server = state

    @app.exception_handler(APIError)
    async def api_error_handler(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_handler(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x not in ("query", "path", "body")]
        param = ".".join(loc) or None
        return JSONResponse(
            error_body(f"{param}: {first.get('msg', 'invalid value')}", param=param, code="invalid_value"),
            status_code=400,
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error_handler(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = APIError(exc.status_code, str(exc.detail))
        return JSONResponse(err.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def unhandled_handler(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return internal(f"{type(exc).__name__}: {exc}").response()

    @app.get("/health")
    async def health() -> Response:
        if engine.is_healthy:
            return Response(status_code=200)
        if engine.errored:
            return unavailable(f"The engine core is not running: {engine.dead_error}").response()
        return unavailable(
            "The server is shutting down." if state.draining else "The engine is not running."
        ).response()

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": "0.1.0"})

    def model_card(name: str) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "pagedrs",
            "root": engine.model_name,
            "parent": None,
            "max_model_len": engine.max_model_len,
        }

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [model_card(n) for n in served_model_names]})

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str) -> JSONResponse:
        if model not in served_model_names:
            raise not_found(f"The model `{model}` does not exist.", param="model", code="model_not_found")
        return JSONResponse(model_card(model))

    async def respond(request: Request, body_type: Any, serving: Any) -> Response:
        """Parse the body as `body_type`, run `serving.create`: JSON, or SSE when it streams; 499 when
        the client went away before the response."""
        req = parse_body(body_type, await request.body())
        try:
            result = await serving.create(req, request)
        except ClientDisconnected:
            return Response(status_code=499)
        if isinstance(result, dict):
            return JSONResponse(result)
        return SSEResponse(result, media_type="text/event-stream", headers=SSE_HEADERS)

    @app.post("/v1/completions")
    async def create_completion(request: Request) -> Response:
        return await respond(request, CompletionRequest, completions)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: Request) -> Response:
        return await respond(request, ChatCompletionRequest, chat)

    @app.post("/v1/embeddings")
    async def create_embedding(request: Request) -> Response:
        return await respond(request, EmbeddingRequest, embeddings)

    liquid_lock = asyncio.Lock()
    admin_key = _arg(args, "api_key", None) or None

    @app.post("/v1/admin/liquid")
    async def admin_liquid(request: Request) -> JSONResponse:
        """Scale a liquid engine: {"target": N} or {"liquid_type": "LIQUID_1_2"}; 409 during a move."""
        if admin_key is None:
            raise APIError(403, "/v1/admin/liquid needs a server started with --api-key", code="forbidden")
        try:
            body = json.loads(await request.body() or b"{}")
        except ValueError:
            raise bad_request("the body must be a JSON object") from None
        if not isinstance(body, dict):
            raise bad_request("the body must be a JSON object")
        if liquid_lock.locked():
            raise APIError(409, "a liquid scale event is in progress", code="liquid_in_progress")
        async with liquid_lock:
            from pagedrs.executor.liquid import LiquidRequest, LiquidType

            try:
                kind = body.get("liquid_type")
                lreq = LiquidRequest(
                    liquid_type=LiquidType[kind] if kind is not None else None, target=body.get("target")
                )
                current = await engine.call_utility("liquid_degree")
                target = lreq.resolve(int(current))
                events = await engine.call_utility("liquid", target, timeout=600.0)
            except KeyError:
                raise bad_request(
                    f"liquid_type must be one of {[t.name for t in LiquidType]}", param="liquid_type"
                ) from None
            except (ValueError, TypeError) as exc:
                raise bad_request(str(exc), param="target") from None
        return JSONResponse({"object": "liquid.result", "degree": target, "events": events})

    app.include_router(build_router(store, runner))
    max_body = int(_arg(args, "max_body_bytes", DEFAULT_MAX_BODY_BYTES))
    app.add_middleware(
        ServerMiddleware,
        api_key=_arg(args, "api_key", None) or None,
        max_body_bytes=max_body,
        on_response=metrics.observe_http,
    )
    return app
