"""The offline engine of `LLM(..., data_parallel_size=N)`: `LLMEngine`'s synchronous interface (add_request,
step, abort) over an `AsyncLLMEngine` that runs N engine core processes, routed as the server routes
them. Its event loop runs in a thread of this process; `step()` returns the outputs that arrived since the
previous call, waiting for at least one."""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from collections.abc import Coroutine, Iterable
from typing import Any, TypeVar

from pagedrs.engine.async_engine import AsyncLLMEngine
from pagedrs.engine.frontend.input_processor import chat_template_ids
from pagedrs.engine.frontend.request_stream import RequestStream
from pagedrs.launch_config import LaunchConfig
from pagedrs.lora_request import LoRARequest
from pagedrs.outputs import EmbeddingRequestOutput, RequestOutput
from pagedrs.pooling_params import PoolingParams
from pagedrs.sampling_params import SamplingParams

__all__ = ["DPLLMEngine"]

T = TypeVar("T")


class DPLLMEngine:
    """`LLMEngine`'s methods that `LLM` uses, over the cores of an `AsyncLLMEngine` (data parallelism)."""

    def __init__(self, config: LaunchConfig) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="pagedrs-dp-llm", daemon=True)
        self._thread.start()
        try:
            self.engine = AsyncLLMEngine.from_config(config)
        except BaseException:
            self._stop_loop()
            raise
        self._call(self._start())
        self.tokenizer = self.engine.tokenizer
        self.input_processor = self.engine.input_processor
        self.model_name = self.engine.model_name
        self.max_model_len = self.engine.max_model_len
        self.vocab_size = self.engine.vocab_size
        self.eos_token_ids = list(self.engine.ready.eos_token_ids)
        self._done: queue.SimpleQueue[RequestOutput | EmbeddingRequestOutput | BaseException] = (
            queue.SimpleQueue()
        )
        self._pending: dict[str, concurrent.futures.Future[None]] = {}
        self._closed = False

    async def _start(self) -> None:
        self.engine.start()

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    # ---- LLMEngine's interface ---------------------------------------------------------------------
    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        return chat_template_ids(self.tokenizer, self.model_name, messages, add_generation_prompt, **kwargs)

    def add_request(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams | PoolingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Validates the request and sends it to its replica; ValueError on bad input."""
        request_id = str(request_id)
        if request_id in self._pending:
            raise ValueError(f"request_id {request_id!r} is already in use")
        add: Coroutine[Any, Any, RequestStream[Any]] = self.engine.add_request(
            request_id, prompt, params, priority=priority, lora_request=lora_request
        )
        stream = self._call(add)
        self._pending[request_id] = asyncio.run_coroutine_threadsafe(self._collect(stream), self._loop)

    async def _collect(self, stream: RequestStream[Any]) -> None:
        try:
            async for out in stream:
                if out.finished:
                    self._done.put(out)
        except BaseException as exc:
            self._done.put(exc)
        finally:
            self.engine.release(stream)

    def abort_request(self, request_id: str | Iterable[str]) -> list[RequestOutput]:
        ids = [str(request_id)] if isinstance(request_id, str) else [str(r) for r in request_id]
        for rid in ids:
            if self._pending.pop(rid, None) is not None:
                self._loop.call_soon_threadsafe(self.engine.abort, rid)
        return []

    def has_unfinished_requests(self) -> bool:
        return bool(self._pending)

    def get_num_unfinished_requests(self) -> int:
        return len(self._pending)

    def step(self) -> list[RequestOutput | EmbeddingRequestOutput]:
        """The requests that finished since the previous call (waits for one); a request's error is raised."""
        if not self._pending:
            return []
        outs = [self._done.get()]
        while not self._done.empty():
            outs.append(self._done.get())
        result: list[RequestOutput | EmbeddingRequestOutput] = []
        for out in outs:
            if isinstance(out, BaseException):
                raise out
            if self._pending.pop(out.request_id, None) is not None:
                result.append(out)
        return result

    def reset_prefix_cache(self) -> bool:
        return bool(self._call(self.engine.call_utility("reset_prefix_cache")))

    def do_liquid(self, request: Any) -> list[dict[str, Any]]:
        raise ValueError("liquid scaling does not run with data_parallel_size > 1")

    def shutdown(self) -> None:
        """Stops every replica's process."""
        if self._closed:
            return
        self._closed = True
        self._loop.call_soon_threadsafe(self.engine.shutdown)
        self._call(asyncio.sleep(0))
        self._stop_loop()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self.shutdown()
