"""Speculative decoding on Gemma 2 (attention and final logit soft-capping, a sliding window shorter than
every prompt), Qwen3 (q/k norms, head_dim != hidden / heads) and Mixtral (top-2 of 8 experts): greedy
ids with n-gram lookup and with a draft model (the target itself, and a 1-layer model of the same family
and vocabulary) equal the ids without speculation and HF transformers' greedy ids, float32; drafts
checked to have been proposed and accepted."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file, save_file

from tests.engine.conftest import HFReference, assert_pool_free, greedy, make_engine, random_prompts, run_all
from tests.helpers import make_tiny_model
from tests.models.helpers_families import WINDOW, gemma2_config, hf_reference, qwen3_config
from tests.models.helpers_moe import mixtral_config

MAX_TOKENS = 20
K = 3  # drafts per step

FAMILIES: dict[str, Callable[..., Any]] = {
    "gemma2": gemma2_config,
    "qwen3": qwen3_config,
    "mixtral": mixtral_config,
}


def _spec(cfg: dict[str, Any]) -> dict[str, Any]:
    # Speculate at every batch size, with the most drafts every step.
    return {"num_speculative_tokens": K, "disable_by_batch_size": 64, "adaptive": False, **cfg}


NGRAM = {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def _run(folder: Path, prompts: list[list[int]], spec: dict[str, Any] | None) -> tuple[list[list[int]], Any]:
    engine = make_engine(folder, dtype="float32", block_size=4, speculative_config=spec)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, greedy(MAX_TOKENS))
    outs = run_all(engine)
    stats = engine.get_stats()
    assert_pool_free(engine)
    return [list(outs[str(i)].outputs[0].token_ids) for i in range(len(prompts))], stats


def _first_layer_of(target: Path, folder: Path, config: Any) -> Path:
    """A 1-layer draft of the same family and vocabulary: the target's embeddings, first layer, final norm
    and head (a random 1-layer model rarely agrees with a random target)."""
    make_tiny_model(folder, config)
    state = load_file(str(target / "model.safetensors"))
    kept = {k: v for k, v in state.items() if not re.search(r"\.layers\.[1-9]\d*\.", k)}
    save_file(kept, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def _lookup(context: list[int]) -> list[int]:
    """Prompt lookup as the scheduler does it: the tokens after the latest earlier occurrence of the
    context's last 3, else 2, else 1 tokens."""
    for n in (3, 2, 1):
        tail = context[-n:]
        for j in range(len(context) - n - 1, -1, -1):
            if context[j : j + n] == tail:
                return context[j + n : j + n + K]
    return []


def _lookup_prompts(ref: HFReference, count: int) -> list[list[int]]:
    """Prompts longer than the window whose greedy continuation (by HF) has a step where prompt lookup's
    first draft is the model's next token, so n-gram drafts get accepted (random tiny models rarely repeat
    themselves): among starts `s` with the model's continuation `c` echoed (`s c s c[:2]`), and `s[:5]`
    three times."""
    found = []
    for seed in range(40):
        start = random_prompts([WINDOW + 2 + seed % 5], seed=100 + seed)[0]
        cont = ref(start, 10)
        for prompt in ([*start, *cont, *start, *cont[:2]], start[:5] * 3):
            out = ref(prompt, MAX_TOKENS)
            # from the second token on: the first is sampled at the end of the prefill, without drafts
            if any(_lookup(prompt + out[:t])[:1] == [out[t]] for t in range(1, len(out))):
                found.append(prompt)
                if len(found) == count:
                    return found
    raise AssertionError(f"only {len(found)} prompts found on which prompt lookup's drafts are accepted")


class Family:
    """A tiny random model of one family, its 1-layer draft, prompts and the reference ids."""

    def __init__(self, root: Path, name: str) -> None:
        config = FAMILIES[name]
        self.folder = make_tiny_model(root / name, config())
        self.small = _first_layer_of(self.folder, root / f"{name}-1layer", config(num_hidden_layers=1))
        ref: HFReference = hf_reference(self.folder)
        self.prompts = _lookup_prompts(ref, 2)
        assert all(len(p) > WINDOW for p in self.prompts)
        self.hf = [ref(p, MAX_TOKENS) for p in self.prompts]
        self.plain, _ = _run(self.folder, self.prompts, None)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Family:
    return Family(tmp_path_factory.mktemp(request.param), request.param)


def test_plain_engine_matches_hf(family: Family) -> None:
    assert family.plain == family.hf


@pytest.mark.parametrize("method", ["ngram", "draft_itself", "draft_1layer"])
def test_speculative_greedy_ids_equal_plain_and_hf(family: Family, method: str) -> None:
    """The target decides every token: ids equal decoding without speculation and HF's. The target as its
    own draft is accepted (nearly) always; the prompts are picked so that some prompt-lookup drafts are."""
    if method == "ngram":
        spec = _spec(NGRAM)
    else:
        draft = family.folder if method == "draft_itself" else family.small
        spec = _spec({"method": "draft_model", "model": str(draft)})
    got, stats = _run(family.folder, family.prompts, spec)
    assert got == family.plain
    assert got == family.hf
    assert stats.spec_num_draft_tokens > 0, stats
    assert 0 < stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens, stats
    if method == "draft_itself":
        assert stats.spec_num_accepted_tokens >= 0.9 * stats.spec_num_draft_tokens, stats
