"""Qwen3, Gemma 2 and Gemma 3 from GGUF files written as llama.cpp writes them (tests/models/
helpers_gguf_families.py): with dtype float32 the logits equal HF transformers' own GGUF load and the
engine's greedy ids equal HF's (chunked prefill, prefix hits and preemption forced on); the default load
keeps the matrices quantized; the tokenizer adds BOS where the file asks for it, as HF's does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from pagedrs.layers.quantized import QuantizedWeight
from pagedrs.loader import load_model
from pagedrs.loader.gguf import hf_tensor_name
from tests.engine.conftest import HFReference
from tests.helpers import BOS_ID, logits_of, make_tiny_model
from tests.models.helpers_families import (
    assert_engine_greedy_matches_hf,
    gemma2_config,
    gemma3_config,
    qwen3_config,
)
from tests.models.helpers_gguf_families import hf_gguf_model, write_family_gguf

# Settings transformers' GGUF config reader takes from the file or whose defaults match the model: head_dim
# 128 for Qwen3 (its reader ignores key_length), Gemma 2's default caps and query_pre_attn_scalar.
CONFIGS = {
    "qwen3": lambda: qwen3_config(head_dim=128, tie_word_embeddings=True),
    "gemma2": lambda: gemma2_config(
        query_pre_attn_scalar=256, attn_logit_softcapping=50.0, final_logit_softcapping=30.0
    ),
    "gemma3": lambda: gemma3_config(rope_parameters=None),  # local base 10k, global 1M (the defaults)
}
IDS = list(range(5, 60, 3))


@pytest.fixture(scope="module", params=list(CONFIGS))
def gguf_file(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Path, transformers.PreTrainedModel]:
    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    src = make_tiny_model(root / "src", CONFIGS[arch]())
    path = write_family_gguf(src, root / f"tiny-{arch}.gguf", arch)
    return arch, path, hf_gguf_model(path)


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDRS_CACHE", str(tmp_path / "cache"))


def test_float32_matches_hf_gguf_load(gguf_file) -> None:
    arch, path, hf = gguf_file
    loaded = load_model(str(path), dtype="float32")
    assert type(loaded.model).__name__ == type(hf).__name__
    with torch.no_grad():
        ref = hf(torch.tensor([IDS])).logits[0]
    torch.testing.assert_close(logits_of(loaded, IDS), ref, atol=1e-4, rtol=1e-4)
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ours = loaded.tokenizer("ab cd").input_ids
    assert ours == hf_tok("ab cd").input_ids
    assert (ours[0] == BOS_ID) == arch.startswith("gemma")  # the Gemma files set add_bos_token


# The tiny Gemma 3 has only sliding layers: its window pools hold a request's live blocks with fewer
# blocks than a full pool, so a smaller pool forces the preemption.
POOL_BLOCKS = {"gemma3": 10}


def test_engine_greedy_matches_hf_gguf_load(gguf_file) -> None:
    arch, path, hf = gguf_file
    hf.generation_config.eos_token_id = None
    assert_engine_greedy_matches_hf(path, HFReference(hf), num_kv_blocks=POOL_BLOCKS.get(arch, 14))


def test_default_load_keeps_weights_quantized(gguf_file) -> None:
    """Q8_0 matrices stay in their blocks on the CPU; the logits stay within a few percent of HF's."""
    _, path, hf = gguf_file
    loaded = load_model(str(path))
    assert sum(isinstance(getattr(m, "qweight", None), QuantizedWeight) for m in loaded.model.modules()) >= 8
    with torch.no_grad():
        ref = hf(torch.tensor([IDS])).logits[0]
    got = logits_of(loaded, IDS)
    assert (got - ref).norm() / ref.norm() < 0.05


def test_gemma_tensor_names() -> None:
    """llama.cpp's Gemma names: ffn_norm is the norm before the MLP there, after attention in Llama."""
    assert (
        hf_tensor_name("blk.3.ffn_norm.weight", "gemma3") == "model.layers.3.pre_feedforward_layernorm.weight"
    )
    assert (
        hf_tensor_name("blk.3.ffn_norm.weight", "qwen3") == "model.layers.3.post_attention_layernorm.weight"
    )
    assert hf_tensor_name("blk.0.post_attention_norm.weight", "gemma2") == (
        "model.layers.0.post_attention_layernorm.weight"
    )
    assert (
        hf_tensor_name("blk.1.post_ffw_norm.weight", "gemma2")
        == "model.layers.1.post_feedforward_layernorm.weight"
    )
    assert hf_tensor_name("blk.1.attn_k_norm.weight", "qwen3") == "model.layers.1.self_attn.k_norm.weight"


def test_unsupported_gguf_architecture_names_the_supported(tmp_path: Path) -> None:
    import gguf
    import numpy as np

    path = tmp_path / "falcon.gguf"
    w = gguf.GGUFWriter(str(path), "falcon")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="'falcon'; supported: .*gemma2, gemma3, .*qwen3"):
        load_model(str(path))
