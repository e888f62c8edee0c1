"""A test-only stand-in for the engine core (EngineCore's methods, no model): tokens are bytes, each step
emits one deterministic token per running sequence as an `EngineCoreOutputs` message. The server runs it
behind the same ZeroMQ channel as a real core (in a thread); the end-to-end tests run the real engine in
its own process."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from pagedrs.engine.core.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    Ready,
    SampleLogprobsMsg,
)
from pagedrs.metrics import EngineStats

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
    max_tokens: int
    n: int
    logprobs: int | None
    outputs: list[list[int]] = field(default_factory=list)
    live: set[int] = field(default_factory=set)
    num_cached_tokens: int = 0


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
        self.die_next_step: BaseException | None = None  # raised out of the core loop: the core dies
        self.requests: dict[str, _Req] = {}
        self.pending: list[EngineCoreOutput] = []
        self.num_steps = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.lock = threading.Lock()  # asserts single-threaded use
        self.liquid_degree = 1
        self.liquid_delay = 0.0
        self.liquid_started = threading.Event()
        self.cached_prefixes: set[tuple[int, ...]] = set()  # full-block prompt prefixes seen (prefix cache)

    def get_tokenizer(self) -> ByteTokenizer:
        return self.tokenizer

    def ready_info(self) -> Ready:
        return Ready(self.model_name, self.max_model_len, self.vocab_size, [EOS], 20, self.num_blocks, 16, 0)

    def add_request(self, req: EngineCoreRequest) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        if req.pooling is not None:  # an embedding: answered on the next step, a vector from the prompt
            dims = req.pooling.dimensions or 8
            vec = [((sum(req.prompt_token_ids) + j) % 97) / 97.0 for j in range(dims)]
            self.pending.append(EngineCoreOutput(req.request_id, 0, embedding=vec))
            self.prompt_tokens_total += len(req.prompt_token_ids)
            return
        n = req.params.n
        self.requests[req.request_id] = _Req(
            req.request_id,
            list(req.prompt_token_ids),
            req.max_tokens,
            n,
            req.params.logprobs,
            [[] for _ in range(n)],
            set(range(n)),
        )
        self.prompt_tokens_total += len(req.prompt_token_ids)
        self.requests[req.request_id].num_cached_tokens = self._prefix_cache_hit(list(req.prompt_token_ids))

    def _prefix_cache_hit(self, prompt: list[int]) -> int:
        """As the real prefix cache: whole blocks of a prefix seen before, never the last prompt token."""
        size = self.block_size
        full = [tuple(prompt[: (k + 1) * size]) for k in range((len(prompt) - 1) // size)]
        hit = 0
        while hit < len(full) and full[hit] in self.cached_prefixes:
            hit += 1
        self.cached_prefixes.update(full)
        return hit * size

    def reject(self, request_id: str, error: str) -> None:
        self.pending.append(EngineCoreOutput(request_id, 0, finish_reason=FinishReason.ABORT, error=error))

    def abort(self, request_ids: Any, seqs: Any = ()) -> None:
        for rid in request_ids:
            self.requests.pop(rid, None)
        for rid, index in seqs:
            req = self.requests.get(rid)
            if req is not None:
                req.live.discard(index)
                if not req.live:
                    del self.requests[rid]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.requests

    def check_health(self) -> None:
        pass

    def idle_tick(self) -> None:
        """The core loop's call when no request runs (a liquid policy's sample); nothing to do here."""

    def take_pending(self) -> list[EngineCoreOutput]:
        out, self.pending = self.pending, []
        return out

    def call_utility(self, method: str, args: Any) -> Any:
        if method == "get_stats":
            return self.get_stats()
        if method == "liquid_degree":
            return self.liquid_degree
        if method == "liquid":  # a liquid move over 4 ranks that takes `liquid_delay` seconds
            target = int(args[0])
            if target not in (1, 2, 4):
                raise ValueError(
                    f"liquid target must be a power of two from 1 to 4 active ranks, got {target}"
                )
            self.liquid_started.set()
            time.sleep(self.liquid_delay)
            event = {"src_degree": self.liquid_degree, "dst_degree": target}
            self.liquid_degree = target
            return [event]
        raise ValueError(f"unknown utility method {method!r}")

    def step(self) -> EngineCoreOutputs:
        assert self.lock.acquire(blocking=False), "engine used from two threads"
        try:
            if self.die_next_step is not None:
                exc, self.die_next_step = self.die_next_step, None
                raise SystemExit(str(exc))  # not an Exception: ends the core loop like a crash
            if self.fail_next_step is not None:
                exc, self.fail_next_step = self.fail_next_step, None
                for rid in list(self.requests):
                    self.reject(rid, f"engine step failed: {exc}")
                self.requests.clear()
                raise exc
            time.sleep(self.step_delay)
            self.num_steps += 1
            outs = self.take_pending()
            for rid, req in list(self.requests.items()):
                for i in sorted(req.live):
                    toks = req.outputs[i]
                    start = req.prompt[-1] % 26
                    tok = ord("a") + (start + len(toks) + i) % 26
                    toks.append(tok)
                    self.generation_tokens_total += 1
                    o = EngineCoreOutput(rid, i, [tok])
                    if len(toks) == 1:
                        o.num_cached_tokens = req.num_cached_tokens
                    if req.logprobs is not None:
                        k = req.logprobs  # the sampled token, then the top k: itself and its successors
                        top = [(tok + j) % 256 for j in range(k)]
                        vals = [-0.5 - j for j in range(k)]
                        o.new_logprobs = SampleLogprobsMsg([[tok, *top]], [[-0.5, *vals]], [1])
                    if len(toks) >= req.max_tokens:
                        o.finish_reason = FinishReason.LENGTH
                        req.live.discard(i)
                    outs.append(o)
                if not req.live:
                    del self.requests[rid]
            return EngineCoreOutputs(outs, self.get_stats(), time.time())
        finally:
            self.lock.release()

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
