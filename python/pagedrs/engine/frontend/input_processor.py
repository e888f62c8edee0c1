"""InputProcessor: the one place a request is validated and tokenized and its max_tokens resolved, before
anything reaches the engine core. Every error is an `InputError` (a ValueError) naming the offending value
and, for the server, the request field it came from."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from pagedrs.engine.core.messages import EngineCoreRequest
from pagedrs.errors import InputError
from pagedrs.lora_request import LoRARequest
from pagedrs.multimodal import MultiModalItem
from pagedrs.multimodal.admission import check_encoder_budget
from pagedrs.multimodal.inputs import multimodal_prompt
from pagedrs.multimodal.processing import MultiModalProcessor, mrope_of
from pagedrs.pooling_params import PoolingParams
from pagedrs.sampling_params import SamplingParams

__all__ = ["InputError", "InputProcessor", "PromptType", "chat_template_ids"]

PromptType = str | list[int] | dict[str, Any]


class InputProcessor:
    def __init__(
        self,
        tokenizer: Any,
        *,
        max_model_len: int,
        vocab_size: int,
        max_logprobs: int,
        strict: bool = False,
        embedding_size: int = 0,
        task: str = "auto",
        mm_processor: MultiModalProcessor | None = None,
        limit_mm_per_prompt: dict[str, int] | None = None,
        allowed_local_media_path: str | None = None,
        max_num_encoder_input_tokens: int | None = None,
    ) -> None:
        """`strict` (the server, as OpenAI does): reject prompt + max_tokens > max_model_len and stop token
        ids or logit_bias keys outside the vocabulary. Otherwise (offline, as vLLM) such a request stops at
        max_model_len with finish reason "length" and such ids never match."""
        self.tokenizer = tokenizer
        self.strict = strict
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size or (len(tokenizer) if tokenizer is not None else 0)
        self.max_logprobs = max_logprobs
        self.embedding_size = embedding_size
        self.task = task
        self.mm_processor = mm_processor  # None: the model takes no images
        self.limit_mm_per_prompt = limit_mm_per_prompt or {}
        self.allowed_local_media_path = allowed_local_media_path  # file:// image URLs only under it
        self.max_num_encoder_input_tokens = max_num_encoder_input_tokens  # a step's encoder budget

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(prompt text or None, checked token ids)."""
        text: str | None = None
        ids: Any = None
        if isinstance(prompt, dict):
            text, ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
            if text is None and ids is None:
                raise InputError(
                    f"prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}", "prompt"
                )
        elif isinstance(prompt, str):
            text = prompt
        else:
            ids = prompt
        if ids is None:
            if not isinstance(text, str):
                raise InputError(
                    f"prompt must be a str, a list of token ids or a dict, got {type(text).__name__}",
                    "prompt",
                )
            if self.tokenizer is None:
                raise InputError("this model has no tokenizer: give prompts as token ids", "prompt")
            try:
                ids = self.tokenizer.encode(text)
            except Exception as exc:  # undecodable input (lone surrogates, ...)
                raise InputError(f"prompt cannot be tokenized: {exc}", "prompt") from None
        if isinstance(ids, np.ndarray):
            ids = ids.tolist()
        if not isinstance(ids, (list, tuple)) or not all(
            isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in ids
        ):
            raise InputError(f"prompt_token_ids must be a list of ints, got {str(ids)[:80]}", "prompt")
        ids = [int(t) for t in ids]
        self.check_token_ids(ids, "prompt")
        return text, ids

    def check_token_ids(self, ids: list[int], param: str) -> None:
        for t in ids:
            if t < 0 or (self.vocab_size and t >= self.vocab_size):
                raise InputError(
                    f"token id {t} is out of vocabulary: it must be in [0, {self.vocab_size})", param
                )

    def resolve_max_tokens(self, num_prompt: int, requested: int | None) -> int:
        """max_tokens checked against max_model_len (the message gives both numbers); None = what is left."""
        limit = self.max_model_len
        if num_prompt == 0:
            raise InputError("the prompt is empty (0 tokens)", "prompt")
        if num_prompt >= limit:
            raise InputError(
                f"This model's maximum context length is {limit} tokens. However, your prompt has "
                f"{num_prompt} tokens, which leaves no room for a completion (max_model_len {limit}).",
                "prompt",
                "context_length_exceeded",
            )
        if requested is None:
            return limit - num_prompt
        if num_prompt + requested > limit and self.strict:
            raise InputError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt + requested} tokens ({num_prompt} in the prompt, {requested} for the "
                f"completion). Please reduce the prompt or max_tokens.",
                "max_tokens",
                "context_length_exceeded",
            )
        return requested

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        client_index: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> tuple[str | None, EngineCoreRequest]:
        """(prompt text, the request for the core); InputError on bad input. A PoolingParams makes an
        embedding request (`process_pooling`). Long because it is the one place where a request's rules
        are checked, one after the other."""
        if isinstance(params, PoolingParams):
            return self.process_pooling(
                request_id,
                prompt,
                params,
                arrival_time=arrival_time,
                priority=priority,
                client_index=client_index,
            )
        if not isinstance(params, SamplingParams):
            raise InputError(f"params must be a SamplingParams, got {type(params).__name__}")
        if lora_request is not None and not isinstance(lora_request, LoRARequest):
            raise InputError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        if self.task == "embed":
            raise InputError(
                "this model is served for embeddings (--task embed): it does not generate", "model"
            )
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(params, name)
            if v is not None and v > self.max_logprobs:
                raise InputError(f"{name} ({v}) is larger than max_logprobs ({self.max_logprobs})", name)
        if params.structured_outputs is not None:
            if self.tokenizer is None:
                raise InputError(
                    "structured outputs need a tokenizer (skip_tokenizer_init is set)", "structured_outputs"
                )
            try:
                params.structured_outputs.validate()
            except ValueError as exc:
                raise InputError(str(exc), "structured_outputs") from None
        if params.stop_token_ids and self.strict:
            self.check_token_ids(params.stop_token_ids, "stop_token_ids")
        if params.logit_bias and self.strict:
            self.check_token_ids(list(params.logit_bias), "logit_bias")
        items: list[MultiModalItem] = []
        text: str | None
        mrope = None
        mm: dict[str, Any] | None = None
        if isinstance(prompt, dict) and (prompt.get("multi_modal_data") or prompt.get("multi_modal_items")):
            mm = dict(prompt)
        if mm is not None and mm.get("multi_modal_data"):
            text, ids, items = multimodal_prompt(self.mm_processor, mm, self.limit_mm_per_prompt)
        elif mm is not None:  # processed by the server's chat path (`chat.images`)
            text, ids, items = None, list(mm["prompt_token_ids"]), list(mm["multi_modal_items"])
        else:
            text, ids = self.tokenize(prompt)
        if mm is not None:
            self.check_token_ids(ids, "prompt")
            mrope = mrope_of(self.mm_processor, ids, items) if self.mm_processor is not None else None
            try:
                check_encoder_budget([it.length for it in items], self.max_num_encoder_input_tokens)
            except ValueError as e:
                raise InputError(str(e), "multi_modal_data") from None
        max_tokens = self.resolve_max_tokens(len(ids), params.max_tokens)
        if params.min_tokens > max_tokens:
            raise InputError(
                f"min_tokens ({params.min_tokens}) must be at most max_tokens ({max_tokens})", "min_tokens"
            )
        return text, EngineCoreRequest(
            request_id=str(request_id),
            prompt_token_ids=ids,
            params=params,
            max_tokens=max_tokens,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            priority=int(priority),
            client_index=client_index,
            lora_request=lora_request,
            mm_items=items,
            mrope_positions=mrope[0] if mrope is not None else None,
            mrope_delta=mrope[1] if mrope is not None else 0,
        )

    def process_pooling(
        self,
        request_id: str,
        prompt: PromptType,
        pooling: PoolingParams,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        client_index: int = 0,
    ) -> tuple[str | None, EngineCoreRequest]:
        """An embedding request: the prompt's pooled hidden states, no tokens generated (the core runs
        it as a prefill that finishes with its last prompt chunk)."""
        if self.task == "generate":
            raise InputError("this model is served for generation (--task generate): no embeddings", "model")
        text, ids = self.tokenize(prompt)
        if not ids:
            raise InputError("the input is empty (0 tokens)", "input")
        if len(ids) >= self.max_model_len:
            raise InputError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your input has "
                f"{len(ids)} tokens (inputs must be shorter than max_model_len {self.max_model_len}).",
                "input",
                "context_length_exceeded",
            )
        dims = pooling.dimensions
        if dims is not None and self.embedding_size and dims > self.embedding_size:
            raise InputError(
                f"dimensions ({dims}) is larger than the model's embedding size ({self.embedding_size})",
                "dimensions",
            )
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        return text, EngineCoreRequest(
            request_id=str(request_id),
            prompt_token_ids=ids,
            params=params,
            max_tokens=1,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            priority=int(priority),
            client_index=client_index,
            pooling=pooling,  # unset fields take the engine's defaults in the core
        )


def chat_template_ids(
    tokenizer: Any, model_name: str, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any
) -> list[int]:
    """`messages` through the tokenizer's chat template, as token ids (the template adds its own special
    tokens); ValueError when the tokenizer has none."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the tokenizer of {model_name} has no chat template")
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
    )
    return list(tokenizer.encode(text, add_special_tokens=False))
