"""Engine test fixtures: tiny random models, HF greedy references, engines and a step-plan spy."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pagedrs import EngineArgs, LLMEngine, RequestOutput, SamplingParams
from tests.helpers import load_hf_model, make_tiny_llama

TINY_ARCHS = ("llama", "qwen2", "mistral")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_llama(root, arch=arch, seed=i) for i, arch in enumerate(TINY_ARCHS)}


class HFReference:
    """Greedy continuations by HF transformers (float32, batch of one, no eos stop), cached."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.cache: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def __call__(self, prompt: list[int], max_tokens: int) -> list[int]:
        key = (tuple(prompt), max_tokens)
        if key not in self.cache:
            ids = torch.tensor([prompt])
            with (
                torch.inference_mode()
            ):  # eos_token_id=[]: never stop early (None falls back to the config's)
                out = self.model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    do_sample=False,
                    max_new_tokens=max_tokens,
                    eos_token_id=[],
                    pad_token_id=0,
                )
            self.cache[key] = out[0, len(prompt) :].tolist()
        return self.cache[key]


@pytest.fixture(scope="session")
def hf_refs(tiny_models: dict[str, Path]) -> dict[str, HFReference]:
    return {arch: HFReference(load_hf_model(path)) for arch, path in tiny_models.items()}


def random_prompts(lengths: list[int], seed: int = 0, vocab: int = 256) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


@dataclass
class PlanRecord:
    req_ids: list[int]
    num_scheduled: list[int]
    num_computed: list[int]
    num_prompt: list[int]
    sampled_seq_ids: list[int]
    logits_indices: list[int]
    num_swap_out: int
    num_swap_in: int
    num_copies: int
    num_moves: int
    preempted: list[int]
    num_blocks: int


@dataclass
class PlanSpy:
    """Wraps the engine's executor.execute (one device or tensor-parallel) and records every plan."""

    plans: list[PlanRecord] = field(default_factory=list)

    def attach(self, engine: LLMEngine) -> PlanSpy:
        executor = engine.engine_core.executor
        inner = executor.execute

        def execute(plan: Any, *args: Any, **kwargs: Any) -> Any:
            self.plans.append(
                PlanRecord(
                    req_ids=plan.req_ids.tolist(),
                    num_scheduled=plan.num_scheduled_tokens.tolist(),
                    num_computed=plan.num_computed_tokens.tolist(),
                    num_prompt=plan.num_prompt_tokens.tolist(),
                    sampled_seq_ids=plan.sampled_seq_ids.tolist(),
                    logits_indices=plan.logits_indices.tolist(),
                    num_swap_out=len(plan.swap_out),
                    num_swap_in=len(plan.swap_in),
                    num_copies=len(plan.copies),
                    num_moves=len(plan.block_moves),
                    preempted=plan.preempted.tolist(),
                    num_blocks=int(plan.num_blocks),
                )
            )
            return inner(plan, *args, **kwargs)

        executor.execute = execute  # type: ignore[method-assign]
        return self

    @property
    def chunked_prefills(self) -> int:
        """Prefill chunks that stopped short of the end of the prompt."""
        return sum(
            1
            for p in self.plans
            for c, n, np_ in zip(p.num_computed, p.num_scheduled, p.num_prompt, strict=True)
            if c + n < np_
        )

    @property
    def swap_outs(self) -> int:
        return sum(p.num_swap_out for p in self.plans)

    @property
    def swap_ins(self) -> int:
        return sum(p.num_swap_in for p in self.plans)

    @property
    def preemptions(self) -> int:
        return sum(len(p.preempted) for p in self.plans)

    @property
    def copies(self) -> int:
        return sum(p.num_copies for p in self.plans)

    @property
    def max_batch(self) -> int:
        return max((len(p.req_ids) for p in self.plans), default=0)


def make_engine(model: str | Path | None, **kwargs: Any) -> LLMEngine:
    kwargs.setdefault("disable_log_stats", True)
    kwargs.setdefault("device", "cpu")
    return LLMEngine.from_engine_args(EngineArgs(model=None if model is None else str(model), **kwargs))


def engine_from_loaded(loaded: Any, **kwargs: Any) -> LLMEngine:
    """A fresh engine (own KV pool and scheduler) over an already loaded model."""
    kwargs.setdefault("disable_log_stats", True)
    kwargs.setdefault("device", "cpu")
    max_len = int(getattr(loaded.model, "max_position", 0) or loaded.hf_config.max_position_embeddings)
    args = EngineArgs(model=loaded.model_path, **kwargs)
    return LLMEngine(args.create_engine_config(max_len), loaded, max_logprobs=args.max_logprobs)


def run_all(engine: LLMEngine, max_steps: int = 100_000) -> dict[str, RequestOutput]:
    """Step until every request finished; the final output of each."""
    final: dict[str, RequestOutput] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return final
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    raise AssertionError(f"engine did not finish within {max_steps} steps")


def assert_pool_free(engine: LLMEngine) -> None:
    stats = engine.get_stats()
    assert not engine.has_unfinished_requests()
    assert stats.num_running == stats.num_waiting == stats.num_swapped == 0, stats
    assert stats.num_free_blocks == stats.num_blocks, stats
    assert stats.num_free_swap_blocks == stats.num_swap_blocks, stats


def greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


@pytest.fixture
def seeded() -> Iterator[None]:
    state = torch.random.get_rng_state()
    torch.manual_seed(0)
    np.random.seed(0)
    yield
    torch.random.set_rng_state(state)
