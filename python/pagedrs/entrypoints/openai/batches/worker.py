"""The background worker that runs batch jobs' lines through the engine.

One batch at a time, oldest first, up to ``max_concurrency`` lines in flight. Each answer is
stored (once) before the next state change, so a restart resumes exactly the unanswered lines.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from dataclasses import dataclass
from typing import Any

from pagedrs.entrypoints.openai.batches.store import BatchStore
from pagedrs.entrypoints.openai.chat.protocol import ChatCompletionRequest
from pagedrs.entrypoints.openai.chat.serving import OpenAIServingChat
from pagedrs.entrypoints.openai.completions.protocol import CompletionRequest
from pagedrs.entrypoints.openai.completions.serving import OpenAIServingCompletion
from pagedrs.entrypoints.openai.embeddings.protocol import EmbeddingRequest
from pagedrs.entrypoints.openai.embeddings.serving import OpenAIServingEmbedding
from pagedrs.entrypoints.openai.error_mapping import ENGINE_CORE_DIED, to_api_error
from pagedrs.entrypoints.openai.errors import APIError, bad_request
from pagedrs.entrypoints.openai.protocol import parse_request

logger = logging.getLogger("pagedrs.batch")

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings")


@dataclass
class BatchLine:
    line_no: int
    custom_id: str
    body: dict[str, Any]


class InputFileError(Exception):
    """The input file as a whole cannot be used (missing or unreadable)."""


def _error_line(
    custom_id: str | None,
    code: str,
    message: str,
    status: int | None = None,
    body: dict[str, Any] | None = None,
) -> dict[str, Any]:
    response = None
    if status is not None:
        response = {"status_code": status, "request_id": None, "body": body}
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": response,
        "error": {"code": code, "message": message},
    }


def same_endpoint(url: object, endpoint: str) -> bool:
    """A line's url names the batch's endpoint, with or without the /v1 prefix (SGLang's batch
    lines say "/chat/completions" for a "/v1/chat/completions" batch)."""
    return isinstance(url, str) and (url == endpoint or "/v1" + url == endpoint)


def parse_input(raw: bytes, endpoint: str) -> tuple[list[BatchLine], list[tuple[int, dict[str, Any]]]]:
    """Splits an input file into runnable lines and (line_no, error line) for bad ones.
    Line numbers count non-blank lines, so they are stable across restarts."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputFileError(f"input file is not UTF-8: {exc}") from None
    good: list[BatchLine] = []
    bad: list[tuple[int, dict[str, Any]]] = []
    seen: set[str] = set()
    line_no = 0
    for raw_line in text.splitlines():
        if not raw_line.strip():
            continue
        no, line_no = line_no, line_no + 1
        try:
            obj = json.loads(raw_line)
        except (ValueError, RecursionError) as exc:
            bad.append((no, _error_line(None, "invalid_json", f"line {no + 1}: invalid JSON: {exc}")))
            continue
        cid = obj.get("custom_id") if isinstance(obj, dict) else None
        problem = None
        if not isinstance(obj, dict):
            problem = "a line must be a JSON object"
        elif not isinstance(cid, str) or not cid:
            problem = "custom_id must be a non-empty string"
            cid = None
        elif cid in seen:
            problem = f"duplicate custom_id {cid!r}"
        elif obj.get("method", "POST") != "POST":
            problem = "method must be POST"
        elif not same_endpoint(obj.get("url"), endpoint):
            problem = f"url must be the batch's endpoint {endpoint}"
        elif not isinstance(obj.get("body"), dict):
            problem = "body must be a JSON object"
        if problem is not None:
            bad.append((no, _error_line(cid, "invalid_request", f"line {no + 1}: {problem}")))
            continue
        assert isinstance(cid, str)
        seen.add(cid)
        good.append(BatchLine(no, cid, obj["body"]))
    return good, bad


class BatchRunner:
    def __init__(
        self,
        store: BatchStore,
        completions: OpenAIServingCompletion,
        chat: OpenAIServingChat,
        *,
        max_concurrency: int = 64,
        embeddings: OpenAIServingEmbedding | None = None,
        poll_interval: float | None = None,
    ) -> None:
        """`poll_interval`: also look at the store that often for new jobs and cancellations (other
        API server processes write to it; their notify/cancel do not reach this process)."""
        self.store = store
        self.completions = completions
        self.chat = chat
        self.embeddings = embeddings
        self.max_concurrency = max(1, max_concurrency)
        self.poll_interval = poll_interval
        self._wake: asyncio.Event | None = None
        self._cancels: dict[str, asyncio.Event] = {}
        self._task: asyncio.Task[None] | None = None
        self._draining = False
        self._engine_down = False

    # ------------------------------------------------------------ control
    def start(self) -> None:
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._loop(), name="pagedrs-batch-worker")

    def notify(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def cancel(self, batch_id: str) -> None:
        self._cancels.setdefault(batch_id, asyncio.Event()).set()
        self.notify()

    def begin_drain(self) -> None:
        """Launches no new line; lines in flight go on."""
        self._draining = True
        self.notify()

    async def stop(self, timeout: float = 0.0) -> None:
        self.begin_drain()
        if self._task is None:
            return
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            pass
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task
        self._task = None

    # --------------------------------------------------------------- loop
    async def _loop(self) -> None:
        assert self._wake is not None
        while not self._draining:
            self._wake.clear()
            for batch_id in self.store.active_batch_ids():
                if self._draining:
                    return
                try:
                    await self._process(batch_id)
                except asyncio.CancelledError:
                    raise
                except Exception:  # one bad job must not stop the worker
                    logger.exception("batch %s failed", batch_id)
                    self.store.set_status(batch_id, "failed")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.poll_interval)

    async def _process(self, batch_id: str) -> None:
        batch = self.store.get_batch(batch_id)
        if batch is None:
            return
        status = batch["status"]
        if status == "cancelling":
            await self._finalize(batch_id, "cancelled")
            return
        if status == "finalizing":
            await self._finalize(batch_id, "completed")
            return
        try:
            lines = await asyncio.to_thread(self._load_lines, batch)
        except InputFileError as exc:
            self.store.set_errors(
                batch_id,
                [{"code": "invalid_file", "message": str(exc), "param": "input_file_id", "line": None}],
            )
            self.store.set_status(batch_id, "failed", only_from=frozenset({"validating", "in_progress"}))
            return
        if status == "validating":
            self.store.set_status(batch_id, "in_progress", only_from=frozenset({"validating"}))
        status = self._status(batch_id)
        if status == "cancelling":  # cancelled while validating
            await self._finalize(batch_id, "cancelled")
            return
        if status != "in_progress":
            return
        logger.info("batch %s: %d lines to run", batch_id, len(lines))
        cancelled = await self._run_lines(batch_id, batch["endpoint"], lines)
        if cancelled or self._status(batch_id) == "cancelling":
            await self._finalize(batch_id, "cancelled")
        elif not self._draining and not self._engine_down:
            await self._finalize(batch_id, "completed")

    def _status(self, batch_id: str) -> str | None:
        b = self.store.get_batch(batch_id)
        return b["status"] if b else None

    def _load_lines(self, batch: dict[str, Any]) -> list[BatchLine]:
        """Parses the input, stores the bad lines' answers, returns the lines still to run."""
        batch_id = batch["id"]
        raw = self.store.read_file(batch["input_file_id"])
        if raw is None:
            raise InputFileError(f"input file {batch['input_file_id']} not found")
        good, bad = parse_input(raw, batch["endpoint"])
        self.store.set_total(batch_id, len(good) + len(bad))
        for line_no, err in bad:
            self.store.record_result(batch_id, line_no, err["custom_id"], False, err)
        answered = self.store.answered_lines(batch_id)
        return [line for line in good if line.line_no not in answered]

    async def _run_lines(self, batch_id: str, endpoint: str, lines: list[BatchLine]) -> bool:
        """Runs lines with bounded concurrency; True if the batch was cancelled."""
        cancel = self._cancels.setdefault(batch_id, asyncio.Event())
        self._engine_down = False
        inflight: set[asyncio.Task[None]] = set()
        cancel_wait = asyncio.ensure_future(cancel.wait())
        try:
            it = iter(lines)
            exhausted = False
            while True:
                while (
                    not exhausted
                    and len(inflight) < self.max_concurrency
                    and not cancel.is_set()
                    and not self._draining
                    and not self._engine_down
                ):
                    line = next(it, None)
                    if line is None:
                        exhausted = True
                        break
                    inflight.add(asyncio.create_task(self._run_line(batch_id, endpoint, line)))
                if not inflight or cancel.is_set():
                    break
                await asyncio.wait(
                    inflight | {cancel_wait}, timeout=self.poll_interval, return_when=asyncio.FIRST_COMPLETED
                )
                inflight = {t for t in inflight if not t.done()}
                if self.poll_interval is not None and self._status(batch_id) == "cancelling":
                    cancel.set()  # cancelled through another API server process
        finally:
            cancel_wait.cancel()
            for t in inflight:
                t.cancel()
            if inflight:
                await asyncio.gather(*inflight, return_exceptions=True)
        return cancel.is_set()

    async def _run_line(self, batch_id: str, endpoint: str, line: BatchLine) -> None:
        try:
            body = dict(line.body)
            body["stream"] = False
            body.pop("stream_options", None)
            if endpoint == "/v1/completions":
                creq = parse_request(CompletionRequest, body)
                creq.check()
                resp = await self.completions.create(creq)
            elif endpoint == "/v1/embeddings":
                if self.embeddings is None:
                    raise bad_request("this server has no embeddings endpoint", param="url")
                ereq = parse_request(EmbeddingRequest, body)
                ereq.check()
                resp = await self.embeddings.create(ereq)
            else:
                chreq = parse_request(ChatCompletionRequest, body)
                chreq.check()
                resp = await self.chat.create(chreq)
            assert isinstance(resp, dict)
            answer = {
                "id": f"batch_req_{uuid.uuid4().hex}",
                "custom_id": line.custom_id,
                "response": {"status_code": 200, "request_id": resp["id"], "body": resp},
                "error": None,
            }
            ok = True
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bad line is answered with its error
            err = exc if isinstance(exc, APIError) else to_api_error(exc)
            if err.status == 503 or err.code == ENGINE_CORE_DIED:
                self._engine_down = True  # leave the line unanswered: the restarted core runs it
                return
            answer = _error_line(line.custom_id, err.code or err.type, err.message, err.status, err.body())
            ok = False
        self.store.record_result(batch_id, line.line_no, line.custom_id, ok, answer)

    async def _finalize(self, batch_id: str, final: str) -> None:
        if final == "completed":
            self.store.set_status(batch_id, "finalizing", only_from=frozenset({"in_progress"}))
            if self._status(batch_id) != "finalizing":
                return
        await asyncio.to_thread(self._write_outputs, batch_id, final)
        self._cancels.pop(batch_id, None)
        logger.info("batch %s %s", batch_id, final)

    def _write_outputs(self, batch_id: str, final: str) -> None:
        ids: dict[str, str | None] = {}
        for ok, kind in ((True, "output"), (False, "error")):
            lines = list(self.store.results(batch_id, ok))
            # A completed batch always has an output file, empty when every line failed (clients
            # read output_file_id without checking it); an error file only when a line failed.
            if lines or (ok and final == "completed"):
                file_id = f"file-{batch_id}-{kind}"
                self.store.create_file(
                    "".join(line + "\n" for line in lines).encode(),
                    f"{batch_id}_{kind}.jsonl",
                    "batch_output",
                    file_id=file_id,
                )
                ids[f"{kind}_file_id"] = file_id
            else:
                ids[f"{kind}_file_id"] = None
        source = frozenset({"finalizing"}) if final == "completed" else frozenset({"cancelling"})
        self.store.set_status(batch_id, final, only_from=source, **ids)
