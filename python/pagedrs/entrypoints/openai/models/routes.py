"""GET /v1/models and /v1/models/{model}: the served names and the LoRA adapters, as module-level handlers
on ``router``."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from pagedrs.entrypoints.openai.models.protocol import ModelCard, ModelList
from pagedrs.entrypoints.openai.server.routing import ERRORS
from pagedrs.entrypoints.openai.server.state import ServerDep, ServerState
from pagedrs.lora_request import LoRARequest

router = APIRouter()


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


__all__ = ["lora_card", "model_card", "router"]
