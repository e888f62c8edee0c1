"""/v1/embeddings: OpenAI's request and response shapes over the engine's embedding requests."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import numpy as np
from fastapi import Request

from pagedrs.entrypoints.openai.embeddings.protocol import EmbeddingRequest
from pagedrs.entrypoints.openai.error_mapping import to_api_error
from pagedrs.entrypoints.openai.serving_base import OpenAIServing, random_id
from pagedrs.pooling_params import PoolingParams

__all__ = ["OpenAIServingEmbedding"]


class OpenAIServingEmbedding(OpenAIServing):
    async def create(self, req: EmbeddingRequest, raw_request: Request | None = None) -> dict[str, Any]:
        model = self.check_model(req.model)
        ids_list: list[list[int]] = []
        for x in req.inputs():
            ids_list.append(
                await self.offload(self.tokenize, x, size=len(x)) if isinstance(x, str) else list(x)
            )
        params = PoolingParams(
            pooling_type=req.pooling_type, normalize=req.normalize, dimensions=req.dimensions
        )
        request_id = random_id("embd")
        streams = await self.submit_all(request_id, ids_list, params, prompt_param="input")
        try:
            outputs = await self.until_disconnect(raw_request, self.collect(streams))
        finally:
            self.release_all(streams)
        data = []
        for i, out in enumerate(outputs):
            if out is None:
                raise to_api_error(RuntimeError(f"embedding {i} was aborted"))
            vec = out.outputs.embedding
            if req.encoding_format == "base64":
                value: Any = await asyncio.to_thread(_b64, vec)
            else:
                value = vec
            data.append({"object": "embedding", "index": i, "embedding": value})
        tokens = sum(len(ids) for ids in ids_list)
        return {
            "object": "list",
            "id": request_id,
            "data": data,
            "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }


def _b64(vec: list[float]) -> str:
    """OpenAI's base64 encoding: little-endian float32 bytes."""
    return base64.b64encode(np.asarray(vec, dtype="<f4").tobytes()).decode()
