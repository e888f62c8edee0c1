"""The OpenAI API is one folder per API family (as vLLM's `entrypoints/openai/<api>/`): its request and
response bodies in `protocol.py`, its serving class in `serving.py`, its route handlers in `routes.py`,
whose router the app serves. The bodies vLLM users import from `vllm.entrypoints.openai.protocol` stay
importable from `pagedrs.entrypoints.openai.protocol`."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
from fastapi.routing import APIRoute
from pydantic import BaseModel

import pagedrs.entrypoints.openai as openai_pkg
from pagedrs.entrypoints.openai import protocol
from pagedrs.entrypoints.openai.server.app import ROUTERS
from pagedrs.entrypoints.openai.server.openapi import body_dependency

OPENAI = "pagedrs.entrypoints.openai"
# API folder -> the modules it has (batches runs its jobs in worker.py: it has no per-request serving class).
API_FOLDERS = {
    "chat": ("protocol", "serving", "routes"),
    "completions": ("protocol", "serving", "routes"),
    "embeddings": ("protocol", "serving", "routes"),
    "models": ("protocol", "serving", "routes"),
    "responses": ("protocol", "serving", "routes"),
    "batches": ("protocol", "worker", "routes"),
}
SHARED_BODIES = {"ErrorResponse"}  # every route's error body, in the shared protocol module


def _routes(api: str) -> list[APIRoute]:
    router = importlib.import_module(f"{OPENAI}.{api}.routes").router
    return [r for r in router.routes if isinstance(r, APIRoute)]


def _models(annotation: object) -> list[type[BaseModel]]:
    """The pydantic models a response_model names (a model, or a union or list of them)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in getattr(annotation, "__args__", ()) for m in _models(arg)]


@pytest.mark.parametrize("api", sorted(API_FOLDERS))
def test_api_folder_has_its_modules_and_its_router_is_served(api: str) -> None:
    folder = Path(openai_pkg.__file__).parent / api
    for module in API_FOLDERS[api]:
        assert (folder / f"{module}.py").is_file(), f"{api}/{module}.py"
    router = importlib.import_module(f"{OPENAI}.{api}.routes").router
    assert any(r is router for r in ROUTERS), f"{api}/routes.py's router is not in ROUTERS"
    assert _routes(api), f"{api}/routes.py serves no route"


@pytest.mark.parametrize("api", sorted(API_FOLDERS))
def test_api_routes_use_their_folders_bodies(api: str) -> None:
    """Each route's request body and documented response bodies are defined in its folder's protocol.py."""
    home = f"{OPENAI}.{api}.protocol"
    for route in _routes(api):
        body = body_dependency(route.dependant)
        models = ([body.model] if body is not None else []) + _models(route.response_model)
        for extra in route.responses.values():
            models += _models(extra.get("model"))
        assert models, route.path
        for model in models:
            if model.__name__ not in SHARED_BODIES:
                assert model.__module__ == home, f"{route.path}: {model.__name__} is in {model.__module__}"


def test_vllm_protocol_names_resolve_to_the_apis_bodies() -> None:
    """`from pagedrs.entrypoints.openai.protocol import ChatCompletionRequest` (vLLM's module path) gives
    the chat folder's class; every API body is reachable so, and no two APIs export the same name."""
    from pagedrs.entrypoints.openai.chat.protocol import ChatCompletionRequest
    from pagedrs.entrypoints.openai.protocol import ChatCompletionRequest as via_vllm_path

    assert via_vllm_path is ChatCompletionRequest
    seen: dict[str, str] = {}
    for module_name in protocol.API_PROTOCOLS:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            assert name not in seen, f"{name} in both {seen[name]} and {module_name}"
            seen[name] = module_name
            assert getattr(protocol, name) is getattr(module, name)
    assert {"CompletionRequest", "EmbeddingResponse", "ModelList", "BatchObject", "ResponsesRequest"} <= set(
        seen
    )
    with pytest.raises(AttributeError, match="no attribute 'NoSuchBody'"):
        protocol.NoSuchBody  # noqa: B018
