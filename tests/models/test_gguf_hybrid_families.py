"""Qwen3.5 / Qwen3.6 (`qwen35`, `qwen35moe`) and Gemma 4 text (`gemma4`) GGUF files as llama.cpp's converter
writes them (tests/models/helpers_gguf_hybrid.py: its names, Qwen3.5's value-head reorder and A_log / dt_bias /
conv1d / norm transforms, a multi-token-prediction block, Gemma 4's per-layer and shared-KV metadata and
rope_freqs): with dtype float32 the logits equal HF transformers' on the same (rounded) weights and the
engine's greedy ids equal HF's with chunked prefill forced; the default CPU load keeps the Q8_0 matrices
quantized, their blocks exactly HF's weights (rows, and whole blocks of columns, reordered)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from pagedrs.layers.quantized import QuantizedWeight
from pagedrs.loader import load_model
from pagedrs.loader.gguf import hf_tensor_name, iter_gguf_weights
from pagedrs.quantization.gguf_blocks import GGUFWeight
from tests.engine.conftest import HFReference, PlanSpy, greedy, make_engine, random_prompts, run_all
from tests.helpers import BOS_ID, logits_of
from tests.models.helpers_gemma4 import gemma4_config, gemma4_moe_config
from tests.models.helpers_gguf_hybrid import GEMMA4_Q8_0, Q8_0, write_gemma4_gguf, write_qwen35_gguf
from tests.models.helpers_qwen3_5 import qwen3_5_config, qwen3_5_moe_config

IDS = list(range(5, 60, 3))
# value heads of 32 rows: out_proj's Q8_0 columns move by whole blocks
CONFIGS = {
    "qwen35": lambda: qwen3_5_config(linear_value_head_dim=32),
    "qwen35moe": lambda: qwen3_5_moe_config(linear_value_head_dim=32, shared_expert_intermediate_size=64),
}


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDRS_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module", params=list(CONFIGS))
def qwen35_file(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Path, transformers.PreTrainedModel]:
    arch = request.param
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(CONFIGS[arch](), dtype=torch.float32).eval()
    path = write_qwen35_gguf(hf, tmp_path_factory.mktemp(arch) / f"tiny-{arch}.gguf", arch)
    return arch, path, hf


def test_qwen35_float32_logits_and_engine_greedy_match_hf(qwen35_file) -> None:
    arch, path, hf = qwen35_file
    loaded = load_model(str(path), dtype="float32")
    cfg = loaded.model.config
    assert type(loaded.model).__name__ == type(hf).__name__
    assert cfg.layer_types == hf.config.layer_types
    assert cfg.num_hidden_layers == 4  # the multi-token-prediction block is not a layer
    with torch.no_grad():
        ref = hf(torch.tensor([IDS])).logits[0]
    torch.testing.assert_close(logits_of(loaded, IDS), ref, atol=1e-4, rtol=1e-4)
    if arch == "qwen35moe":
        return  # the same hybrid stack as qwen35, checked through the engine below
    # the engine, prompts prefilled in chunks of at most 8 tokens (the recurrent state carried across them)
    engine = make_engine(path, dtype="float32", block_size=4, max_num_batched_tokens=8)
    spy = PlanSpy().attach(engine)
    prompts = random_prompts([13, 6], seed=3)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, greedy(4))
    outs = run_all(engine)
    ref = HFReference(hf)
    for i, prompt in enumerate(prompts):
        assert outs[str(i)].outputs[0].token_ids == ref(prompt, 4)
    assert spy.chunked_prefills > 0


def test_qwen35_default_load_keeps_q8_0_quantized(qwen35_file) -> None:
    arch, path, hf = qwen35_file
    cfg = hf.config
    kept = {
        name
        for name, w in iter_gguf_weights(path, cfg.num_attention_heads, cfg.num_key_value_heads)
        if isinstance(w, GGUFWeight)
    }
    want = {f"model.{n}" for n in Q8_0 if f"model.{n}" in hf.state_dict()}
    assert kept == want, kept
    # the reordered blocks are exactly the HF model's rounded weights
    weights = dict(iter_gguf_weights(path, cfg.num_attention_heads, cfg.num_key_value_heads))
    for name in want:
        torch.testing.assert_close(weights[name].materialize(), hf.state_dict()[name], rtol=0, atol=0)
    loaded = load_model(str(path))
    quantized = [
        m for m in loaded.model.modules() if isinstance(getattr(m, "qweight", None), QuantizedWeight)
    ]
    assert len(quantized) == len(want)
    with torch.no_grad():
        ref = hf(torch.tensor([IDS])).logits[0]
    got = logits_of(loaded, IDS)
    assert (got - ref).norm() / ref.norm() < 0.05


def test_qwen35_tensor_names() -> None:
    assert hf_tensor_name("blk.2.ssm_a", "qwen35") == "model.layers.2.linear_attn.A_log"
    assert hf_tensor_name("blk.2.ssm_dt.bias", "qwen35moe") == "model.layers.2.linear_attn.dt_bias"
    assert hf_tensor_name("blk.0.attn_gate.weight", "qwen35") == "model.layers.0.linear_attn.in_proj_z.weight"
    assert hf_tensor_name("blk.3.post_attention_norm.weight", "qwen35") == (
        "model.layers.3.post_attention_layernorm.weight"
    )
    assert hf_tensor_name("blk.1.ffn_gate_inp_shexp.weight", "qwen35moe") == (
        "model.layers.1.mlp.shared_expert_gate.weight"
    )
    assert hf_tensor_name("blk.1.ssm_unknown.weight", "qwen35") is None


def _assert_engine_greedy(path: Path, hf: transformers.PreTrainedModel) -> None:
    """Greedy ids through the engine, prompts prefilled in chunks of at most 8 tokens, equal HF's."""
    engine = make_engine(path, dtype="float32", block_size=4, max_num_batched_tokens=8)
    spy = PlanSpy().attach(engine)
    prompts = random_prompts([13, 6], seed=4)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, greedy(4))
    outs = run_all(engine)
    hf_ref = HFReference(hf)
    for i, prompt in enumerate(prompts):
        assert outs[str(i)].outputs[0].token_ids == hf_ref(prompt, 4)
    assert spy.chunked_prefills > 0


@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_gemma4_float32_engine_greedy_and_kept_quantized(
    variant: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Gemma 4 text (`gemma4`: per-layer input embeddings, KV-sharing layers, k = v global layers with
    proportional RoPE, a double-wide MLP, per-layer output scalars; the MoE variant's router and experts):
    the float32 load gives HF's logits and, through the engine with chunked prefill, its greedy ids (the dense
    model); the default load keeps the Q8_0 matrices, their blocks exactly HF's weights."""
    make = gemma4_config if variant == "dense" else gemma4_moe_config
    torch.manual_seed(0)
    config = make()  # HF's model turns the config it is given into a per-layer one
    hf = transformers.AutoModelForCausalLM.from_config(make(), dtype=torch.float32).eval()
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            layer.layer_scalar.fill_(0.5 + 0.1 * i)  # HF initialises them to 1
    path = write_gemma4_gguf(hf, config, tmp_path_factory.mktemp("gemma4") / "tiny-gemma4.gguf")
    loaded = load_model(str(path), dtype="float32")
    got, want = loaded.model.config.to_dict(), config.to_dict()
    for key in (
        "layer_types",
        "num_kv_shared_layers",
        "attention_k_eq_v",
        "use_double_wide_mlp",
        "rope_parameters",
        "per_layer_config",  # the global layers' head size and KV heads
        "hidden_size_per_layer_input",
        "final_logit_softcapping",
        "enable_moe_block",
        "num_experts",
        "top_k_experts",
        "moe_intermediate_size",
    ):
        assert got[key] == want[key], key
    with torch.no_grad():
        ref = hf(torch.tensor([IDS])).logits[0]
    torch.testing.assert_close(logits_of(loaded, IDS), ref, atol=1e-4, rtol=1e-4)
    ids = loaded.tokenizer("ab cd").input_ids  # the "gemma4" vocabulary: BOS added, as the file asks
    assert ids[0] == BOS_ID and loaded.tokenizer.decode(ids[1:]) == "ab cd", ids
    if variant == "dense":
        _assert_engine_greedy(path, hf)
    quant = load_model(str(path))
    kept = [m for m in quant.model.modules() if isinstance(getattr(m, "qweight", None), QuantizedWeight)]
    assert len(kept) == len(GEMMA4_Q8_0)
    state = hf.state_dict()
    for name, w in iter_gguf_weights(path, 4, 2):
        if isinstance(w, GGUFWeight):  # the blocks are exactly the HF model's rounded weights
            torch.testing.assert_close(w.materialize(), state[name], rtol=0, atol=0)
    kept_logits = logits_of(quant, IDS)
    assert torch.isfinite(kept_logits).all()
    if variant == "dense":  # the MoE variant's top-2-of-4 routing flips on the 8-bit activations
        # the kernels quantize the activations too (8-bit): further from HF than the dense rows of qwen35
        assert (kept_logits - ref).norm() / ref.norm() < 0.15
