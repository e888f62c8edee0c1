"""The app's OpenAPI document: request bodies come from the routes' body dependencies (``JsonBody``
and the file upload form), which parse bodies themselves so that errors keep OpenAI's shape; and a
validation error is documented as what it is here, a 400 in that shape (FastAPI's default says 422)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from pagedrs.entrypoints.openai.protocol import ErrorResponse

_REF = "#/components/schemas/{model}"
_BAD_REQUEST = {
    "description": "Bad request (OpenAI's error shape)",
    "content": {"application/json": {"schema": {"$ref": _REF.format(model="ErrorResponse")}}},
}


class PagedrsAPI(FastAPI):
    """FastAPI serving ``routers``, whose OpenAPI document names the request bodies."""

    def __init__(self, routers: Sequence[APIRouter], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.api_routers = list(routers)
        for router in self.api_routers:
            self.include_router(router)

    def openapi(self) -> dict[str, Any]:
        before = self.openapi_schema
        schema = super().openapi()
        if schema is not before:  # generated now (FastAPI caches it until the routes change)
            routes = [r for router in self.api_routers for r in router.routes]
            add_request_bodies(schema, routes)
        return schema


def body_dependency(dependant: Dependant) -> Any | None:
    """The dependency (anywhere under ``dependant``) that declares the request body, if any."""
    for dep in dependant.dependencies:
        if isinstance(getattr(dep.call, "model", None), type) and hasattr(dep.call, "media_type"):
            return dep.call
        found = body_dependency(dep)
        if found is not None:
            return found
    return None


def add_request_bodies(schema: dict[str, Any], routes: list[Any]) -> None:
    bodies: list[tuple[dict[str, Any], type[BaseModel], str]] = []
    for route in routes:
        if not isinstance(route, APIRoute):
            continue
        ops = schema.get("paths", {}).get(route.path_format, {})
        body = body_dependency(route.dependant)
        for method in route.methods or ():
            op = ops.get(method.lower())
            if op is None:
                continue
            had_422 = op.get("responses", {}).pop("422", None) is not None
            if body is not None:
                bodies.append((op, body.model, body.media_type))
            if had_422 or body is not None:
                op["responses"].setdefault("400", _BAD_REQUEST)
    models: list[type[BaseModel]] = list(dict.fromkeys([ErrorResponse, *(m for _, m, _ in bodies)]))
    refs, top = models_json_schema([(m, "validation") for m in models], ref_template=_REF)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name, sub in top.get("$defs", {}).items():
        if name in components:  # also a response's part (FastAPI's rendering of it is kept)
            if _without_defaults(components[name]) != _without_defaults(sub):
                raise RuntimeError(f"two different schemas are both named {name} in the OpenAPI document")
            continue
        components[name] = sub
    for op, model, media_type in bodies:
        ref = refs[(model, "validation")]
        op["requestBody"] = {"required": True, "content": {media_type: {"schema": ref}}}
    if _REF.format(model="HTTPValidationError") not in json.dumps(schema["paths"]):
        components.pop("HTTPValidationError", None)  # FastAPI's 422 body (and its part), now unused
        components.pop("ValidationError", None)


def _without_defaults(schema: Any) -> Any:
    if isinstance(schema, dict):
        return {k: _without_defaults(v) for k, v in schema.items() if k != "default"}
    if isinstance(schema, list):
        return [_without_defaults(v) for v in schema]
    return schema
