"""Which quantized checkpoint format a model folder holds: the `quantization_config` of its config.json
(the key transformers and vLLM read), else a `quantize_config.json` / `quant_config.json` beside it (older
AutoGPTQ and AutoAWQ exports), checked against `quantization=` when the caller forces one.

Formats: GPTQ (2/4/8-bit, any group size, act-order with `g_idx`, symmetric or not, AutoGPTQ's v1
zero-point convention or GPTQModel's v2), AWQ (4-bit GEMM layout), FP8 e4m3 weights
(`quant_method: fp8`, or compressed-tensors `float-quantized` with per-tensor, per-channel or block scales),
MXFP4 (`quant_method: mxfp4`, gpt-oss's experts; dequantized at load, `pagedrs.quantization.mxfp4`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["QUANTIZATION_METHODS", "QuantConfig", "detect_quantization"]

# the names `quantization=` takes (vLLM's), and the format each loads
QUANTIZATION_METHODS: dict[str, str] = {
    "gptq": "gptq",
    "gptq_marlin": "gptq",
    "awq": "awq",
    "awq_marlin": "awq",
    "fp8": "fp8",
    "compressed-tensors": "fp8",
    "compressed_tensors": "fp8",
    "gguf": "gguf",
    "mxfp4": "mxfp4",
    "q8_0": "q8_0",  # a float checkpoint quantized at load to llama.cpp's Q8_0 (pagedrs.layers.quantize_at_load)
}
_SIDE_FILES = ("quantize_config.json", "quant_config.json")


@dataclass(frozen=True, slots=True)
class QuantConfig:
    """One checkpoint's quantization. `group_size` -1: one group per output column (GPTQ/AWQ);
    `block` (FP8): the (rows, cols) of a weight-scale block, None for per-tensor or per-channel scales."""

    method: str  # "gptq" | "awq" | "fp8"
    bits: int = 4
    group_size: int = -1
    desc_act: bool = False
    sym: bool = True
    zero_plus_one: bool = True  # GPTQ: qzeros hold zero - 1 (AutoGPTQ's v1 format)
    block: tuple[int, int] | None = None
    name: str = ""  # the quant_method as the checkpoint spells it

    def __post_init__(self) -> None:
        if self.method in ("gptq", "awq") and self.bits not in (2, 4, 8):
            raise ValueError(f"{self.method.upper()} with {self.bits} bits is not supported (2, 4 or 8)")
        if self.method == "awq" and self.bits != 4:
            raise ValueError(f"AWQ with {self.bits} bits is not supported (the GEMM layout packs 4-bit)")
        if self.group_size == 0 or self.group_size < -1:
            raise ValueError(f"group_size must be -1 or > 0, got {self.group_size}")

    def describe(self) -> str:
        """How log lines name it: "GPTQ int4 (group 128)", "AWQ int4 (group 128)", "FP8 e4m3"."""
        if self.method == "mxfp4":
            return "MXFP4"
        if self.method == "fp8":
            return "FP8 e4m3" + (f" (block {self.block[0]}x{self.block[1]})" if self.block else "")
        group = "per channel" if self.group_size == -1 else f"group {self.group_size}"
        extra = ", act-order" if self.desc_act else ""
        return f"{self.method.upper()} int{self.bits} ({group}{extra})"


def _raw_config(hf_config: Any, folder: str | Path) -> dict[str, Any] | None:
    raw = getattr(hf_config, "quantization_config", None)
    if raw is not None and not isinstance(raw, dict):
        raw = raw.to_dict() if hasattr(raw, "to_dict") else dict(vars(raw))
    if raw:
        return dict(raw)
    for name in _SIDE_FILES:
        p = Path(folder) / name
        if p.is_file():
            side = dict(json.loads(p.read_text()))
            # AutoAWQ's quant_config.json and older AutoGPTQ quantize_config.json carry no quant_method:
            # the file's name says which it is
            side.setdefault("quant_method", "awq" if name == "quant_config.json" else "gptq")
            return side
    return None


def _gptq(raw: dict[str, Any]) -> QuantConfig:
    fmt = str(raw.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported (gptq or gptq_v2)")
    return QuantConfig(
        "gptq",
        bits=int(raw.get("bits", 4)),
        group_size=int(raw.get("group_size", -1)),
        desc_act=bool(raw.get("desc_act", False)),
        sym=bool(raw.get("sym", True)),
        zero_plus_one=fmt == "gptq",
        name="gptq",
    )


def _awq(raw: dict[str, Any]) -> QuantConfig:
    version = str(raw.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"AWQ version {version!r} is not supported (only the GEMM layout)")
    return QuantConfig(
        "awq",
        bits=int(raw.get("bits", raw.get("w_bit", 4))),
        group_size=int(raw.get("group_size", raw.get("q_group_size", -1))),
        sym=not bool(raw.get("zero_point", True)),
        name="awq",
    )


def _fp8(raw: dict[str, Any], method: str) -> QuantConfig:
    if method == "fp8":
        block = raw.get("weight_block_size")
        if raw.get("is_checkpoint_fp8_serialized") is False:
            raise ValueError("an FP8 config without FP8 weights (dynamic quantization) is not supported")
        return QuantConfig(
            "fp8", bits=8, block=(int(block[0]), int(block[1])) if block else None, name=method
        )
    fmt = str(raw.get("format", ""))
    groups = raw.get("config_groups") or {}
    for group in groups.values():
        w = group.get("weights") or {}
        if w.get("type") != "float" or int(w.get("num_bits", 0)) != 8 or fmt not in ("float-quantized", ""):
            raise ValueError(
                f"compressed-tensors format {fmt!r} with weights {w!r} is not supported "
                "(only float-quantized FP8 weights)"
            )
        strategy = w.get("strategy", "tensor")
        if strategy not in ("tensor", "channel", "block"):
            raise ValueError(f"compressed-tensors FP8 strategy {strategy!r} is not supported")
        size = w.get("block_structure")
        block = (int(size[0]), int(size[1])) if strategy == "block" and size else None
        return QuantConfig("fp8", bits=8, block=block, name=method)
    raise ValueError("compressed-tensors config without config_groups: nothing says how weights are stored")


def detect_quantization(hf_config: Any, folder: str | Path, forced: str | None = None) -> QuantConfig | None:
    """The folder's quantization (None for a float checkpoint). `forced` (the `quantization=` argument)
    must agree with what the checkpoint declares; ValueError saying which disagree."""
    if forced is not None and forced not in QUANTIZATION_METHODS:
        raise ValueError(
            f"quantization={forced!r} is not supported; one of {', '.join(QUANTIZATION_METHODS)}"
        )
    raw = _raw_config(hf_config, folder)
    method = str(raw.get("quant_method", "")).lower() if raw else ""
    if forced == "q8_0":
        if raw:
            raise ValueError(
                f"quantization='q8_0' quantizes a 16/32-bit checkpoint at load, but {str(folder)!r} is "
                f"already quantized (quant_method {method!r}); leave quantization unset"
            )
        return None
    if forced is not None and forced != "gguf":
        if not raw:
            raise ValueError(
                f"quantization={forced!r}, but {str(folder)!r} declares no quantization_config (quantizing "
                "float weights at load is not implemented; pass a quantized checkpoint)"
            )
        if QUANTIZATION_METHODS.get(method) != QUANTIZATION_METHODS[forced]:
            raise ValueError(
                f"quantization={forced!r} does not match the checkpoint's quant_method {method!r}"
            )
    if not raw:
        return None
    if method == "gptq":
        return _gptq(raw)
    if method == "awq":
        return _awq(raw)
    if method in ("fp8", "compressed-tensors"):
        return _fp8(raw, method)
    if method == "mxfp4":
        return QuantConfig("mxfp4", bits=4, group_size=32, name="mxfp4")
    raise ValueError(
        f"quant_method {method!r} in {str(folder)!r} is not supported "
        "(gptq, awq, fp8, compressed-tensors, mxfp4)"
    )
