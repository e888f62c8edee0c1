"""The /v1/responses routes (OpenAI's Responses API), as module-level handlers on ``router``."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response

from pagedrs.entrypoints.openai.responses.protocol import (
    ResponseDeleted,
    ResponseItemList,
    ResponseObject,
    ResponsesRequest,
)
from pagedrs.entrypoints.openai.responses.serving import OpenAIServingResponses
from pagedrs.entrypoints.openai.responses.store import ResponsesStore
from pagedrs.entrypoints.openai.server.routing import ERRORS, respond, streamed
from pagedrs.entrypoints.openai.server.state import JsonBody, ServerDep

router = APIRouter()


def get_responses(request: Request, server: ServerDep) -> OpenAIServingResponses:
    """The app's Responses serving object, made on first use beside the server's batch store."""
    serving: OpenAIServingResponses | None = getattr(request.app.state, "responses", None)
    if serving is None:
        serving = OpenAIServingResponses(
            server.chat, ResponsesStore(server.data_dir), only_server=server.args.api_server_count == 1
        )
        request.app.state.responses = serving
    return serving


ResponsesDep = Annotated[OpenAIServingResponses, Depends(get_responses)]


@router.post("/v1/responses", response_model=ResponseObject, responses=streamed(ResponseObject))
async def create_response(
    req: Annotated[ResponsesRequest, Depends(JsonBody(ResponsesRequest))],
    request: Request,
    serving: ResponsesDep,
) -> Response:
    return await respond(serving, req, request)


@router.get("/v1/responses/{response_id}", response_model=ResponseObject, responses=ERRORS)
async def retrieve_response(response_id: str, serving: ResponsesDep) -> JSONResponse:
    return JSONResponse(serving.retrieve(response_id))


@router.get("/v1/responses/{response_id}/input_items", response_model=ResponseItemList, responses=ERRORS)
async def list_input_items(
    response_id: str,
    serving: ResponsesDep,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
) -> JSONResponse:
    return JSONResponse(serving.input_items(response_id, limit, order, after))


@router.delete("/v1/responses/{response_id}", response_model=ResponseDeleted, responses=ERRORS)
async def delete_response(response_id: str, serving: ResponsesDep) -> JSONResponse:
    return JSONResponse(serving.delete(response_id))


@router.post("/v1/responses/{response_id}/cancel", response_model=ResponseObject, responses=ERRORS)
async def cancel_response(response_id: str, serving: ResponsesDep) -> JSONResponse:
    return JSONResponse(await serving.cancel(response_id))


__all__ = ["get_responses", "router"]
