"""A Gemma 4 GGUF file's `gemma4.rope.dimension_count` / `rope.dimension_count_swa` (llama.cpp's `n_rot`:
the leading dims of a head that RoPE rotates, frequencies over those dims, the global layers' pairs
masked by `rope_freqs`) are honoured: on a tiny file rotating half of each head, each layer type's rotary
embedding equals a ggml-style neox rotation written out here, and the logits differ from the same weights
rotating whole heads; a count the head cannot hold is refused, naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from pagedrs.loader import load_model
from tests.helpers import logits_of
from tests.models.helpers_gemma4 import gemma4_config
from tests.models.helpers_gguf_hybrid import write_gemma4_gguf

IDS = list(range(5, 40, 3))
LOCAL, GLOBAL = 16, 32  # gemma4_config's head sizes; a quarter of the global head's pairs rotate


def _ggml_neox(x: torch.Tensor, pos: torch.Tensor, n_rot: int, base: float, pairs: int) -> torch.Tensor:
    """ggml_rope_ext in neox mode on x [T, heads, D]: dims i and i + n_rot/2 (i < n_rot/2) rotate by
    pos * base^(-2i/n_rot) / freq_factor[i] (freq_factor 1 for the first `pairs`, 1e30 after)."""
    half = n_rot // 2
    i = torch.arange(half, dtype=torch.float64)
    factor = torch.where(i < pairs, 1.0, 1e30)
    theta = pos[:, None].double() * base ** (-2 * i / n_rot) / factor
    cos, sin = theta.cos()[:, None, :], theta.sin()[:, None, :]
    xd = x.double()
    out = xd.clone()
    x1, x2 = xd[..., :half], xd[..., half:n_rot]
    out[..., :half], out[..., half:n_rot] = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    return out.float()


@pytest.fixture(scope="module")
def hf() -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(gemma4_config(), dtype=torch.float32).eval()


def test_rope_dimension_counts_are_honoured(hf: transformers.PreTrainedModel, tmp_path: Path) -> None:
    config = gemma4_config()
    half = write_gemma4_gguf(hf, config, tmp_path / "half.gguf", rope_dims=(GLOBAL // 2, LOCAL // 2))
    whole = write_gemma4_gguf(hf, config, tmp_path / "whole.gguf")
    loaded = load_model(str(half), dtype="float32")
    ropes = loaded.model.model.rotary_embs
    theta = config.rope_parameters
    pos = torch.tensor([0, 1, 7, 30])
    for kind, n_rot, head, pairs in (
        ("sliding_attention", LOCAL // 2, LOCAL, LOCAL // 4),  # default RoPE: every pair of n_rot rotates
        ("full_attention", GLOBAL // 2, GLOBAL, GLOBAL // 8),  # 4 pairs of the head's 16, as rope_freqs
    ):
        rope = ropes[kind]
        assert rope.rotary_dim == n_rot, kind
        q, k = torch.randn(4, 4 * head), torch.randn(4, 2 * head)
        want_q = _ggml_neox(q.view(4, 4, head), pos, n_rot, theta[kind]["rope_theta"], pairs)
        want_k = _ggml_neox(k.view(4, 2, head), pos, n_rot, theta[kind]["rope_theta"], pairs)
        got_q, got_k = rope(pos, q.clone(), k.clone())
        torch.testing.assert_close(got_q.view(4, 4, head), want_q, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_k.view(4, 2, head), want_k, atol=1e-5, rtol=1e-5)
    got, base = logits_of(loaded, IDS), logits_of(load_model(str(whole), dtype="float32"), IDS)
    assert torch.isfinite(got).all()
    assert (got - base).abs().max() > 1e-3  # the rotated dims change what the model computes


def test_rope_dimension_count_larger_than_the_head_is_refused(
    hf: transformers.PreTrainedModel, tmp_path: Path
) -> None:
    bad = write_gemma4_gguf(hf, gemma4_config(), tmp_path / "bad.gguf", rope_dims=(GLOBAL, LOCAL + 2))
    with pytest.raises(ValueError, match="gemma4.rope.dimension_count_swa=18"):
        load_model(str(bad), dtype="float32")
