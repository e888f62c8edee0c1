"""The all-greedy verification path (`greedy_with_drafts`) against the general one (`sample_with_drafts`)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from pagedrs import SamplingParams
from pagedrs.layers.sampler import Sampler
from pagedrs.runner.outputs import RunnerOutput
from pagedrs.spec_decode.verifier import first_rows, greedy_with_drafts, sample_with_drafts


def test_greedy_fast_path_equals_the_general_verifier() -> None:
    nd = np.array([3, 0, 4, 1, 0, 2], dtype=np.int64)  # drafts per sequence; 0: not speculating
    logits = torch.randn(int((nd + 1).sum()), 1003, generator=torch.Generator().manual_seed(0)) * 4
    starts = first_rows(nd)
    best = logits.argmax(dim=-1).numpy()
    keep = {0: 3, 2: 2, 3: 0, 5: 2}  # drafts that equal their row's argmax, then one that does not
    drafts = np.array(
        [
            best[starts[i] + j] if j < keep[i] else (best[starts[i] + j] + 1) % 1003
            for i in keep
            for j in range(nd[i])
        ],
        dtype=np.int64,
    )
    plan = SimpleNamespace(num_draft_tokens=nd)

    fast = RunnerOutput(np.zeros(0, dtype=np.int64), None, {})
    greedy_with_drafts(fast, plan, logits, drafts)  # type: ignore[arg-type]

    first = Sampler.greedy(logits[torch.as_tensor(starts)], None)
    general = RunnerOutput(first.sampled_token_ids.numpy(), None, {})
    general.sampled_logprobs = first.sampled_logprobs.numpy()  # type: ignore[union-attr]
    rows = [SimpleNamespace(params=SamplingParams(temperature=0.0), generator=None) for _ in nd]
    sample_with_drafts(general, plan, rows, logits, drafts, None)  # type: ignore[arg-type]

    assert fast.token_counts is not None and general.token_counts is not None
    assert fast.token_counts.tolist() == [4, 1, 3, 1, 1, 3] == general.token_counts.tolist()
    assert np.array_equal(fast.sampled_token_ids, general.sampled_token_ids)
    assert fast.sampled_logprobs is not None and general.sampled_logprobs is not None
    assert np.array_equal(fast.sampled_logprobs, general.sampled_logprobs)
    ref = logits.log_softmax(dim=-1)
    rows_used = np.concatenate([np.arange(s, s + c) for s, c in zip(starts, fast.token_counts, strict=True)])
    want = ref[torch.as_tensor(rows_used), torch.as_tensor(fast.sampled_token_ids)].numpy()
    np.testing.assert_allclose(fast.sampled_logprobs, want, rtol=1e-5, atol=1e-5)
