"""The torch dtype a model runs in: the names `dtype=` takes, and what "auto" means on each device."""

from __future__ import annotations

import torch
import transformers

__all__ = ["resolve_dtype"]

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def resolve_dtype(
    dtype: str | torch.dtype, config: transformers.PretrainedConfig, device: torch.device
) -> torch.dtype:
    """ "auto": float32 on CPU; on CUDA the checkpoint's half type, bfloat16 for float32 checkpoints."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        try:
            return _DTYPES[dtype]
        except KeyError:
            raise ValueError(f"unknown dtype {dtype!r}; choose auto, {', '.join(_DTYPES)}") from None
    if device.type == "cpu":
        return torch.float32
    cfg = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(cfg, str):
        cfg = _DTYPES.get(cfg)
    if cfg in (torch.float16, torch.bfloat16):
        return cfg
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float16
    return torch.bfloat16
