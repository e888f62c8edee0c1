"""POST /v1/chat/completions, as a module-level handler on ``router``."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from pagedrs.entrypoints.openai.chat.protocol import ChatCompletionRequest, ChatCompletionResponse
from pagedrs.entrypoints.openai.server.routing import respond, streamed
from pagedrs.entrypoints.openai.server.state import JsonBody, ServerDep

router = APIRouter()


@router.post(
    "/v1/chat/completions", response_model=ChatCompletionResponse, responses=streamed(ChatCompletionResponse)
)
async def create_chat_completion(
    req: Annotated[ChatCompletionRequest, Depends(JsonBody(ChatCompletionRequest))],
    request: Request,
    server: ServerDep,
) -> Response:
    return await respond(server.chat, req, request)


__all__ = ["router"]
