"""The Anthropic Messages routes, as module-level handlers on ``router``. `?beta=true` (the SDK's beta
client) is accepted and changes nothing."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from pagedrs.entrypoints.anthropic.protocol import (
    AnthropicErrorResponse,
    CountTokensRequest,
    CountTokensResponse,
    MessageResponse,
    MessagesRequest,
)
from pagedrs.entrypoints.anthropic.serving import AnthropicServingMessages
from pagedrs.entrypoints.openai.server.routing import respond
from pagedrs.entrypoints.openai.server.state import JsonBody, ServerDep

router = APIRouter()

ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": AnthropicErrorResponse} for code in (400, 401, 404, 500, 503)
}
STREAMED: dict[int | str, dict[str, Any]] = {
    200: {"model": MessageResponse, "content": {"text/event-stream": {"schema": {"type": "string"}}}},
    **ERRORS,
}


@router.post("/v1/messages", response_model=MessageResponse, responses=STREAMED)
async def create_message(
    req: Annotated[MessagesRequest, Depends(JsonBody(MessagesRequest))], request: Request, server: ServerDep
) -> Response:
    return await respond(AnthropicServingMessages(server.chat), req, request)


@router.post("/v1/messages/count_tokens", response_model=CountTokensResponse, responses=ERRORS)
async def count_tokens(
    req: Annotated[CountTokensRequest, Depends(JsonBody(CountTokensRequest))], server: ServerDep
) -> JSONResponse:
    return JSONResponse(await AnthropicServingMessages(server.chat).count_tokens(req))


__all__ = ["router"]
