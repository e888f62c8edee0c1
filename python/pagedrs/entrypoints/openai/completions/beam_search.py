"""`use_beam_search` on /v1/completions and /v1/chat/completions, as vLLM serves it: the request's
n (or best_of, when larger) is the beam width, the best n beams are the choices. The rounds of
`pagedrs.beam_search.BeamSearch` run through the async engine like any other requests. A streamed
beam search (vLLM streams it too) sends each choice whole, in one chunk, once the search is done: no
beam is final before the last round."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from pagedrs.beam_search import BeamSearch
from pagedrs.engine.frontend.input_processor import InputError
from pagedrs.entrypoints.openai.errors import bad_request
from pagedrs.entrypoints.openai.protocol import SamplingFields
from pagedrs.entrypoints.openai.serving_base import SSE_DONE, OpenAIServing, sse
from pagedrs.lora_request import LoRARequest
from pagedrs.outputs import CompletionOutput, RequestOutput
from pagedrs.sampling_params import BeamSearchParams

__all__ = ["beam_search_outputs", "whole_response_stream"]


async def beam_search_outputs(
    serving: OpenAIServing,
    request_id: str,
    req: SamplingFields,
    prompts: Sequence[list[int]],
    requested_max_tokens: int | None,
    width: int,
    n: int,
    lora_request: LoRARequest | None = None,
    names: Mapping[str, str] | None = None,
) -> list[RequestOutput]:
    """One finished output per prompt whose n completions are its best n beams, best first (every beam
    under `lora_request`'s adapter when given). `names`: the engine's field names as this endpoint spells
    them in a 400 (see `OpenAIServing.submit`; a prompt of several is `prompt[i]`). Long because the
    checks, the rounds and the outputs share the search's state; the algorithm is `BeamSearch`'s."""
    engine = serving.engine
    proc = engine.input_processor
    names = dict(names or {})
    limits = []
    for i, ids in enumerate(prompts):
        try:
            limits.append(proc.resolve_max_tokens(len(ids), requested_max_tokens))
        except InputError as exc:
            where = names.get("prompt", "prompt") + (f"[{i}]" if len(prompts) > 1 else "")
            param = where if exc.param == "prompt" else names.get(exc.param or "", exc.param)
            raise bad_request(str(exc), param=param, code=exc.code) from None
    try:
        params = BeamSearchParams(
            beam_width=width,
            max_tokens=max(limits),
            ignore_eos=req.ignore_eos,
            temperature=req.temperature if req.temperature is not None else 0.0,
            length_penalty=req.length_penalty,
        )
        search = BeamSearch(
            prompts, params, engine.ready.eos_token_ids, max_tokens=limits, max_logprobs=proc.max_logprobs
        )
    except ValueError as exc:  # the message names the field
        width_param = "best_of" if getattr(req, "best_of", None) is not None else "n"
        param = width_param if "beam_width" in str(exc) else "length_penalty"
        raise bad_request(str(exc), param=param) from None
    for round_index in itertools.count():
        beams = search.next_prompts()
        if not beams:
            break
        streams = await serving.submit_all(
            f"{request_id}-{round_index}", beams, search.step_params, names=names, lora_request=lora_request
        )
        try:
            search.update(await serving.collect(streams))
        finally:
            serving.release_all(streams)
    tokenizer = serving.tokenizer
    results = search.outputs(lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
    outputs = []
    for i, (ids, inst, result) in enumerate(zip(prompts, search.instances, results, strict=True)):
        choices = [
            CompletionOutput(
                index=j,
                text=beam.text or "",
                token_ids=beam.tokens[len(ids) :],
                cumulative_logprob=beam.cum_logprob,
                logprobs=beam.logprobs,
                finish_reason=beam.finish_reason,
            )
            for j, beam in enumerate(result.sequences[:n])
        ]
        outputs.append(
            RequestOutput(
                request_id=f"{request_id}-{i}",
                prompt=None,
                prompt_token_ids=list(ids),
                prompt_logprobs=None,
                outputs=choices,
                finished=True,
                num_cached_tokens=inst.num_cached_tokens,
            )
        )
    return outputs


async def whole_response_stream(body: dict[str, Any], include_usage: bool) -> AsyncIterator[str]:
    """A finished completion or chat completion `body` as the SSE stream of its chunks: one chunk per
    choice holding all of it (a chat choice's message as its delta), then the usage chunk when asked
    for (`stream_options.include_usage`), then [DONE]; the same chunk shapes a token-by-token stream has."""
    chat = body["object"] == "chat.completion"
    head = {
        "id": body["id"],
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": body["created"],
        "model": body["model"],
    }
    for choice in body["choices"]:
        if chat:
            message = dict(choice["message"])
            if message.get("tool_calls"):
                message["tool_calls"] = [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]
            choice = {**{k: v for k, v in choice.items() if k != "message"}, "delta": message}
        chunk: dict[str, Any] = {**head, "choices": [choice]}
        if include_usage:
            chunk["usage"] = None
        yield sse(chunk)
    if include_usage:
        yield sse({**head, "choices": [], "usage": body["usage"]})
    yield SSE_DONE
