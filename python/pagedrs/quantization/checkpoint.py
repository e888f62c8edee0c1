"""A GPTQ, AWQ or FP8 checkpoint's tensors turned into the `<layer>.weight` the model's loaders take.

A quantized linear layer ships as parts (`qweight`, `qzeros`, `scales`, `g_idx` for GPTQ/AWQ; `weight` in
float8_e4m3fn with `weight_scale` or `weight_scale_inv` for FP8). `quantized_checkpoint` gathers a layer's
parts and yields one weight [out_features, in_features]: kept packed as GGUF blocks the CPU kernels
multiply (`GGUFWeight`) where that is exact (`pagedrs.quantization.dequant`), kept as its own parts for
the GPU kernels (`PackedInt`, `Fp8`; a block-FP8 expert as `Fp8Block` for the fused experts kernel), or
else dequantized to float32; the layers then cast and shard a float weight like any other.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from pagedrs.quantization.config import QuantConfig
from pagedrs.quantization.dequant import (
    awq_group,
    dequantize_awq,
    dequantize_fp8,
    dequantize_gptq,
    gptq_as_gguf,
    gptq_g_idx,
)
from pagedrs.quantization.fp8_block import Fp8Block
from pagedrs.quantization.gguf_blocks import GGUFWeight
from pagedrs.quantization.packed_parts import Fp8, PackedInt

__all__ = ["PackedForm", "quantized_checkpoint"]

logger = logging.getLogger("pagedrs.loader")

# a mixture-of-experts layer's per-expert projection (`mlp.experts.3.gate_proj`, Mixtral's `w1`)
_EXPERT = re.compile(r"\.experts\.\d+\.[^.]+$")
_PARTS = {"gptq": ("qweight", "qzeros", "scales", "g_idx"), "awq": ("qweight", "qzeros", "scales")}


def _materialize(t: Any) -> Tensor:
    read = getattr(t, "materialize", None)
    return read() if read is not None else t


# Scales an FP8 checkpoint may carry for what pagedrs keeps in the model's dtype: activations
# (input_scale, output_scale) and the KV cache (k/v/q_scale, kv_scale: vLLM's and llm-compressor's names).
_FP8_UNUSED_SCALES = frozenset({"input_scale", "output_scale", "k_scale", "v_scale", "q_scale", "kv_scale"})


# How `quantized_checkpoint` hands over a layer it can keep packed: as GGUF blocks for the CPU kernels
# ("gguf", where that is exact), as its own parts for the GPU ("device": `PackedInt`, `Fp8`), or never
# (None: float32 dequantized).
PackedForm = str | None


def quantized_checkpoint(
    weights: Iterator[tuple[str, Any]], cfg: QuantConfig, *, keep_packed: PackedForm
) -> Iterator[tuple[str, Any]]:
    """`weights` with each quantized layer's parts replaced by its `<layer>.weight` (packed in the form
    `keep_packed` names where it applies, else float32); other tensors pass through. Logs once what was
    done; ValueError naming the layer when its parts are incomplete or misshapen."""
    if cfg.method == "mxfp4":  # gpt-oss's experts: kept 4-bit for the CPU kernels, else dequantized
        from pagedrs.quantization.mxfp4 import mxfp4_checkpoint

        yield from mxfp4_checkpoint(weights, keep=keep_packed == "gguf")
        return
    done: Counter[str] = Counter()
    pending: dict[str, dict[str, Tensor]] = {}
    for name, t in weights:
        prefix, _, part = name.rpartition(".")
        if cfg.method == "fp8":
            if part in _FP8_UNUSED_SCALES:
                continue  # activations and the KV cache run unquantized: only the weights' scales apply
            if part not in ("weight", "weight_scale", "weight_scale_inv"):
                yield name, t
                continue
            t = _materialize(t)
            if part == "weight" and t.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
                yield name, t
                continue
        elif part not in _PARTS[cfg.method]:
            yield name, t
            continue
        got = pending.setdefault(prefix, {})
        got[part] = _materialize(t)
        out = _complete(prefix, got, cfg, keep_packed, done, final=False)
        if out is not None:
            del pending[prefix]
            yield out
    for prefix, got in pending.items():
        out = _complete(prefix, got, cfg, keep_packed, done, final=True)
        if out is not None:
            yield out
    _log(cfg, done)


def _complete(
    prefix: str,
    got: dict[str, Tensor],
    cfg: QuantConfig,
    keep_packed: PackedForm,
    done: Counter[str],
    final: bool,
) -> tuple[str, Tensor | GGUFWeight | PackedInt | Fp8 | Fp8Block] | None:
    """The layer's weight once its parts are in (at the end, `final`: what is missing is an error)."""
    if cfg.method == "fp8":
        scale = got.get("weight_scale_inv", got.get("weight_scale"))
        if "weight" not in got or scale is None:
            if final:
                raise ValueError(f"{prefix}: FP8 weight without its scale (weight, weight_scale)")
            return None
        if keep_packed == "device" and cfg.block is None and got["weight"].dtype == torch.float8_e4m3fn:
            try:
                packed_fp8 = Fp8(got["weight"], scale.to(torch.float32).reshape(-1))
            except ValueError as e:
                raise ValueError(f"{prefix}: {e}") from None
            done["kept in fp8"] += 1
            return f"{prefix}.weight", packed_fp8
        if keep_packed == "device" and cfg.block is not None and _EXPERT.search(prefix) is not None:
            if got["weight"].dtype == torch.float8_e4m3fn:  # the fused experts kernel's block scales
                try:
                    block_fp8 = Fp8Block(got["weight"], scale.to(torch.float32), cfg.block)
                except ValueError as e:
                    raise ValueError(f"{prefix}: {e}") from None
                done["kept in fp8 (experts, block scales)"] += 1
                return f"{prefix}.weight", block_fp8
        done["dequantized at load"] += 1
        return f"{prefix}.weight", dequantize_fp8(prefix, got["weight"], scale, cfg.block)
    needed = ("qweight", "qzeros", "scales") + (("g_idx",) if cfg.method == "gptq" and not final else ())
    missing = [p for p in needed if p not in got]
    if missing:
        if final:
            raise ValueError(f"{prefix}: {cfg.describe()} layer without {', '.join(missing)}")
        return None
    if keep_packed == "device":
        return f"{prefix}.weight", _device_packed(prefix, got, cfg, done)
    if cfg.method == "awq":
        done["dequantized at load"] += 1
        return f"{prefix}.weight", dequantize_awq(prefix, got, cfg)
    packed = gptq_as_gguf(prefix, got, cfg) if keep_packed == "gguf" else None
    if packed is not None:
        done[f"kept packed as {packed.type_name} (the CPU kernels multiply them)"] += 1
        return f"{prefix}.weight", packed
    done["dequantized at load"] += 1
    return f"{prefix}.weight", dequantize_gptq(prefix, got, cfg)


def _device_packed(prefix: str, got: dict[str, Tensor], cfg: QuantConfig, done: Counter[str]) -> PackedInt:
    """The layer's own parts for the GPU kernels, checked as the dequantizers check them."""
    g_idx = gptq_g_idx(prefix, got, cfg).to(torch.int32) if cfg.method == "gptq" else None
    if g_idx is None:
        awq_group(prefix, got, cfg)
    done["kept packed for the GPU kernels"] += 1
    return PackedInt(cfg, got["qweight"], got["qzeros"], got["scales"], g_idx)


def _log(cfg: QuantConfig, done: Counter[str]) -> None:
    if not done:
        raise ValueError(f"the checkpoint declares {cfg.describe()} but holds no quantized layer")
    for what, n in sorted(done.items()):
        logger.info("%s weights %s: %d layers", cfg.describe(), what, n)
