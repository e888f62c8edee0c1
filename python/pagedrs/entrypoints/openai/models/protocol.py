"""/v1/models: the model cards /openapi.json documents."""

from __future__ import annotations

from typing import Literal

from pagedrs.entrypoints.openai.protocol import ResponseBody


class ModelCard(ResponseBody):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(ResponseBody):
    object: Literal["list"]
    data: list[ModelCard]


__all__ = ["ModelCard", "ModelList"]
