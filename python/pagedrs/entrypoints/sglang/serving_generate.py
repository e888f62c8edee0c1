"""SGLang's ``POST /generate`` over the engine: prompts as text or token ids, SGLang's sampling params,
SGLang's response (``text``, ``output_ids``, ``meta_info``) and its cumulative SSE stream."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from pagedrs.entrypoints.openai.errors import APIError
from pagedrs.entrypoints.openai.serving_base import (
    SSE_DONE,
    OpenAIServing,
    merge_streams,
    random_id,
    sse,
    sse_error,
)
from pagedrs.entrypoints.sglang.protocol import _SGLANG_NAMES, GenerateRequest, in_sampling_params
from pagedrs.outputs import CompletionOutput


@dataclass
class _Prompt:
    """One prompt of a /generate request: its ids, sampling params and request id."""

    request_id: str
    ids: list[int]
    params: Any
    max_tokens: int
    names: dict[str, str]  # the engine's field names as /generate spells them in a 400


@dataclass
class _Progress:
    """What a stream has sent for one output: the text and ids so far."""

    text: str = ""
    ids: list[int] = field(default_factory=list)
    done: bool = False


class SGLangServingGenerate(OpenAIServing):
    async def prepare(self, req: GenerateRequest, stream: bool) -> list[_Prompt]:
        """Tokenizes and checks every prompt; their sampling params (SGLang's names mapped)."""
        base_id = req.rid if isinstance(req.rid, str) else random_id("generate")
        param = "text" if req.text is not None else "input_ids"
        prompts: list[_Prompt] = []
        for i, (p, sp) in enumerate(zip(req.prompts(), req.params_per_prompt(), strict=True)):
            where = param if len(req.prompts()) == 1 else f"{param}[{i}]"
            ids = await self.offload(self.tokenize, p, size=len(p)) if isinstance(p, str) else p
            fields = sp.as_openai()
            requested = sp.max_new_tokens
            if "max_new_tokens" not in sp.model_fields_set:  # SGLang's default, within the context
                requested = max(1, min(requested, self.max_model_len - len(ids)))
            try:
                params = self.sampling_params(fields, requested, None, stream=stream)
            except APIError as exc:
                raise in_sampling_params(exc) from None
            rid = req.rid[i] if isinstance(req.rid, list) and i < len(req.rid) else f"{base_id}-{i}"
            names = {name: f"sampling_params.{_SGLANG_NAMES.get(name, name)}" for name in _SAMPLING_FIELDS}
            prompts.append(_Prompt(rid, ids, params, requested, {**names, "prompt": where}))
        return prompts

    async def create(
        self, req: GenerateRequest, raw_request: Request | None = None
    ) -> dict[str, Any] | list[dict[str, Any]] | AsyncIterator[str]:
        start = time.monotonic()
        prompts = await self.prepare(req, req.stream)
        streams = []
        try:
            for p in prompts:
                streams.append(await self.submit(p.request_id, p.ids, p.params, p.names))
        except BaseException:
            self.release_all(streams)
            raise
        if req.stream:
            return self._stream(prompts, streams, start)
        try:
            outputs = await self.until_disconnect(raw_request, self.collect(streams))
        finally:
            self.release_all(streams)
        results = []
        latency = time.monotonic() - start
        for p, out in zip(prompts, outputs, strict=True):
            cached = out.num_cached_tokens or 0
            for c in sorted(out.outputs, key=lambda c: c.index):
                results.append(_result(p, c, c.text, c.token_ids, cached, latency))
        return results if req.is_batch() else results[0]

    async def _stream(self, prompts: list[_Prompt], streams: list[Any], start: float) -> AsyncIterator[str]:
        n = max(p.params.n for p in prompts)
        progress: dict[tuple[int, int], _Progress] = {}
        try:
            async for p_idx, out in merge_streams(streams):
                p = prompts[p_idx]
                for c in out.outputs:  # delta outputs: the new text and ids
                    seen = progress.setdefault((p_idx, c.index), _Progress())
                    if seen.done:
                        continue
                    seen.text += c.text
                    seen.ids.extend(c.token_ids)
                    seen.done = c.finish_reason is not None
                    if not (c.text or c.token_ids or seen.done):
                        continue
                    result = _result(
                        p, c, seen.text, seen.ids, out.num_cached_tokens or 0, time.monotonic() - start
                    )
                    result["index"] = p_idx * n + c.index
                    yield sse(result)
        except Exception as exc:  # after the stream started: an SSE error event
            yield sse_error(exc)
        finally:
            self.release_all(streams)
        yield SSE_DONE


def _result(
    p: _Prompt, c: CompletionOutput, text: str, ids: list[int], cached: int, latency: float
) -> dict[str, Any]:
    """SGLang's output object: text, output_ids and meta_info (finish_reason None while running)."""
    return {
        "text": text,
        "output_ids": list(ids),
        "meta_info": {
            "id": p.request_id if p.params.n == 1 else f"{p.request_id}-{c.index}",
            "finish_reason": finish_reason(c, ids, p.max_tokens),
            "prompt_tokens": len(p.ids),
            "completion_tokens": len(ids),
            "cached_tokens": cached,
            "e2e_latency": round(latency, 6),
        },
    }


def finish_reason(c: CompletionOutput, ids: list[int], max_tokens: int) -> dict[str, Any] | None:
    """SGLang's shape: stop names what matched (a stop string, else the stop or EOS token id)."""
    if c.finish_reason is None:
        return None
    if c.finish_reason == "length":
        return {"type": "length", "length": max_tokens}
    if c.finish_reason == "stop":
        matched = c.stop_reason if c.stop_reason is not None else (ids[-1] if ids else None)
        return {"type": "stop", "matched": matched}
    return {"type": "abort", "message": f"the request ended: {c.finish_reason}"}


# fields the engine's InputProcessor may refuse, beside the prompt
_SAMPLING_FIELDS = ("max_tokens", "min_tokens", "stop_token_ids", "logit_bias")

__all__ = ["SGLangServingGenerate", "finish_reason"]
