"""The engine core's per-request state: a request and its n samples as the sampler sees them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from pagedrs import _core
from pagedrs.pooling_params import PoolingParams
from pagedrs.sampling_params import SamplingParams

__all__ = ["CoreRequest", "CoreSeq"]


class CoreSeq:
    """One of a request's n samples as the sampler sees it (`SamplingRow`)."""

    __slots__ = (
        "seq_id",
        "index",
        "request_id",
        "params",
        "generator",
        "prompt_token_ids",
        "_scheduler",
        "is_simple_greedy",
        "num_logprobs",
        "matcher",
    )

    def __init__(
        self,
        seq_id: int,
        index: int,
        request_id: str,
        params: SamplingParams,
        prompt: list[int],
        dev: Any,
        scheduler: _core.Scheduler,
    ) -> None:
        self.seq_id = seq_id
        self.index = index
        self.request_id = request_id
        self.params = params
        self.generator: torch.Generator | None = None
        if params.seed is not None and params.temperature > 0:
            self.generator = torch.Generator(device=dev)
            self.generator.manual_seed(params.seed)
        self.prompt_token_ids: Sequence[int] = prompt
        self.matcher: Any = None  # an xgrammar GrammarMatcher (structured outputs)
        # The sampled tokens are kept once in the core, by the scheduler (stop checks, recompute after
        # preemption, prefix hashes); penalties, min_tokens and the token-box picture read them there.
        self._scheduler = scheduler
        self.num_logprobs = params.logprobs
        self.is_simple_greedy = (
            params.temperature == 0.0
            and not params.needs_penalties
            and not params.logit_bias
            and params.min_tokens == 0
            and params.logprobs is None
        )

    @property
    def output_token_ids(self) -> list[int]:
        """The tokens sampled so far (a copy, read from the scheduler; the sequence must be live)."""
        return self._scheduler.output_token_ids(self.seq_id)

    @property
    def num_output_tokens(self) -> int:
        return self._scheduler.num_output_tokens(self.seq_id)


class CoreRequest:
    """A request in the core: its samples, what it still wants, and its pooling state (embeddings)."""

    __slots__ = (
        "request_id",
        "seqs",
        "prompt_logprobs",
        "unscheduled",
        "live",
        "pooling",
        "pool_acc",
        "pool_n",
        "has_images",
    )

    def __init__(
        self,
        request_id: str,
        seqs: list[CoreSeq],
        prompt_logprobs: int | None,
        pooling: PoolingParams | None = None,
        *,
        has_images: bool = False,
    ) -> None:
        self.request_id = request_id
        self.has_images = has_images  # the runner holds its images until the request is dropped
        self.seqs = seqs
        self.prompt_logprobs = prompt_logprobs  # top-k wanted, until the prompt is done
        self.unscheduled = True
        self.live = {s.seq_id for s in seqs}
        self.pooling = pooling  # PoolingParams of an embedding request
        self.pool_acc: torch.Tensor | None = None  # mean: sum of positions [0, pool_n); first: position 0
        self.pool_n = 0
