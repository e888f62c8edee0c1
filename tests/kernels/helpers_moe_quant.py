"""A tiny random Qwen3-MoE checkpoint with its linear layers (attention, dense MLP, every expert) written as
the block-FP8 checkpoints ship them (`quant_method: fp8`, `weight_block_size`, per-expert
`experts.N.gate_proj.weight` float8_e4m3fn with `weight_scale_inv` per block; the router and the head stay
float), with per-channel FP8 scales as compressed-tensors writes them, or as GPTQ / AWQ int4, and the
float32 checkpoint of the same model holding the dequantized values (the oracle)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from tests.helpers import make_tiny_model
from tests.loader.helpers_quant import (
    LINEARS,
    awq_quantize,
    fp8_quantize,
    gptq_quantize,
    quant_config_of,
    write_pair,
)
from tests.models.helpers_moe import qwen3_moe_config


def _quant_config(strategy: str, block: tuple[int, int]) -> dict[str, Any]:
    if strategy == "gptq":
        return quant_config_of("gptq", bits=4, group_size=32, desc_act=True, sym=False)
    if strategy == "awq":
        return quant_config_of("awq", group_size=32)
    if strategy in ("block", "tensor"):
        return quant_config_of("fp8", strategy=strategy, block=block)
    return {**quant_config_of("compressed-tensors", strategy=strategy), "ignore": ["lm_head"]}


def make_fp8_moe_pair(
    tmp_path: Path, strategy: str = "block", block: tuple[int, int] = (128, 128)
) -> tuple[Path, Path]:
    """(the quantized Qwen3-MoE checkpoint, the float32 one with its dequantized weights). strategy "block":
    FP8 with `weight_scale_inv` per `block`; "tensor": FP8 with one `weight_scale`; "channel":
    compressed-tensors' FP8 `weight_scale` [out, 1];
    "gptq" (4-bit, groups of 32, act-order, zero points) or "awq" (4-bit, groups of 32)."""
    src = make_tiny_model(tmp_path / "fp8-moe-src", qwen3_moe_config())
    state = load_file(str(src / "model.safetensors"))
    quant: dict[str, torch.Tensor] = {}
    ref: dict[str, torch.Tensor] = {}
    for name, w in sorted(state.items()):
        prefix = name.removesuffix(".weight")
        if not (name.endswith(".weight") and prefix.rsplit(".", 1)[-1] in LINEARS):
            quant[name] = ref[name] = w
            continue
        if strategy in ("gptq", "awq"):
            parts, ref[name] = (
                gptq_quantize(w, 4, 32, sym=False, desc_act=True, seed=len(ref))
                if strategy == "gptq"
                else awq_quantize(w, 32)
            )
            quant.update({f"{prefix}.{k}": v.contiguous() for k, v in parts.items()})
            continue
        parts, ref[name] = fp8_quantize(w, strategy, block)
        quant.update({f"{prefix}.{k}": v for k, v in parts.items()})
    qdir, rdir = tmp_path / f"{strategy}-moe", tmp_path / "moe-ref"
    write_pair(src, (qdir, quant, _quant_config(strategy, block)), (rdir, ref))
    return qdir, rdir
