"""The server's own routes (/health, /metrics, /version), as module-level handlers on ``router``; each
API's routes are in its folder (``chat/routes.py``, ...), the admin and LoRA routes beside this file."""

from __future__ import annotations

import logging

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from pagedrs import __version__
from pagedrs.entrypoints.openai.errors import unavailable
from pagedrs.entrypoints.openai.protocol import ErrorResponse, ResponseBody
from pagedrs.entrypoints.openai.server.metrics import CONTENT_TYPE
from pagedrs.entrypoints.openai.server.state import ServerDep

router = APIRouter()
logger = logging.getLogger("pagedrs.server")


class VersionResponse(ResponseBody):
    version: str


@router.get("/health", responses={503: {"model": ErrorResponse}})
async def health(server: ServerDep) -> Response:
    engine = server.engine
    stalled = engine.stalled(server.args.engine_stall_timeout) if server.args.engine_stall_timeout else []
    if stalled and engine.is_healthy:
        replica, seconds, inflight = stalled[0]
        core = "the engine core" if engine.num_replicas == 1 else f"engine core {replica}"
        message = f"{core} has not finished a step for {seconds:.0f} s with {inflight} requests in flight"
        logger.warning("health: %s", message)
        return unavailable(message.capitalize() + ".").response()
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


__all__ = ["VersionResponse", "router"]
