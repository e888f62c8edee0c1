"""POST /v1/embeddings, as a module-level handler on ``router``."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from pagedrs.entrypoints.openai.embeddings.protocol import EmbeddingRequest, EmbeddingResponse
from pagedrs.entrypoints.openai.server.routing import ERRORS, respond
from pagedrs.entrypoints.openai.server.state import JsonBody, ServerDep

router = APIRouter()


@router.post("/v1/embeddings", response_model=EmbeddingResponse, responses=ERRORS)
async def create_embedding(
    req: Annotated[EmbeddingRequest, Depends(JsonBody(EmbeddingRequest))], request: Request, server: ServerDep
) -> Response:
    return await respond(server.embeddings, req, request)


__all__ = ["router"]
