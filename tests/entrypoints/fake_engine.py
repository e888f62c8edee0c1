"""A test-only stand-in for LLMEngine (same interface, no model): tokens are bytes, each step emits
one deterministic token per running sequence. Used by the fast server tests; the end-to-end tests
run the real engine."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from pagedrs.metrics import EngineStats
from pagedrs.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagedrs.sampling_params import SamplingParams

EOS = 256


class ByteTokenizer:
    """UTF-8 bytes are tokens 0..255; 256 is EOS."""

    eos_token_id = EOS
    chat_template = "fake"

    def __len__(self) -> int:
        return 257

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", "replace")

    def apply_chat_template(
        self, messages: list[dict], tokenize: bool = False, add_generation_prompt: bool = True
    ) -> str:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


@dataclass
class _Req:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    arrival: float
    outputs: list[list[int]] = field(default_factory=list)
    finish: list[str | None] = field(default_factory=list)


class FakeEngine:
    """Emits letters 'a', 'b', ... cyclically; the prompt's last byte picks the start letter."""

    def __init__(
        self,
        *,
        max_model_len: int = 128,
        step_delay: float = 0.005,
        num_blocks: int = 64,
        block_size: int = 16,
    ) -> None:
        self.tokenizer = ByteTokenizer()
        self.max_model_len = max_model_len
        self.model_name = "fake-model"
        self.vocab_size = 257
        self.step_delay = step_delay
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.fail_next_step: BaseException | None = None
        self.requests: dict[str, _Req] = {}
        self.num_steps = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.lock = threading.Lock()  # asserts single-threaded use

    def get_tokenizer(self) -> ByteTokenizer:
        return self.tokenizer

    def add_request(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("the prompt is empty (0 tokens)")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(ids)} tokens exceeds max_model_len ({self.max_model_len})")
        self.requests[request_id] = _Req(
            request_id,
            ids,
            params,
            arrival_time or time.time(),
            [[] for _ in range(params.n)],
            [None] * params.n,
        )
        self.prompt_tokens_total += len(ids)

    def abort_request(self, request_id: str | list[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            self.requests.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def step(self) -> list[RequestOutput]:
        assert self.lock.acquire(blocking=False), "engine used from two threads"
        try:
            if self.fail_next_step is not None:
                exc, self.fail_next_step = self.fail_next_step, None
                raise exc
            time.sleep(self.step_delay)
            self.num_steps += 1
            outs = []
            for rid, req in list(self.requests.items()):
                for i, toks in enumerate(req.outputs):
                    if req.finish[i] is not None:
                        continue
                    start = req.prompt[-1] % 26
                    toks.append(ord("a") + (start + len(toks) + i) % 26)
                    self.generation_tokens_total += 1
                    limit = min(req.params.max_tokens or 16, self.max_model_len - len(req.prompt))
                    text = self.tokenizer.decode(toks)
                    if any(s in text for s in (req.params.stop or [])):
                        req.finish[i] = "stop"
                    elif len(toks) >= limit:
                        req.finish[i] = "length"
                finished = all(f is not None for f in req.finish)
                outs.append(self._output(req, finished))
                if finished:
                    del self.requests[rid]
            return outs
        finally:
            self.lock.release()

    def _output(self, req: _Req, finished: bool) -> RequestOutput:
        outputs = []
        for i, toks in enumerate(req.outputs):
            text = self.tokenizer.decode(toks)
            for s in req.params.stop or []:
                if s in text:
                    text = text[: text.index(s)]
            lps = None
            if req.params.logprobs is not None:
                lps = [
                    {t: Logprob(-0.5, 1, chr(t)), (t + 1) % 256: Logprob(-1.5, 2, chr((t + 1) % 256))}
                    for t in toks
                ]
            outputs.append(
                CompletionOutput(i, text, list(toks), -0.5 * len(toks) if lps else None, lps, req.finish[i])
            )
        now = time.time()
        return RequestOutput(
            req.request_id,
            None,
            req.prompt,
            None,
            outputs,
            finished,
            RequestMetrics(arrival_time=req.arrival, last_token_time=now),
        )

    def get_stats(self) -> EngineStats:
        used = sum(
            -(-(len(r.prompt) + max(len(t) for t in r.outputs)) // self.block_size)
            for r in self.requests.values()
        )
        return EngineStats(
            num_running=len(self.requests),
            num_waiting=0,
            kv_usage=min(1.0, used / self.num_blocks),
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            num_blocks=self.num_blocks,
            num_steps=self.num_steps,
        )
