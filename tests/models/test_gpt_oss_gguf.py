"""gpt-oss GGUF files as llama.cpp writes them (tests/models/helpers_gpt_oss_gguf.py): the config comes
from the metadata (window on the even layers, YaRN, expert sizes), float32 experts give HF transformers'
greedy ids on the source checkpoint (chunked prefill, prefix hits and preemption forced on, prompts longer
than the window); Q8_0 and MXFP4 experts load kept quantized (stacked blocks on the fused experts kernel)
within the quantized path's tolerance of their dequantized float32 run; a file missing a tensor is refused
with its name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from pagedrs.layers.attention import ForwardContext
from pagedrs.loader import load_model
from pagedrs.loader.gguf import hf_tensor_name
from pagedrs.loader.gguf_gpt_oss import gpt_oss_weights
from pagedrs.models.gpt_oss import GptOssForCausalLM
from pagedrs.quantization.gguf_blocks import kernel_types
from tests.engine.conftest import (
    HFReference,
)
from tests.helpers import CHAT_TEMPLATE, load_hf_model, logits_of
from tests.models.helpers_families import assert_engine_greedy_matches_hf
from tests.models.helpers_gpt_oss import SLIDING_WINDOW
from tests.models.helpers_gpt_oss_gguf import make_tiny_gpt_oss_gguf

# a prompt whose routing has no near-tie (every layer's k-th and (k+1)-th router logits >= 0.16 apart), so
# that the quantized runs choose the dense run's experts and the comparison measures the kernels alone
IDS = [166, 182, 77, 189, 233, 61, 39, 195, 149]
MXFP4 = 39  # gguf.GGMLQuantizationType.MXFP4


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDRS_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def f32_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_tiny_gpt_oss_gguf(tmp_path_factory.mktemp("gpt_oss_gguf"), "F32")


def _chosen_experts(model: torch.nn.Module, ids: list[int]) -> list[torch.Tensor]:
    """Per layer, the experts each token is routed to (sorted) in a plain forward of `ids`."""
    chosen: list[torch.Tensor] = []
    k = model.model.layers[0].mlp.routing.top_k
    handles = [
        layer.mlp.gate.register_forward_hook(
            lambda m, a, out: chosen.append(out.topk(k, -1).indices.sort(-1).values)
        )
        for layer in model.model.layers
    ]
    try:
        with torch.no_grad():
            model(torch.tensor(ids), torch.arange(len(ids)), ForwardContext(None, []))
    finally:
        for h in handles:
            h.remove()
    return chosen


def test_config_from_metadata(f32_file: tuple[Path, Path]) -> None:
    src, path = f32_file
    loaded = load_model(str(path), dtype="float32")
    assert isinstance(loaded.model, GptOssForCausalLM)
    ours, ref = loaded.hf_config, transformers.AutoConfig.from_pretrained(str(src))
    for key in ("layer_types", "sliding_window", "head_dim", "intermediate_size", "num_local_experts"):
        assert getattr(ours, key) == getattr(ref, key), key
    assert ours.num_experts_per_tok == ref.num_experts_per_tok and not ours.tie_word_embeddings
    assert ours.rope_parameters == pytest.approx(ref.rope_parameters)
    layers = loaded.model.model.layers
    assert [layer.self_attn.attn.sliding_window for layer in layers] == [SLIDING_WINDOW, None]
    hf = load_hf_model(src)
    torch.testing.assert_close(layers[1].self_attn.attn.sinks, hf.model.layers[1].self_attn.sinks.detach())
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
    assert loaded.tokenizer("ab cd").input_ids == tok("ab cd").input_ids
    assert loaded.tokenizer.chat_template == CHAT_TEMPLATE


def test_f32_experts_match_hf_greedy(f32_file: tuple[Path, Path]) -> None:
    src, path = f32_file
    hf = load_hf_model(src)
    with torch.no_grad():
        ref = hf(torch.tensor([IDS])).logits[0]
    dense, auto = load_model(str(path), dtype="float32"), load_model(str(path))
    torch.testing.assert_close(logits_of(dense, IDS), ref, atol=1e-4, rtol=0)
    # straight from the file (dtype auto): float32 experts on the fused kernel, the same run
    torch.testing.assert_close(logits_of(auto, IDS), ref, atol=1e-4, rtol=0)
    hf.generation_config.eos_token_id = None
    assert_engine_greedy_matches_hf(path, HFReference(hf), num_kv_blocks=10, unshared=(18, 11))


@pytest.mark.parametrize("qtype", ["Q8_0", "MXFP4"])
def test_quantized_experts_stay_quantized(tmp_path: Path, qtype: str) -> None:
    _, path = make_tiny_gpt_oss_gguf(tmp_path, qtype)
    assert MXFP4 in kernel_types()  # the CPU kernels multiply MXFP4 blocks
    quant, dense = load_model(str(path)), load_model(str(path), dtype="float32")
    for layer in quant.model.model.layers:
        experts = layer.mlp.experts
        for w in (experts.gate_up, experts.down):
            assert w.qweight is not None and w.weight.numel() == 0
            assert w.qweight.ggml_type == {"Q8_0": 8, "MXFP4": MXFP4}[qtype]
    # the stacked blocks are exactly the dequantized run's weights, gate rows before up rows
    for qlayer, dlayer in zip(quant.model.model.layers, dense.model.model.layers, strict=True):
        qe, de = qlayer.mlp.experts, dlayer.mlp.experts
        torch.testing.assert_close(qe.gate_up.dense(), de.gate_up.weight, rtol=0, atol=0)
        torch.testing.assert_close(qe.down.dense(), de.down.weight, rtol=0, atol=0)
        torch.testing.assert_close(qe.gate_up_bias, de.gate_up_bias, rtol=0, atol=0)
    assert [e.tolist() for e in _chosen_experts(quant.model, IDS)] == [
        e.tolist() for e in _chosen_experts(dense.model, IDS)
    ]
    lq, ld = logits_of(quant, IDS), logits_of(dense, IDS)
    assert (lq - ld).abs().max() <= 0.05 * ld.abs().max()


@pytest.mark.parametrize(
    "missing", ["blk.1.ffn_up_exps.weight", "blk.0.ffn_down_exps.bias", "blk.1.attn_sinks.weight"]
)
@pytest.mark.parametrize("dtype", ["auto", "float32"])
def test_missing_tensor_is_named(tmp_path: Path, missing: str, dtype: str) -> None:
    _, path = make_tiny_gpt_oss_gguf(tmp_path, "Q8_0", drop=(missing,))
    with pytest.raises(ValueError, match=f"no tensor '{missing}'"):
        load_model(str(path), dtype=dtype)


def test_gguf_names() -> None:
    """llama.cpp's gpt-oss names: the router is HF's `mlp.router` (Qwen-MoE's `ffn_gate_inp` stays
    `mlp.gate`), the sinks and `post_attention_norm` their HF tensors."""
    assert hf_tensor_name("blk.2.ffn_gate_inp.bias", "gpt-oss") == "model.layers.2.mlp.router.bias"
    assert hf_tensor_name("blk.2.ffn_gate_inp.weight", "qwen3moe") == "model.layers.2.mlp.gate.weight"
    assert hf_tensor_name("blk.0.attn_sinks.weight", "gpt-oss") == "model.layers.0.self_attn.sinks.weight"
    assert hf_tensor_name("blk.1.post_attention_norm.weight", "gpt-oss") == (
        "model.layers.1.post_attention_layernorm.weight"
    )
    gate, up = torch.arange(6.0).view(2, 3), -torch.arange(6.0).view(2, 3)
    stream = [("m.layers.0.mlp.experts.gate_exps.bias", gate), ("m.layers.0.mlp.experts.up_exps.bias", up)]
    ((name, both),) = gpt_oss_weights(stream)
    assert name == "m.layers.0.mlp.experts.gate_up_proj_bias"  # HF's interleaved layout: gate even, up odd
    assert torch.equal(both[:, 0::2], gate) and torch.equal(both[:, 1::2], up)
    with pytest.raises(ValueError, match="expert up bias missing"):
        list(gpt_oss_weights(stream[:1]))


def test_fused_gate_up_experts_are_refused(tmp_path: Path) -> None:
    import gguf
    import numpy as np

    path = tmp_path / "fused.gguf"
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    w.add_block_count(1)
    w.add_tensor("blk.0.ffn_gate_up_exps.weight", np.zeros((2, 64, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="'blk.0.ffn_gate_up_exps.weight': fused gate/up experts"):
        load_model(str(path))
