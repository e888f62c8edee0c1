"""A from-scratch SamplingMetadata builder for tests: what the engine's incremental one must equal."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from pagedrs.layers.sampler import GREEDY_EPS, SamplingMetadata, SamplingRow, padded_token_ids


def metadata_from_rows(
    rows: Sequence[SamplingRow],
    *,
    vocab_size: int,
    device: torch.device,
    eos_token_ids: Sequence[int] = (),
    default_generator: torch.Generator | None = None,
) -> SamplingMetadata:
    """SamplingMetadata rebuilt from scratch over `rows`: the oracle the engine's persistent builder
    (`SamplingState.metadata`) is tested against, and the sampler tests' way to make a batch."""
    n = len(rows)
    if all(r.is_simple_greedy for r in rows):
        return SamplingMetadata.greedy(n)
    params = [r.params for r in rows]
    meta = SamplingMetadata(num_rows=n, all_greedy=all(p.temperature < GREEDY_EPS for p in params))
    meta.default_generator = default_generator

    def col(values: list, dtype: torch.dtype) -> Tensor:
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    if not meta.all_greedy:
        meta.temperature = col([p.temperature for p in params], torch.float32)
        meta.random_rows_cpu = np.array(
            [i for i, p in enumerate(params) if p.temperature >= GREEDY_EPS], dtype=np.int64
        )
        meta.random_rows = torch.from_numpy(meta.random_rows_cpu).to(device, non_blocking=True)
        if any(p.top_k > 0 for p in params):
            top_k = [p.top_k if p.top_k > 0 else vocab_size for p in params]
            meta.top_k = col(top_k, torch.int64)
            meta.top_k_max = max((k for k in top_k if k < vocab_size), default=1)
        if any(p.top_p < 1.0 for p in params):
            meta.top_p = col([p.top_p for p in params], torch.float32)
        if any(p.min_p > 0.0 for p in params):
            meta.min_p = col([p.min_p for p in params], torch.float32)
        meta.generators = {i: r.generator for i, r in enumerate(rows) if r.generator is not None}
    if any(p.needs_penalties for p in params):
        meta.presence_penalties = col([p.presence_penalty for p in params], torch.float32)
        meta.frequency_penalties = col([p.frequency_penalty for p in params], torch.float32)
        meta.repetition_penalties = col([p.repetition_penalty for p in params], torch.float32)
        pen = [i for i, p in enumerate(params) if p.needs_penalties]
        prompts = padded_token_ids(n, {i: rows[i].prompt_token_ids for i in pen}, vocab_size)
        outputs = padded_token_ids(n, {i: rows[i].output_token_ids for i in pen}, vocab_size)
        meta.prompt_token_ids = torch.from_numpy(prompts).to(device)
        meta.output_token_ids = torch.from_numpy(outputs).to(device)
    ban_rows: list[int] = []
    ban_ids: list[int] = []
    bias_rows: list[int] = []
    bias_ids: list[int] = []
    bias_vals: list[float] = []
    for i, (r, p) in enumerate(zip(rows, params, strict=True)):
        if p.min_tokens and len(r.output_token_ids) < p.min_tokens:
            stops = set(p.stop_token_ids or ())
            if not p.ignore_eos:
                stops.update(eos_token_ids)
            ids = [t for t in stops if 0 <= t < vocab_size]
            ban_rows += [i] * len(ids)
            ban_ids += ids
        if p.logit_bias:
            for t, b in p.logit_bias.items():
                if 0 <= t < vocab_size:
                    bias_rows.append(i)
                    bias_ids.append(t)
                    bias_vals.append(b)
    if ban_rows:
        meta.banned = (col(ban_rows, torch.int64), col(ban_ids, torch.int64))
    if bias_rows:
        meta.bias = (
            col(bias_rows, torch.int64),
            col(bias_ids, torch.int64),
            col(bias_vals, torch.float32),
        )
    nums = [p.logprobs for p in params if p.logprobs is not None]
    meta.max_num_logprobs = min(max(nums), vocab_size) if nums else None
    return meta
