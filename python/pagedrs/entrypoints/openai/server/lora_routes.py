"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter: LoRA adapters served from now on (or no longer)
by name, as vLLM's routes of the same names. Served only with --allow-runtime-lora-updating (or
$PAGEDRS_ALLOW_RUNTIME_LORA_UPDATING=1), as vLLM gates them with VLLM_ALLOW_RUNTIME_LORA_UPDATING; like
every /v1 route they need the API key when the server has one."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.responses import PlainTextResponse
from pydantic import Field

from pagedrs.entrypoints.cli_args import RUNTIME_LORA_ENV
from pagedrs.entrypoints.openai.errors import not_found
from pagedrs.entrypoints.openai.protocol import OpenAIModel
from pagedrs.entrypoints.openai.server.routing import ERRORS
from pagedrs.entrypoints.openai.server.state import JsonBody, ServerDep

router = APIRouter()


class LoadLoRAAdapterRequest(OpenAIModel):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)
    base_model_name: str | None = None  # the parent /v1/models names (default: the served model)


class UnloadLoRAAdapterRequest(OpenAIModel):
    lora_name: str = Field(min_length=1, max_length=256)


async def require_runtime_updating(server: ServerDep) -> None:
    """Without the switch the routes answer 404, as vLLM does not serve them then."""
    if not server.args.runtime_lora_updating:
        raise not_found(
            "runtime LoRA updating is off: start the server with --allow-runtime-lora-updating "
            f"(or {RUNTIME_LORA_ENV}=1)",
            code="not_found",
        )


@router.post(
    "/v1/load_lora_adapter",
    response_class=PlainTextResponse,
    responses=ERRORS,
    dependencies=[Depends(require_runtime_updating)],
)
async def load_lora_adapter(
    body: Annotated[LoadLoRAAdapterRequest, Depends(JsonBody(LoadLoRAAdapterRequest))], server: ServerDep
) -> PlainTextResponse:
    """Load a PEFT adapter folder and serve it as `lora_name`: 400 for a taken name or an adapter the
    engine refuses (rank above --max-lora-rank, bad folder, LoRA off)."""
    await server.models.load(body.lora_name, body.lora_path, body.base_model_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post(
    "/v1/unload_lora_adapter",
    response_class=PlainTextResponse,
    responses=ERRORS,
    dependencies=[Depends(require_runtime_updating)],
)
async def unload_lora_adapter(
    body: Annotated[UnloadLoRAAdapterRequest, Depends(JsonBody(UnloadLoRAAdapterRequest))], server: ServerDep
) -> PlainTextResponse:
    """Stop serving `lora_name`: 404 if unknown, 400 while requests still run under it."""
    await server.models.unload(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


__all__ = ["LoadLoRAAdapterRequest", "UnloadLoRAAdapterRequest", "router"]
