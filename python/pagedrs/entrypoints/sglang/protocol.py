"""SGLang's native request and response bodies: ``POST /generate`` and ``GET /get_model_info``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from pagedrs.entrypoints.openai.errors import APIError, bad_request
from pagedrs.entrypoints.openai.protocol import (
    MAX_N,
    MAX_SEED,
    OpenAIModel,
    ResponseBody,
    SamplingFields,
    TokenId,
    parse_request,
)


class SGLangSamplingParams(OpenAIModel):
    """SGLang's ``sampling_params`` names and defaults (max_new_tokens 128, temperature 1.0)."""

    max_new_tokens: int = Field(default=128, ge=1, le=2**31 - 1)
    min_new_tokens: int = Field(default=0, ge=0, le=2**31 - 1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1, le=2**31 - 1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=2.0)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=64)
    ignore_eos: bool = False
    n: int = Field(default=1, ge=1, le=MAX_N)
    sampling_seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    def as_openai(self) -> SamplingFields:
        """The same request in the OpenAI fields the engine's sampling params are built from (their
        checks apply; a 400 names the field under ``sampling_params``)."""
        fields: dict[str, Any] = {
            "n": self.n,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "repetition_penalty": self.repetition_penalty,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_new_tokens,
            "seed": self.sampling_seed,
            "guided_json": self.json_schema,
            "guided_regex": self.regex,
            "guided_grammar": self.ebnf,
        }
        try:
            out = parse_request(SamplingFields, {k: v for k, v in fields.items() if v is not None})
            out.check_common()
        except APIError as exc:
            raise in_sampling_params(exc) from None
        return out


# OpenAI's names of the fields SGLang names otherwise
_SGLANG_NAMES = {
    "min_tokens": "min_new_tokens",
    "max_tokens": "max_new_tokens",
    "seed": "sampling_seed",
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_grammar": "ebnf",
}


def in_sampling_params(exc: APIError) -> APIError:
    """A 400 about an OpenAI sampling field, naming the SGLang field under ``sampling_params``."""
    if exc.status != 400:
        return exc
    name = _SGLANG_NAMES.get(exc.param or "", exc.param)
    param = f"sampling_params.{name}" if name else "sampling_params"
    return bad_request(exc.message, param=param, code=exc.code)


class GenerateRequest(OpenAIModel):
    """SGLang's ``POST /generate``: ``text`` or ``input_ids``, one prompt or a batch."""

    text: str | list[str] | None = None
    input_ids: list[TokenId] | list[list[TokenId]] | None = None
    sampling_params: SGLangSamplingParams | list[SGLangSamplingParams] | None = None
    stream: bool = False
    rid: str | list[str] | None = None

    def check(self) -> None:
        if (self.text is None) == (self.input_ids is None):
            raise bad_request("give exactly one of text or input_ids", param="text")
        prompts = self.prompts()
        if not prompts or len(prompts) > 1024:
            raise bad_request(
                "give 1 to 1024 prompts", param="text" if self.text is not None else "input_ids"
            )
        if isinstance(self.sampling_params, list) and len(self.sampling_params) != len(prompts):
            raise bad_request(
                f"sampling_params has {len(self.sampling_params)} entries for {len(prompts)} prompts",
                param="sampling_params",
            )
        if sum(p.n for p in self.params_per_prompt()) > 1024:
            raise bad_request(
                "too many outputs: prompts times n must be at most 1024", param="sampling_params"
            )

    def is_batch(self) -> bool:
        """A list of prompts (or n > 1) is answered with a list; one prompt with one object."""
        if isinstance(self.text, list):
            return True
        ids = self.input_ids
        if ids and isinstance(ids[0], list):
            return True
        return any(p.n > 1 for p in self.params_per_prompt())

    def prompts(self) -> list[str | list[int]]:
        if isinstance(self.text, str):
            return [self.text]
        if self.text is not None:
            return list(self.text)
        ids = self.input_ids or []
        if ids and all(isinstance(t, int) for t in ids):
            return [[int(t) for t in ids if isinstance(t, int)]]
        return [list(p) for p in ids if isinstance(p, list)]

    def params_per_prompt(self) -> list[SGLangSamplingParams]:
        sp = self.sampling_params
        if isinstance(sp, list):
            return sp
        return [sp or SGLangSamplingParams()] * len(self.prompts())


class FinishReason(ResponseBody):
    """SGLang's finish reason: {"type": "stop", "matched": the stop token id or string},
    {"type": "length", "length": max_new_tokens} or {"type": "abort", "message": ...}."""

    type: Literal["stop", "length", "abort"]
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None


class MetaInfo(ResponseBody):
    id: str
    finish_reason: FinishReason | None = None  # None while a stream runs
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache
    e2e_latency: float | None = None


class GenerateResponse(ResponseBody):
    """One output; a batch (or n > 1) answers a list of them. Streams send one per event, with the
    text so far (SGLang's streams are cumulative)."""

    text: str
    output_ids: list[int]
    meta_info: MetaInfo
    index: int | None = None


class ModelInfo(BaseModel):
    """SGLang's ``GET /get_model_info``."""

    model_path: str
    tokenizer_path: str | None
    is_generation: bool
    preferred_sampling_params: dict[str, Any] | None = None
    weight_version: str = "default"
    max_model_len: int


__all__ = [
    "FinishReason",
    "in_sampling_params",
    "GenerateRequest",
    "GenerateResponse",
    "MetaInfo",
    "ModelInfo",
    "SGLangSamplingParams",
]
