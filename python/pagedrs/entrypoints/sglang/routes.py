"""SGLang's native routes as module-level handlers on ``router``: ``POST /generate`` and
``GET /get_model_info`` (its OpenAI routes are the app's own)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from pagedrs.entrypoints.openai.server.routing import ERRORS, respond, streamed
from pagedrs.entrypoints.openai.server.state import JsonBody, ServerDep
from pagedrs.entrypoints.sglang.protocol import GenerateRequest, GenerateResponse, ModelInfo

router = APIRouter(tags=["sglang"])


@router.post(
    "/generate",
    response_model=GenerateResponse | list[GenerateResponse],
    responses=streamed(GenerateResponse),
)
async def generate(
    req: Annotated[GenerateRequest, Depends(JsonBody(GenerateRequest))], request: Request, server: ServerDep
) -> Response:
    return await respond(server.generate, req, request)


@router.get("/get_model_info", response_model=ModelInfo, responses=ERRORS)
async def get_model_info(server: ServerDep) -> JSONResponse:
    engine = server.engine
    model_path = server.args.model or engine.model_name
    info = ModelInfo(
        model_path=model_path,
        tokenizer_path=server.args.tokenizer or model_path,
        is_generation=engine.ready.task != "embed",
        max_model_len=engine.max_model_len,
    )
    return JSONResponse(info.model_dump())


__all__ = ["router"]
