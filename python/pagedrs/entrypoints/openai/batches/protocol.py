"""/v1/files and /v1/batches: the request bodies (the batch to create, the upload form) and the response
bodies /openapi.json documents."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from pagedrs.entrypoints.openai.protocol import OpenAIModel, ResponseBody


class BatchCreateRequest(OpenAIModel):
    input_file_id: str = Field(..., min_length=1, max_length=256)
    endpoint: Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]
    completion_window: Literal["24h"] = "24h"
    metadata: dict[str, str] | None = None


class FileUploadForm(BaseModel):
    """POST /v1/files as multipart/form-data (documents the form; the route reads it itself)."""

    file: bytes = Field(..., json_schema_extra={"format": "binary"})
    purpose: Literal["batch"]


class FileObject(ResponseBody):
    id: str
    object: Literal["file"]
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: str | None = None
    status_details: str | None = None


class FileList(ResponseBody):
    object: Literal["list"]
    data: list[FileObject]
    has_more: bool = False


class FileDeleted(ResponseBody):
    id: str
    object: Literal["file"]
    deleted: bool


class BatchRequestCounts(ResponseBody):
    total: int
    completed: int
    failed: int


class BatchErrors(ResponseBody):
    object: Literal["list"]
    data: list[dict[str, Any]]


class BatchObject(ResponseBody):
    id: str
    object: Literal["batch"]
    endpoint: str
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: str
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: BatchRequestCounts
    metadata: dict[str, str] | None = None


class BatchList(ResponseBody):
    object: Literal["list"]
    data: list[BatchObject]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool


__all__ = [
    "BatchCreateRequest",
    "BatchErrors",
    "BatchList",
    "BatchObject",
    "BatchRequestCounts",
    "FileDeleted",
    "FileList",
    "FileObject",
    "FileUploadForm",
]
