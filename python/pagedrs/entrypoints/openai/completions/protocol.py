"""/v1/completions: the request body (pydantic, validated once at the edge) and the response bodies
/openapi.json documents."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pagedrs.entrypoints.openai.errors import bad_request
from pagedrs.entrypoints.openai.protocol import (
    MAX_LOGPROBS,
    MAX_N,
    ResponseBody,
    SamplingFields,
    TokenId,
    UsageInfo,
    as_prompts,
)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: int | None = Field(16, ge=1, le=2**31 - 1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)

    def check(self) -> None:
        self.check_common()
        if self.suffix:
            raise bad_request("suffix is not supported", param="suffix")
        if self.use_beam_search:
            if self.best_of is not None and self.best_of < self.n:
                raise bad_request(
                    f"best_of ({self.best_of}) must be at least n ({self.n}) with use_beam_search",
                    param="best_of",
                )
        elif self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of other than n is not supported", param="best_of")
        prompts = self.prompts()
        if not prompts:
            raise bad_request("prompt must not be empty", param="prompt")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise bad_request(
                    "prompt must not be empty", param="prompt" if len(prompts) == 1 else f"prompt[{i}]"
                )
        if len(prompts) * self.n > 1024:
            raise bad_request("too many choices: len(prompt) * n must be at most 1024", param="n")

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of prompts (strings or token id lists)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            return []
        return as_prompts(p)


class CompletionLogprobs(ResponseBody):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(ResponseBody):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(ResponseBody):
    """A /v1/completions body; each SSE event of a stream is one of these with the new text."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


__all__ = ["CompletionChoice", "CompletionLogprobs", "CompletionRequest", "CompletionResponse"]
