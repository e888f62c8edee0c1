"""/v1/files and /v1/batches, as OpenAI and SGLang serve them (module-level handlers on ``router``)."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import UploadFile

from pagedrs.entrypoints.openai.batches.protocol import (
    BatchCreateRequest,
    BatchList,
    BatchObject,
    FileDeleted,
    FileList,
    FileObject,
    FileUploadForm,
)
from pagedrs.entrypoints.openai.batches.store import BatchStore
from pagedrs.entrypoints.openai.errors import bad_request, not_found
from pagedrs.entrypoints.openai.server.routing import ERRORS
from pagedrs.entrypoints.openai.server.state import JsonBody, ServerDep

FILE_PURPOSES = ("batch",)

router = APIRouter()


class FileUpload:
    """A route dependency: the multipart upload's (filename, content, purpose); 400 in OpenAI's error
    shape for anything else. Documented as ``FileUploadForm``."""

    model = FileUploadForm
    media_type = "multipart/form-data"

    async def __call__(self, request: Request) -> tuple[str, bytes, str]:
        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            raise bad_request("files must be uploaded as multipart/form-data", code="invalid_body")
        try:
            form = await request.form(max_files=1, max_fields=16)
        except Exception as exc:  # malformed multipart body
            raise bad_request(f"invalid multipart body: {exc}", code="invalid_body") from None
        try:
            upload = form.get("file")
            purpose = form.get("purpose")
            if not isinstance(upload, UploadFile):
                raise bad_request("a file field is required", param="file")
            if not isinstance(purpose, str) or purpose not in FILE_PURPOSES:
                raise bad_request(f"purpose must be one of {list(FILE_PURPOSES)}", param="purpose")
            return upload.filename or "upload.jsonl", await upload.read(), purpose
        finally:
            await form.close()


def file_or_404(store: BatchStore, file_id: str) -> dict[str, Any]:
    info = store.get_file(file_id)
    if info is None:
        raise not_found(f"No such file: {file_id}", param="file_id", code="file_not_found")
    return info


def batch_or_404(store: BatchStore, batch_id: str) -> dict[str, Any]:
    batch = store.get_batch(batch_id)
    if batch is None:
        raise not_found(f"No such batch: {batch_id}", param="batch_id", code="batch_not_found")
    return batch


@router.post("/v1/files", response_model=FileObject, responses=ERRORS)
async def create_file(
    upload: Annotated[tuple[str, bytes, str], Depends(FileUpload())], server: ServerDep
) -> JSONResponse:
    filename, content, purpose = upload
    info = await asyncio.to_thread(server.store.create_file, content, filename, purpose)
    return JSONResponse(info)


@router.get("/v1/files", response_model=FileList, responses=ERRORS)
async def list_files(server: ServerDep, purpose: str | None = None) -> JSONResponse:
    return JSONResponse({"object": "list", "data": server.store.list_files(purpose), "has_more": False})


@router.get("/v1/files/{file_id}", response_model=FileObject, responses=ERRORS)
async def retrieve_file(file_id: str, server: ServerDep) -> JSONResponse:
    return JSONResponse(file_or_404(server.store, file_id))


@router.get(
    "/v1/files/{file_id}/content",
    response_class=Response,
    responses={200: {"content": {"application/jsonl": {"schema": {"type": "string"}}}}, **ERRORS},
)
async def file_content(file_id: str, server: ServerDep) -> Response:
    file_or_404(server.store, file_id)
    content = await asyncio.to_thread(server.store.read_file, file_id)
    if content is None:
        raise not_found(f"No such file: {file_id}", param="file_id", code="file_not_found")
    return Response(content, media_type="application/jsonl")


@router.delete("/v1/files/{file_id}", response_model=FileDeleted, responses=ERRORS)
async def delete_file(file_id: str, server: ServerDep) -> JSONResponse:
    file_or_404(server.store, file_id)
    await asyncio.to_thread(server.store.delete_file, file_id)
    return JSONResponse({"id": file_id, "object": "file", "deleted": True})


@router.post("/v1/batches", response_model=BatchObject, responses=ERRORS)
async def create_batch(
    req: Annotated[BatchCreateRequest, Depends(JsonBody(BatchCreateRequest))], server: ServerDep
) -> JSONResponse:
    info = file_or_404(server.store, req.input_file_id)
    if info["purpose"] != "batch":
        raise bad_request("the input file's purpose must be batch", param="input_file_id")
    batch = server.store.create_batch(req.endpoint, req.input_file_id, req.completion_window, req.metadata)
    server.runner.notify()
    return JSONResponse(batch)


@router.get("/v1/batches", response_model=BatchList, responses=ERRORS)
async def list_batches(server: ServerDep, limit: int = 20, after: str | None = None) -> JSONResponse:
    if not 1 <= limit <= 100:
        raise bad_request("limit must be between 1 and 100", param="limit")
    data, has_more = server.store.list_batches(limit, after)
    first_id = data[0]["id"] if data else None
    last_id = data[-1]["id"] if data else None
    return JSONResponse(
        {"object": "list", "data": data, "first_id": first_id, "last_id": last_id, "has_more": has_more}
    )


@router.get("/v1/batches/{batch_id}", response_model=BatchObject, responses=ERRORS)
async def retrieve_batch(batch_id: str, server: ServerDep) -> JSONResponse:
    return JSONResponse(batch_or_404(server.store, batch_id))


@router.post("/v1/batches/{batch_id}/cancel", response_model=BatchObject, responses=ERRORS)
async def cancel_batch(batch_id: str, server: ServerDep) -> JSONResponse:
    store = server.store
    batch = batch_or_404(store, batch_id)
    if batch["status"] in ("cancelling", "cancelled"):
        return JSONResponse(batch)
    if not store.set_status(batch_id, "cancelling", only_from=frozenset({"validating", "in_progress"})):
        status = batch_or_404(store, batch_id)["status"]
        raise bad_request(
            f"cannot cancel a batch whose status is {status}", param="batch_id", code="invalid_state"
        )
    server.runner.cancel(batch_id)
    return JSONResponse(batch_or_404(store, batch_id))


__all__ = ["FILE_PURPOSES", "router"]
