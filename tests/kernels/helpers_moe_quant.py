"""A tiny random Qwen3-MoE checkpoint with its linear layers (attention, dense MLP, every expert) written as
the block-FP8 checkpoints ship them (`quant_method: fp8`, `weight_block_size`, per-expert
`experts.N.gate_proj.weight` float8_e4m3fn with `weight_scale_inv` per block; the router and the head stay
float), with per-channel FP8 scales as compressed-tensors writes them, or as GPTQ / AWQ int4, and the
float32 checkpoint of the same model holding the dequantized values (the oracle)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.helpers import make_tiny_model
from tests.loader.helpers_quant import awq_quantize, gptq_quantize, quant_config_of
from tests.models.helpers_moe import qwen3_moe_config

_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def fp8_block_quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, float32 scale per block [ceil(out / br), ceil(in / bc)]): each block's max |w| maps
    to 448 (partial blocks at the edges, as the checkpoints' quantizers write them)."""
    w = w.to(torch.float32)
    (o, i), (br, bc) = w.shape, block
    pad = torch.zeros(-(-o // br) * br, -(-i // bc) * bc)
    pad[:o, :i] = w
    tiles = pad.reshape(pad.shape[0] // br, br, pad.shape[1] // bc, bc)
    scale = tiles.abs().amax((1, 3)).clamp(min=1e-8) / 448.0
    full = scale.repeat_interleave(br, 0).repeat_interleave(bc, 1)[:o, :i]
    return (w / full).to(torch.float8_e4m3fn), scale.contiguous()


def _quant_config(strategy: str, block: tuple[int, int]) -> dict[str, object]:
    if strategy == "gptq":
        return quant_config_of("gptq", bits=4, group_size=32, desc_act=True, sym=False)
    if strategy == "awq":
        return quant_config_of("awq", group_size=32)
    if strategy == "block":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(block)}
    if strategy == "tensor":
        return {"quant_method": "fp8", "activation_scheme": "dynamic"}
    weights = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
        "ignore": ["lm_head"],
    }


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
        if not (name.endswith(".weight") and prefix.rsplit(".", 1)[-1] in _LINEARS):
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
        if strategy == "block":
            q, scale = fp8_block_quantize(w, block)
            full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
            ref[name] = q.float() * full[: w.shape[0], : w.shape[1]]
            quant[f"{prefix}.weight_scale_inv"] = scale
        elif strategy == "tensor":
            scale = w.float().abs().amax().clamp(min=1e-8) / 448.0
            q = (w.float() / scale).to(torch.float8_e4m3fn)
            ref[name] = q.float() * scale
            quant[f"{prefix}.weight_scale"] = scale
        else:
            scale = w.float().abs().amax(1, keepdim=True).clamp(min=1e-8) / 448.0
            q = (w.float() / scale).to(torch.float8_e4m3fn)
            ref[name] = q.float() * scale
            quant[f"{prefix}.weight_scale"] = scale
        quant[name] = q
    qdir, rdir = tmp_path / f"{strategy}-moe", tmp_path / "moe-ref"
    for d, tensors, qc in ((qdir, quant, _quant_config(strategy, block)), (rdir, ref, None)):
        d.mkdir(exist_ok=True)
        for f in src.iterdir():
            if f.name != "model.safetensors":
                (d / f.name).write_bytes(f.read_bytes())
        save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
        if qc is not None:
            config = json.loads((d / "config.json").read_text())
            config["quantization_config"] = qc
            (d / "config.json").write_text(json.dumps(config))
    return qdir, rdir
