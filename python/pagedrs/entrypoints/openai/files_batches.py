"""/v1/files and /v1/batches, as OpenAI and SGLang serve them."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import UploadFile

from pagedrs.entrypoints.openai.batch_store import BatchStore
from pagedrs.entrypoints.openai.batch_worker import BatchRunner
from pagedrs.entrypoints.openai.errors import bad_request, not_found
from pagedrs.entrypoints.openai.protocol import BatchCreateRequest, parse_body

FILE_PURPOSES = ("batch",)


def build_router(store: BatchStore, runner: BatchRunner) -> APIRouter:
    router = APIRouter()

    def get_file_or_404(file_id: str) -> dict[str, Any]:
        info = store.get_file(file_id)
        if info is None:
            raise not_found(f"No such file: {file_id}", param="file_id", code="file_not_found")
        return info

    def get_batch_or_404(batch_id: str) -> dict[str, Any]:
        batch = store.get_batch(batch_id)
        if batch is None:
            raise not_found(f"No such batch: {batch_id}", param="batch_id", code="batch_not_found")
        return batch

    @router.post("/v1/files")
    async def create_file(request: Request) -> JSONResponse:
        ctype = request.headers.get("content-type", "")
        if not ctype.startswith("multipart/form-data"):
            raise bad_request("files must be uploaded as multipart/form-data", code="invalid_body")
        try:
            form = await request.form(max_files=1, max_fields=16)
        except Exception as exc:  # noqa: BLE001 - malformed multipart body
            raise bad_request(f"invalid multipart body: {exc}", code="invalid_body") from None
        try:
            upload = form.get("file")
            purpose = form.get("purpose")
            if not isinstance(upload, UploadFile):
                raise bad_request("a file field is required", param="file")
            if not isinstance(purpose, str) or purpose not in FILE_PURPOSES:
                raise bad_request(f"purpose must be one of {list(FILE_PURPOSES)}", param="purpose")
            content = await upload.read()
            filename = upload.filename or "upload.jsonl"
        finally:
            await form.close()
        info = await asyncio.to_thread(store.create_file, content, filename, purpose)
        return JSONResponse(info)

    @router.get("/v1/files")
    async def list_files(purpose: str | None = None) -> JSONResponse:
        return JSONResponse({"object": "list", "data": store.list_files(purpose), "has_more": False})

    @router.get("/v1/files/{file_id}")
    async def retrieve_file(file_id: str) -> JSONResponse:
        return JSONResponse(get_file_or_404(file_id))

    @router.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str) -> Response:
        get_file_or_404(file_id)
        content = await asyncio.to_thread(store.read_file, file_id)
        if content is None:
            raise not_found(f"No such file: {file_id}", param="file_id", code="file_not_found")
        return Response(content, media_type="application/jsonl")

    @router.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str) -> JSONResponse:
        get_file_or_404(file_id)
        await asyncio.to_thread(store.delete_file, file_id)
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})

    @router.post("/v1/batches")
    async def create_batch(request: Request) -> JSONResponse:
        req = parse_body(BatchCreateRequest, await request.body())
        info = get_file_or_404(req.input_file_id)
        if info["purpose"] != "batch":
            raise bad_request("the input file's purpose must be batch", param="input_file_id")
        batch = store.create_batch(req.endpoint, req.input_file_id, req.completion_window, req.metadata)
        runner.notify()
        return JSONResponse(batch)

    @router.get("/v1/batches")
    async def list_batches(limit: int = 20, after: str | None = None) -> JSONResponse:
        if not 1 <= limit <= 100:
            raise bad_request("limit must be between 1 and 100", param="limit")
        data, has_more = store.list_batches(limit, after)
        return JSONResponse(
            {
                "object": "list",
                "data": data,
                "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None,
                "has_more": has_more,
            }
        )

    @router.get("/v1/batches/{batch_id}")
    async def retrieve_batch(batch_id: str) -> JSONResponse:
        return JSONResponse(get_batch_or_404(batch_id))

    @router.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str) -> JSONResponse:
        batch = get_batch_or_404(batch_id)
        if batch["status"] in ("cancelling", "cancelled"):
            return JSONResponse(batch)
        if not store.set_status(batch_id, "cancelling", only_from=frozenset({"validating", "in_progress"})):
            status = get_batch_or_404(batch_id)["status"]
            raise bad_request(
                f"cannot cancel a batch whose status is {status}", param="batch_id", code="invalid_state"
            )
        runner.cancel(batch_id)
        return JSONResponse(get_batch_or_404(batch_id))

    return router
