"""POST /v1/admin/liquid: scale a liquid engine while it serves (authenticated: served only with an API
key), as a module-level handler on ``router``, its bodies beside it."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse
from pydantic import Field

from pagedrs.entrypoints.openai.errors import APIError, bad_request
from pagedrs.entrypoints.openai.protocol import ErrorResponse, OpenAIModel, ResponseBody
from pagedrs.entrypoints.openai.server.routing import ERRORS
from pagedrs.entrypoints.openai.server.state import JsonBody, ServerDep, ServerState

router = APIRouter()


class LiquidScaleRequest(OpenAIModel):
    """POST /v1/admin/liquid: exactly one of ``target`` (active ranks) or ``liquid_type`` (a named move)."""

    target: int | None = Field(default=None, ge=1, le=1 << 16)  # a power of two the engine checks
    liquid_type: str | None = Field(default=None, max_length=64)


class LiquidScaleResponse(ResponseBody):
    object: Literal["liquid.result"]
    degree: int
    events: list[dict[str, Any]]


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


__all__ = ["LiquidScaleRequest", "LiquidScaleResponse", "router"]
