"""/v1/embeddings: the request body (OpenAI's, with vLLM's extras) and the response bodies /openapi.json
documents."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pagedrs.entrypoints.openai.errors import bad_request
from pagedrs.entrypoints.openai.protocol import OpenAIModel, ResponseBody, TokenId, UsageInfo, as_prompts


class EmbeddingRequest(OpenAIModel):
    """OpenAI's /v1/embeddings body (and vLLM's extras: pooling_type, normalize)."""

    model: str | None = None
    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, le=2**31 - 1)
    user: str | None = None
    pooling_type: Literal["last", "mean", "cls", "first"] | None = None
    normalize: bool | None = None

    def check(self) -> None:
        inputs = self.inputs()
        if not inputs:
            raise bad_request("input must not be empty", param="input")
        if len(inputs) > 2048:
            raise bad_request(f"at most 2048 inputs per request, got {len(inputs)}", param="input")
        for i, x in enumerate(inputs):
            if len(x) == 0:
                raise bad_request(
                    "input must not be empty", param="input" if len(inputs) == 1 else f"input[{i}]"
                )

    def inputs(self) -> list[str | list[int]]:
        x = self.input
        if isinstance(x, str):
            return [x]
        if not x:
            return []
        return as_prompts(x)


class EmbeddingData(ResponseBody):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str  # a base64 string with encoding_format "base64"


class EmbeddingResponse(ResponseBody):
    object: Literal["list"]
    id: str
    data: list[EmbeddingData]
    model: str
    usage: UsageInfo


__all__ = ["EmbeddingData", "EmbeddingRequest", "EmbeddingResponse"]
