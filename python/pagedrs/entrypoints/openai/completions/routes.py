"""POST /v1/completions, as a module-level handler on ``router``."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from pagedrs.entrypoints.openai.completions.protocol import CompletionRequest, CompletionResponse
from pagedrs.entrypoints.openai.server.routing import respond, streamed
from pagedrs.entrypoints.openai.server.state import JsonBody, ServerDep

router = APIRouter()


@router.post("/v1/completions", response_model=CompletionResponse, responses=streamed(CompletionResponse))
async def create_completion(
    req: Annotated[CompletionRequest, Depends(JsonBody(CompletionRequest))],
    request: Request,
    server: ServerDep,
) -> Response:
    return await respond(server.completions, req, request)


__all__ = ["router"]
