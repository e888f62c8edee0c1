"""The OpenAI routes (models, completions, chat completions, embeddings) and the server's own
(/health, /metrics, /version, /v1/admin/liquid), as module-level handlers on ``router``."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Annotated, Any, Protocol

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from pagedrs import __version__
from pagedrs.engine.dp.client import SESSION_HEADER, session_key
from pagedrs.entrypoints.openai.errors import APIError, bad_request, unavailable
from pagedrs.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    LiquidScaleRequest,
)
from pagedrs.entrypoints.openai.responses.bodies import (
    ChatCompletionResponse,
    CompletionResponse,
    EmbeddingResponse,
    ErrorResponse,
    LiquidScaleResponse,
    ModelCard,
    ModelList,
    VersionResponse,
)
from pagedrs.entrypoints.openai.server.metrics import CONTENT_TYPE
from pagedrs.entrypoints.openai.server.state import (
    SSE_HEADERS,
    JsonBody,
    ServerDep,
    ServerState,
    SSEResponse,
)
from pagedrs.entrypoints.openai.serving_base import ClientDisconnected
from pagedrs.lora_request import LoRARequest

router = APIRouter()

# Documented error responses of the routes that take a body.
ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 500, 503)
}


def streamed(model: type[Any]) -> dict[int | str, dict[str, Any]]:
    """Responses of a route that answers JSON, or server-sent events when the body asks to stream."""
    sse = {"text/event-stream": {"schema": {"type": "string"}}}
    return {200: {"model": model, "content": sse}, **ERRORS}


class Serving(Protocol):
    async def create(self, req: Any, raw_request: Request | None = None) -> dict[str, Any] | Any: ...


async def respond(serving: Serving, req: Any, request: Request) -> Response:
    """Runs ``serving.create``: JSON, or SSE when it streams; 499 when the client went away first."""
    # The session, for data-parallel session affinity: the X-Session-Id header, else the request's `user`.
    session_key.set(request.headers.get(SESSION_HEADER) or getattr(req, "user", None))
    try:
        result = await serving.create(req, request)
    except ClientDisconnected:
        return Response(status_code=499)
    if isinstance(result, (dict, list)):
        return JSONResponse(result)
    stream: AsyncIterator[str] = result
    return SSEResponse(stream, media_type="text/event-stream", headers=SSE_HEADERS)


@router.get("/health", responses={503: {"model": ErrorResponse}})
async def health(server: ServerDep) -> Response:
    engine = server.engine
    if engine.is_healthy:
        if engine.num_replicas == 1:
            return Response(status_code=200)
        return JSONResponse({"status": "ok", "replicas": engine.replica_states()})
    if engine.errored:
        return unavailable(f"The engine core is not running: {engine.dead_error}").response()
    message = "The server is shutting down." if server.draining else "The engine is not running."
    return unavailable(message).response()


@router.get("/metrics", response_class=Response)
async def prometheus_metrics(server: ServerDep) -> Response:
    return Response(server.metrics.render(), media_type=CONTENT_TYPE)


@router.get("/version", response_model=VersionResponse)
async def version() -> JSONResponse:
    return JSONResponse({"version": __version__})


def model_card(server: ServerState, name: str) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "pagedrs",
        "root": server.engine.model_name,
        "parent": None,
        "max_model_len": server.engine.max_model_len,
    }


def lora_card(server: ServerState, lora: LoRARequest) -> dict[str, Any]:
    """An adapter's card, as vLLM lists one: its path as root, the base model as parent."""
    card = model_card(server, lora.lora_name)
    card.update(root=lora.lora_path, parent=lora.base_model_name or server.models.base_model_name)
    return card


@router.get("/v1/models", response_model=ModelList, responses=ERRORS)
async def list_models(server: ServerDep) -> JSONResponse:
    cards = [model_card(server, n) for n in server.served_model_names]
    cards += [lora_card(server, lora) for lora in server.models.adapters()]
    return JSONResponse({"object": "list", "data": cards})


@router.get("/v1/models/{model:path}", response_model=ModelCard, responses=ERRORS)
async def retrieve_model(model: str, server: ServerDep) -> JSONResponse:
    _, lora = server.models.resolve(model)  # 404 for a name the server does not serve
    return JSONResponse(model_card(server, model) if lora is None else lora_card(server, lora))


@router.post("/v1/completions", response_model=CompletionResponse, responses=streamed(CompletionResponse))
async def create_completion(
    req: Annotated[CompletionRequest, Depends(JsonBody(CompletionRequest))],
    request: Request,
    server: ServerDep,
) -> Response:
    return await respond(server.completions, req, request)


@router.post(
    "/v1/chat/completions", response_model=ChatCompletionResponse, responses=streamed(ChatCompletionResponse)
)
async def create_chat_completion(
    req: Annotated[ChatCompletionRequest, Depends(JsonBody(ChatCompletionRequest))],
    request: Request,
    server: ServerDep,
) -> Response:
    return await respond(server.chat, req, request)


@router.post("/v1/embeddings", response_model=EmbeddingResponse, responses=ERRORS)
async def create_embedding(
    req: Annotated[EmbeddingRequest, Depends(JsonBody(EmbeddingRequest))], request: Request, server: ServerDep
) -> Response:
    return await respond(server.embeddings, req, request)


LiquidBody = Annotated[LiquidScaleRequest, Depends(JsonBody(LiquidScaleRequest, empty_is_object=True))]


async def require_admin(server: ServerDep) -> None:
    """Admin routes exist only on a server with an API key (checked before the body is read)."""
    if not server.args.api_key:
        raise APIError(403, "/v1/admin/liquid needs a server started with --api-key", code="forbidden")


@router.post(
    "/v1/admin/liquid",
    response_model=LiquidScaleResponse,
    responses={**ERRORS, 403: {"model": ErrorResponse}, 409: {"model": ErrorResponse}},
    dependencies=[Depends(require_admin)],
)
async def admin_liquid(body: LiquidBody, server: ServerDep) -> JSONResponse:
    """Scale a liquid engine: {"target": N} or {"liquid_type": "LIQUID_1_2"}; 409 during a move."""
    if server.liquid_lock.locked():
        raise APIError(409, "a liquid scale event is in progress", code="liquid_in_progress")
    async with server.liquid_lock:
        target, events = await _liquid_move(server, body)
    return JSONResponse({"object": "liquid.result", "degree": target, "events": events})


async def _liquid_move(server: ServerState, body: LiquidScaleRequest) -> tuple[int, Any]:
    from pagedrs.executor.liquid.shards import LiquidRequest, LiquidType

    try:
        kind = LiquidType[body.liquid_type] if body.liquid_type is not None else None
    except KeyError:
        raise bad_request(
            f"liquid_type must be one of {[t.name for t in LiquidType]}", param="liquid_type"
        ) from None
    try:
        current = await server.engine.call_utility("liquid_degree")
        target = LiquidRequest(liquid_type=kind, target=body.target).resolve(int(current))
        events = await server.engine.call_utility("liquid", target, timeout=600.0)
    except (ValueError, TypeError) as exc:
        raise bad_request(str(exc), param="target") from None
    return target, events


__all__ = ["ERRORS", "respond", "router", "streamed"]
