"""The drafter registry and protocol: every method the config accepts has a drafter, the scheduler gets
each method's settings from it, and a drafter the runner has never seen, registered under a method
name, drives speculative decoding through the protocol alone (greedy ids as without speculation, its
drafts verified and accepted)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import numpy as np
import pytest
import torch

from pagedrs import LLM, SamplingParams
from pagedrs.config import SPEC_METHODS, SpeculativeConfig
from pagedrs.spec_decode import DRAFTERS, DrafterContext, Proposal, StepContext
from pagedrs.spec_decode.policy import spec_scheduler_args
from pagedrs.spec_decode.substep import speculating_rows
from tests.helpers import make_tiny_llama

ENGINE = dict(device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=16, max_num_seqs=4)


def test_every_method_has_a_drafter_and_its_scheduler_settings() -> None:
    assert set(DRAFTERS) == set(SPEC_METHODS)
    got = {}
    for method in SPEC_METHODS:
        spec = SpeculativeConfig(method, 5, model="d" if method == "draft_model" else None)
        config = SimpleNamespace(speculative=spec, scheduler=SimpleNamespace(max_num_batched_tokens=4))
        args = spec_scheduler_args(config)  # type: ignore[arg-type]
        assert args["num_speculative_tokens"] == 3  # capped by the token budget
        got[method] = (args["spec_method"], args["spec_disable_batch_size"])
    assert got == {"ngram": ("ngram", 8), "self_draft": ("runner", 1), "draft_model": ("runner", 1)}
    config = SimpleNamespace(speculative=None, scheduler=None)
    assert spec_scheduler_args(config) == {}  # type: ignore[arg-type]


class OracleDrafter:
    """A drafter from outside the package: proposes the continuation `tokens` (one prompt's greedy ids,
    prompt first) from each speculating sequence's position on."""

    tokens: list[int] = []
    contexts: list[StepContext] = []
    scheduler_method: ClassVar[str] = "runner"
    default_disable_by_batch_size: ClassVar[int] = 8
    kv_bytes_per_block = 0

    def __init__(self, context: DrafterContext) -> None:
        self.context = context

    def init_kv_cache(self, num_blocks: int, num_swap_blocks: int) -> None:
        pass

    def apply_plan_ops(self, plan: object) -> None:
        pass

    def apply_plan_shrink(self, plan: object) -> None:
        pass

    def runs(self, plan: object) -> bool:
        return bool(plan.has_drafts)  # type: ignore[attr-defined]

    def propose(self, step: StepContext) -> Proposal:
        OracleDrafter.contexts.append(step)
        plan = step.plan
        nd = np.asarray(plan.num_draft_tokens, dtype=np.int64)
        spec = np.nonzero(nd)[0]
        _, first = speculating_rows(plan, spec)
        known = self.tokens + [0] * 64
        drafts, where = [], []
        for f, d in zip(first.tolist(), nd[spec].tolist(), strict=True):
            pos = int(plan.positions[f])
            drafts += known[pos + 1 : pos + 1 + d]
            where += range(f + 1, f + 1 + d)
        ids = step.inputs.input_ids
        ids.index_copy_(
            0, torch.as_tensor(where, device=ids.device), torch.as_tensor(drafts, device=ids.device)
        )
        return Proposal(np.array(drafts, dtype=np.int64))


def test_a_new_drafter_is_one_registration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = make_tiny_llama(tmp_path)
    prompt = [5, 9, 3, 17, 2, 11]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = LLM(str(folder), **ENGINE)  # type: ignore[arg-type]
    want = list(plain.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].token_ids)
    monkeypatch.setitem(DRAFTERS, "self_draft", OracleDrafter)  # any accepted method name
    monkeypatch.setattr(OracleDrafter, "tokens", prompt + want)
    monkeypatch.setattr(OracleDrafter, "contexts", [])
    spec = {"method": "self_draft", "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(str(folder), speculative_config=spec, **ENGINE)  # type: ignore[arg-type]
    runner = llm.llm_engine.runner
    assert isinstance(runner.drafter, OracleDrafter) and runner.drafter.context.target is runner.model
    got = list(llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].token_ids)
    assert got == want
    stats = llm.llm_engine.get_stats()
    assert stats.spec_num_draft_tokens > 0
    assert stats.spec_num_accepted_tokens >= 0.9 * stats.spec_num_draft_tokens, stats
    assert OracleDrafter.contexts
    step = OracleDrafter.contexts[-1]
    assert runner.kv_pool is not None and step.kv_caches is runner.kv_pool.kv_caches
