"""The FastAPI application: ``build_app(engine, args)``. Routes live in their modules as module-level
handlers on routers; this file builds the shared state, the error handlers and the middleware, and
includes the routers (``ROUTERS``, the one place a new endpoint's router is added)."""

from __future__ import annotations

import logging
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedrs import __version__
from pagedrs.engine.async_engine import AsyncLLMEngine
from pagedrs.entrypoints.anthropic import routes as anthropic_routes
from pagedrs.entrypoints.anthropic.errors import error_response
from pagedrs.entrypoints.cli_args import ServerArgs
from pagedrs.entrypoints.openai.batches import routes as batches_routes
from pagedrs.entrypoints.openai.batches.store import BatchStore
from pagedrs.entrypoints.openai.batches.worker import BatchRunner
from pagedrs.entrypoints.openai.chat import routes as chat_routes
from pagedrs.entrypoints.openai.chat.output import OutputParsing
from pagedrs.entrypoints.openai.chat.serving import OpenAIServingChat
from pagedrs.entrypoints.openai.completions import routes as completions_routes
from pagedrs.entrypoints.openai.completions.serving import OpenAIServingCompletion
from pagedrs.entrypoints.openai.embeddings import routes as embeddings_routes
from pagedrs.entrypoints.openai.embeddings.serving import OpenAIServingEmbedding
from pagedrs.entrypoints.openai.errors import APIError, bad_request, internal
from pagedrs.entrypoints.openai.models import routes as models_routes
from pagedrs.entrypoints.openai.models.serving import ServingModels
from pagedrs.entrypoints.openai.responses import routes as responses_routes
from pagedrs.entrypoints.openai.server import liquid_routes, lora_routes, routes
from pagedrs.entrypoints.openai.server.liveness import LivenessCollector
from pagedrs.entrypoints.openai.server.metrics import ServerMetrics
from pagedrs.entrypoints.openai.server.middleware import ServerMiddleware
from pagedrs.entrypoints.openai.server.openapi import PagedrsAPI
from pagedrs.entrypoints.openai.server.state import ServerState
from pagedrs.entrypoints.sglang import routes as sglang_routes
from pagedrs.entrypoints.sglang.serving_generate import SGLangServingGenerate

if TYPE_CHECKING:
    from pagedrs.engine.core.proc import CoreLike
    from pagedrs.engine.llm_engine import LLMEngine

logger = logging.getLogger("pagedrs.server")

# Every router the app serves, in the order /openapi.json lists their paths. A new endpoint family adds
# its router here.
ROUTERS: tuple[APIRouter, ...] = (
    routes.router,
    models_routes.router,
    completions_routes.router,
    chat_routes.router,
    embeddings_routes.router,
    liquid_routes.router,
    lora_routes.router,
    batches_routes.router,
    responses_routes.router,
    sglang_routes.router,
    anthropic_routes.router,
)


def build_app(engine: AsyncLLMEngine | LLMEngine | CoreLike, args: ServerArgs | None = None) -> FastAPI:
    """The server app around an ``AsyncLLMEngine`` (an ``LLMEngine`` or a core object is wrapped: its core
    then runs in a thread of this process behind the same channel). ``args``: the server's settings
    (None: the defaults); for one of several API server processes, batch jobs run in process 0, which
    polls the shared store for jobs and cancellations made through the others."""
    server_args = args if args is not None else ServerArgs()
    state = make_state(engine if isinstance(engine, AsyncLLMEngine) else AsyncLLMEngine(engine), server_args)
    app = PagedrsAPI(ROUTERS, title="pagedrs", version=__version__, lifespan=lifespan)
    app.state.server = state
    # Starlette types a handler as taking any Exception; each of these takes the class it is registered
    # for, which is what Starlette passes it (hence the arg-type ignores).
    app.add_exception_handler(APIError, api_error_handler)  # type: ignore[arg-type]  # starlette types handlers by Exception, ours take a subclass
    app.add_exception_handler(RequestValidationError, validation_handler)  # type: ignore[arg-type]  # as above
    app.add_exception_handler(StarletteHTTPException, http_error_handler)  # type: ignore[arg-type]  # as above
    app.add_exception_handler(Exception, unhandled_handler)
    app.add_middleware(
        ServerMiddleware,
        api_key=server_args.api_key,
        max_body_bytes=server_args.max_body_bytes,
        on_response=state.metrics.observe_http,
    )
    return app


def make_state(engine: AsyncLLMEngine, args: ServerArgs) -> ServerState:
    names = list(args.served_model_name) or [engine.model_name]
    dp = engine.router is not None
    metrics = ServerMetrics(
        names[0],
        engine.get_stats,
        core_histograms=args.api_server_index == 0,
        get_replica_stats=engine.get_replica_stats if dp else None,
    )
    engine.set_observer(metrics)
    metrics.add_collector(LivenessCollector(engine, names[0], per_engine=dp))
    engine.stall_restart_timeout = args.engine_stall_restart_timeout
    models = ServingModels(engine, names)
    completions = OpenAIServingCompletion(engine, names, models=models)
    parsing = OutputParsing.from_args(args)
    chat = OpenAIServingChat(
        engine,
        names,
        tokenizer=completions.tokenizer,
        parsing=parsing,
        models=models,
        chat_template=args.chat_template,
    )
    embeddings = OpenAIServingEmbedding(engine, names, tokenizer=completions.tokenizer)
    generate = SGLangServingGenerate(engine, names, tokenizer=completions.tokenizer)
    data_dir = args.data_dir or tempfile.mkdtemp(prefix="pagedrs-data-")
    store = BatchStore(data_dir)
    runner = BatchRunner(
        store,
        completions,
        chat,
        max_concurrency=args.max_batch_concurrency,
        embeddings=embeddings,
        poll_interval=0.5 if args.api_server_count > 1 else None,
    )
    engine.add_restart_listener(runner.notify)  # unanswered batch lines run again on the new core
    return ServerState(
        engine, args, names, metrics, completions, chat, embeddings, generate, store, runner, data_dir, models
    )


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    state: ServerState = app.state.server
    engine = state.engine
    engine.start()
    await state.models.load_static(state.args.lora_modules)  # a bad adapter fails the start
    if state.args.api_server_index == 0:
        state.runner.start()
    logger.info(
        "serving %s (max_model_len %d), data dir %s",
        state.served_model_names[0],
        engine.max_model_len,
        state.data_dir,
    )
    try:
        yield
    finally:
        state.begin_drain()
        await state.runner.stop(timeout=state.grace_left())
        await engine.drain(timeout=state.grace_left())
        engine.shutdown()
        state.store.close()


# Each handler answers in the shape of the route's API: Anthropic's under /v1/messages, OpenAI's elsewhere.
async def api_error_handler(request: Request, exc: APIError) -> JSONResponse:
    return error_response(request.url.path, exc)


async def validation_handler(request: Request, exc: RequestValidationError) -> JSONResponse:
    """FastAPI's own validation (query and path parameters): a 400, not a 422."""
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(x) for x in first.get("loc", ()) if x not in ("query", "path", "body")]
    param = ".".join(loc) or None
    err = bad_request(f"{param}: {first.get('msg', 'invalid value')}", param=param, code="invalid_value")
    return error_response(request.url.path, err)


async def http_error_handler(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(request.url.path, APIError(exc.status_code, str(exc.detail)), exc.headers)


async def unhandled_handler(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error")
    return error_response(request.url.path, internal(f"{type(exc).__name__}: {exc}"))


__all__ = ["ROUTERS", "build_app"]
