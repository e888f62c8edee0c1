"""GPTQ, AWQ and FP8 checkpoints (written by `helpers_quant` with the formats' real packing) load to the
model whose float32 weights are their dequantized values: logits within 1e-4 when dequantized at load,
within 5% of the largest logit when GPTQ stays packed as GGUF blocks (the CPU kernels round the
activations to 8 bits), and the same greedy ids."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedrs.engine.arg_utils import EngineArgs
from pagedrs.loader import LoadedModel, load_model
from pagedrs.loader.options import LoadOptions
from pagedrs.quantization.config import QuantConfig
from pagedrs.quantization.dequant import dequantize_awq, dequantize_gptq
from tests.helpers import greedy_by_logits, logits_of, make_tiny_llama
from tests.loader.helpers_quant import (
    AWQ_ORDER,
    make_quantized_pair,
    pack_along_cols,
    pack_along_rows,
)

IDS = [7, 8, 9, 10, 120, 3, 200, 45]


def _linears(loaded: LoadedModel) -> list[torch.nn.Module]:
    return [m for m in loaded.model.modules() if hasattr(m, "qweight")]


def test_packing_bit_order_is_the_formats() -> None:
    # GPTQ: input rows 0..7 of one column in nibbles 0..7 of one word
    assert pack_along_rows(np.arange(8).reshape(8, 1), 4)[0, 0] == 0x76543210
    assert pack_along_rows(np.array([[1], [2], [3], [4]]), 8)[0, 0] == 0x04030201
    # AWQ: columns 0..7 interleaved, nibble i holding column [0, 2, 4, 6, 1, 3, 5, 7][i]
    assert AWQ_ORDER == (0, 2, 4, 6, 1, 3, 5, 7)
    assert pack_along_cols(np.arange(8).reshape(1, 8), 4, AWQ_ORDER)[0, 0] == 0x75316420
    # the loader reads those words back: GPTQ zeros stored minus one (AutoGPTQ's v1 convention)
    gptq = QuantConfig("gptq", bits=4, group_size=-1)
    parts = {
        "qweight": torch.tensor([[0x76543210] * 8], dtype=torch.int32).view(1, 8).repeat(1, 1),
        "qzeros": torch.tensor([[0x11111111]], dtype=torch.int32),  # every zero 1 + 1 = 2
        "scales": torch.full((1, 8), 0.5, dtype=torch.float16),
        "g_idx": torch.zeros(8, dtype=torch.int32),
    }
    w = dequantize_gptq("l", parts, gptq)  # [out 8, in 8]
    assert torch.equal(w[3], (torch.arange(8, dtype=torch.float32) - 2) * 0.5)
    awq = QuantConfig("awq", bits=4, group_size=-1)
    parts = {
        "qweight": torch.tensor([[0x75316420]] * 8, dtype=torch.int32),
        "qzeros": torch.tensor([[0x11111111]], dtype=torch.int32),  # every zero 1, as stored
        "scales": torch.full((1, 8), 2.0, dtype=torch.float16),
    }
    w = dequantize_awq("l", parts, awq)  # [out 8, in 8]: column c of every input row is c
    assert torch.equal(w[:, 0], (torch.arange(8, dtype=torch.float32) - 1) * 2.0)


CASES = {
    "gptq4-g32-sym": ("gptq", dict(bits=4, group_size=32, sym=True, desc_act=False)),
    "gptq4-g32-asym-actorder": ("gptq", dict(bits=4, group_size=32, sym=False, desc_act=True)),
    "gptq8-perchannel-sym": ("gptq", dict(bits=8, group_size=-1, sym=True, desc_act=False)),
    "awq4-g32": ("awq", dict(group_size=32)),
    "fp8-tensor": ("fp8", dict(strategy="tensor")),
    "fp8-block": ("fp8", dict(strategy="block")),
    "ct-fp8-channel": ("compressed-tensors", dict(strategy="channel")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_dequantized_load_equals_float_model(tmp_path: Path, case: str, caplog) -> None:
    method, kw = CASES[case]
    qdir, rdir = make_quantized_pair(tmp_path, method, **kw)
    with caplog.at_level(logging.INFO, logger="pagedrs.loader"):
        quant = load_model(str(qdir), dtype="float32")
    assert "dequantized at load" in caplog.text
    assert quant.quantization == method
    ref = load_model(str(rdir), dtype="float32")
    for m in _linears(quant):
        assert m.qweight is None
    lq, lr = logits_of(quant, IDS), logits_of(ref, IDS)
    torch.testing.assert_close(lq, lr, rtol=1e-4, atol=1e-4)
    assert greedy_by_logits(quant, IDS) == greedy_by_logits(ref, IDS)


@pytest.mark.parametrize(("case", "block"), [("gptq4-g32-sym", "Q4_0"), ("gptq8-perchannel-sym", "Q8_0")])
def test_symmetric_gptq_stays_packed_for_the_cpu_kernels(
    tmp_path: Path, case: str, block: str, caplog
) -> None:
    method, kw = CASES[case]
    qdir, rdir = make_quantized_pair(tmp_path, method, **kw)
    with caplog.at_level(logging.INFO, logger="pagedrs.loader"):
        quant = load_model(str(qdir))  # dtype auto, one CPU rank
    assert f"kept packed as {block}" in caplog.text and "dequantized" not in caplog.text
    ref = load_model(str(rdir), dtype="float32")
    names = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    for name in names:
        q = quant.model.model.layers[1].get_submodule(name).qweight
        assert q is not None and q.type_names == [block]
        d = ref.model.model.layers[1].get_submodule(name).weight.data
        # one-hot inputs pass the kernels' activation rounding exactly: the packed weight is the reference's
        torch.testing.assert_close(q.matmul(torch.eye(d.shape[1])).T, d, rtol=1e-5, atol=1e-6)
    lq, lr = logits_of(quant, IDS), logits_of(ref, IDS)
    assert (lq - lr).abs().max() <= 0.05 * lr.abs().max()
    assert greedy_by_logits(quant, IDS) == greedy_by_logits(ref, IDS)


def test_act_order_and_asymmetric_gptq_are_dequantized_even_under_auto(tmp_path: Path, caplog) -> None:
    qdir, _ = make_quantized_pair(tmp_path, "gptq", **CASES["gptq4-g32-asym-actorder"][1])
    with caplog.at_level(logging.INFO, logger="pagedrs.loader"):
        quant = load_model(str(qdir))
    assert "GPTQ int4 (group 32, act-order) weights dequantized at load" in caplog.text
    assert all(m.qweight is None for m in _linears(quant))


def test_forced_quantization_must_match_the_checkpoint(tmp_path: Path) -> None:
    qdir, rdir = make_quantized_pair(tmp_path, "awq", group_size=32)
    with pytest.raises(ValueError, match="does not match the checkpoint's quant_method 'awq'"):
        load_model(str(qdir), opts=LoadOptions(quantization="gptq"))
    assert load_model(str(qdir), opts=LoadOptions(quantization="awq_marlin")).quantization == "awq"
    with pytest.raises(ValueError, match="declares no quantization_config"):
        load_model(str(rdir), opts=LoadOptions(quantization="fp8"))
    with pytest.raises(ValueError, match="quantization='bitsandbytes' is not supported"):
        EngineArgs(model=str(qdir), quantization="bitsandbytes").check_compat()
    EngineArgs(model=str(qdir), quantization="awq").check_compat()


def test_incomplete_layer_is_named(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    qdir, _ = make_quantized_pair(tmp_path, "gptq", **CASES["gptq4-g32-sym"][1])
    state = load_file(str(qdir / "model.safetensors"))
    del state["model.layers.1.mlp.down_proj.qzeros"]
    save_file(state, str(qdir / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj: .* without qzeros"):
        load_model(str(qdir), dtype="float32")


def test_unsupported_formats_are_refused(tmp_path: Path) -> None:
    import json

    folder = make_tiny_llama(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    for qc, msg in (
        ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' .* is not supported"),
        ({"quant_method": "gptq", "bits": 3}, "GPTQ with 3 bits is not supported"),
        ({"quant_method": "awq", "version": "gemv"}, "AWQ version 'gemv' is not supported"),
    ):
        (folder / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
        with pytest.raises(ValueError, match=msg):
            load_model(str(folder), dtype="float32")


def test_startup_line_reports_what_was_loaded_and_packed_weight_size(tmp_path: Path, caplog) -> None:
    from pagedrs import LLM

    qdir, rdir = make_quantized_pair(tmp_path, "gptq", **CASES["gptq4-g32-sym"][1])
    with caplog.at_level(logging.INFO, logger="pagedrs"):
        llm = LLM(str(qdir), device="cpu", disable_log_stats=True, num_kv_blocks=8)
    line = next(r.getMessage() for r in caplog.records if "with config:" in r.getMessage())
    assert "load_format=safetensors" in line and "quantization=gptq" in line
    llm.llm_engine.shutdown()
    quant, ref = load_model(str(qdir)), load_model(str(rdir), dtype="float32")
    packed = sum(m.qweight.nbytes for m in _linears(quant) if m.qweight is not None)
    dense = sum(p.numel() * p.element_size() for p in quant.model.parameters())
    assert packed > 0 and quant.weight_nbytes == dense + packed
    # Q4_0: 18 bytes per 32 weights where float32 takes 128
    linear_floats = sum(m.weight.numel() for m in _linears(ref))
    assert packed == linear_floats // 32 * 18 and quant.weight_nbytes < ref.weight_nbytes


@pytest.mark.parametrize("case", ["gptq4-g32-asym-actorder", "awq4-g32", "ct-fp8-channel"])
def test_tp2_dequantized_equals_the_float_model(tmp_path: Path, case: str) -> None:
    from pagedrs import LLM, SamplingParams

    method, kw = CASES[case]
    qdir, rdir = make_quantized_pair(tmp_path, method, **kw)
    params = SamplingParams(max_tokens=6, temperature=0.0)
    prompts = [{"prompt_token_ids": IDS}, {"prompt_token_ids": [1, 2, 3, 4, 5]}]
    outs = {}
    for name, folder, tp in (("quant", qdir, 2), ("ref", rdir, 1)):
        llm = LLM(str(folder), device="cpu", dtype="float32", tensor_parallel_size=tp, disable_log_stats=True)
        try:
            outs[name] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
        finally:
            llm.llm_engine.shutdown()
    assert outs["quant"] == outs["ref"]


def test_autoawq_side_file_without_quant_method(tmp_path: Path) -> None:
    """AutoAWQ writes quant_config.json beside a config.json without quantization_config, and names no
    quant_method in it: the file's name says it is AWQ."""
    qdir, rdir = make_quantized_pair(tmp_path, "awq", group_size=32)
    config = json.loads((qdir / "config.json").read_text())
    del config["quantization_config"]
    (qdir / "config.json").write_text(json.dumps(config))
    side = {"zero_point": True, "q_group_size": 32, "w_bit": 4, "version": "GEMM"}
    (qdir / "quant_config.json").write_text(json.dumps(side))
    quant = load_model(str(qdir), dtype="float32")
    assert quant.quantization == "awq"
    ref = load_model(str(rdir), dtype="float32")
    torch.testing.assert_close(logits_of(quant, IDS), logits_of(ref, IDS), rtol=1e-4, atol=1e-4)


def test_fp8_checkpoint_with_kv_and_output_scales_loads(tmp_path: Path) -> None:
    """FP8 checkpoints with a KV-cache or output scheme carry k/v scales and output scales: pagedrs keeps
    the cache and activations in the model's dtype, so they are skipped, not refused as unknown tensors."""
    qdir, rdir = make_quantized_pair(tmp_path, "fp8", strategy="tensor")
    tensors = load_file(str(qdir / "model.safetensors"))
    for layer in {n.split(".self_attn.")[0] for n in tensors if ".self_attn." in n}:
        for name in ("self_attn.k_scale", "self_attn.v_scale", "self_attn.k_proj.output_scale"):
            tensors[f"{layer}.{name}"] = torch.tensor(1.0)
    save_file(tensors, str(qdir / "model.safetensors"), metadata={"format": "pt"})
    quant, ref = load_model(str(qdir), dtype="float32"), load_model(str(rdir), dtype="float32")
    torch.testing.assert_close(logits_of(quant, IDS), logits_of(ref, IDS), rtol=1e-4, atol=1e-4)
