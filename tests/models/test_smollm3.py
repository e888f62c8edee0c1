"""SmolLM3 (Llama's layer with no rotary embedding on every 4th layer, `no_rope_layers`) against HF
transformers, float32: logits plain and paged, greedy ids through the engine with chunked prefill, prefix
hits and preemption, with and without a sliding window on the NoPE layers. The family is one model file
and one registry line: its description is Llama's with no `Rope` op on the NoPE layers (the CPU decode
step replays it: tests/models/test_cpu_decode_families.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedrs.models.layer_desc import Rope
from pagedrs.models.smollm3 import SmolLM3ForCausalLM
from tests.helpers import make_tiny_model
from tests.models.helpers_families import (
    WINDOW,
    assert_engine_greedy_matches_hf,
    hf_reference,
    smollm3_config,
)
from tests.models.helpers_hf import assert_matches_hf, random_prompts

VARIANTS = {"nope": {}, "nope-window": {"use_sliding_window": True, "sliding_window": WINDOW}}


@pytest.fixture(scope="module", params=list(VARIANTS))
def smollm3(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(
        tmp_path_factory.mktemp(request.param) / "m", smollm3_config(**VARIANTS[request.param])
    )


def test_smollm3_logits_match_hf(smollm3: Path) -> None:
    assert_matches_hf(smollm3, random_prompts([20, 10, 17]), chunk=5)


def test_smollm3_engine_greedy_matches_hf(smollm3: Path) -> None:
    assert_engine_greedy_matches_hf(smollm3, hf_reference(smollm3))


def test_smollm3_nope_layers_have_no_rotary() -> None:
    model = SmolLM3ForCausalLM(smollm3_config(), dtype=torch.float32, device="cpu")
    ropes = [sum(isinstance(op, Rope) for op in layer) for layer in model.model.desc.layers]
    assert ropes == [1, 1, 1, 0]
    windowed = SmolLM3ForCausalLM(
        smollm3_config(use_sliding_window=True, sliding_window=WINDOW), dtype=torch.float32, device="cpu"
    )
    windows = [layer.self_attn.attn.sliding_window for layer in windowed.model.layers]
    assert windows == [None, None, None, WINDOW] and windowed.sliding_window == WINDOW
