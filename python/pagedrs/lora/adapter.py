"""A PEFT LoRA adapter folder read into per-module (A, B, scaling) on the host.

The folder is what `PeftModel.save_pretrained` writes: `adapter_config.json` (`r`, `lora_alpha`,
`use_rslora`, `rank_pattern`, `alpha_pattern`, `target_modules`) and `adapter_model.safetensors` (or
`adapter_model.bin`) with tensors named `base_model.model.<module>.lora_A.weight` [r, in] and
`...lora_B.weight` [out, r]. Scaling is PEFT's: alpha / r, or alpha / sqrt(r) with rsLoRA, where a module
named by `rank_pattern` / `alpha_pattern` takes its own r / alpha (matched as PEFT's `get_pattern_key`).
Variants that change the forward (DoRA, LoRA biases, `modules_to_save`) are refused by name.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["LoRAAdapter", "LoRAWeights", "load_peft_adapter"]

_PREFIX = "base_model.model."


@dataclass(frozen=True)
class LoRAWeights:
    """One module's low-rank delta: y += (x A^T) B^T * scaling."""

    lora_a: Tensor  # [r, in]
    lora_b: Tensor  # [out, r]
    scaling: float

    @property
    def rank(self) -> int:
        return int(self.lora_a.shape[0])


@dataclass(frozen=True)
class LoRAAdapter:
    """An adapter on the host: module name in the HF model (e.g. "model.layers.0.self_attn.q_proj") ->
    its weights."""

    path: str
    modules: dict[str, LoRAWeights] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        """The largest rank over its modules."""
        return max((w.rank for w in self.modules.values()), default=0)


def _pattern_value(patterns: dict[str, int | float], module: str, default: float) -> float:
    """PEFT's `get_pattern_key`: a key matches a module name that equals it or ends with "." + it."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return float(value)
    return default


def _read_tensors(path: str) -> dict[str, Tensor]:
    st = os.path.join(path, "adapter_model.safetensors")
    if os.path.exists(st):
        from safetensors.torch import load_file

        return load_file(st)
    bin_path = os.path.join(path, "adapter_model.bin")
    if os.path.exists(bin_path):
        return torch.load(bin_path, map_location="cpu", weights_only=True)
    raise ValueError(f"LoRA adapter {path!r} has no adapter_model.safetensors (or adapter_model.bin)")


def _read_config(path: str) -> dict:
    cfg_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"LoRA adapter {path!r} has no adapter_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise ValueError(f"LoRA adapter {path!r}: peft_type {peft_type!r} is not supported (only LORA)")
    for key in ("use_dora", "lora_bias"):
        if cfg.get(key):
            raise ValueError(f"LoRA adapter {path!r}: {key}=true is not supported")
    if cfg.get("modules_to_save"):
        raise ValueError(
            f"LoRA adapter {path!r}: modules_to_save {cfg['modules_to_save']!r} is not supported "
            "(only low-rank deltas on linear layers)"
        )
    return cfg


def load_peft_adapter(path: str, *, max_lora_rank: int, dtype: torch.dtype = torch.float32) -> LoRAAdapter:
    """Read a PEFT adapter folder; ValueError naming the rank when one is above `max_lora_rank`, and
    naming the tensor when the folder does not add up."""
    path = os.path.expanduser(path)
    if not os.path.isdir(path):
        raise ValueError(f"LoRA adapter path {path!r} is not a folder")
    cfg = _read_config(path)
    r_default = int(cfg.get("r", 8))
    alpha_default = float(cfg.get("lora_alpha", 8))
    rslora = bool(cfg.get("use_rslora", False))
    rank_pattern = cfg.get("rank_pattern") or {}
    alpha_pattern = cfg.get("alpha_pattern") or {}
    pairs: dict[str, dict[str, Tensor]] = {}
    for name, tensor in _read_tensors(path).items():
        m = re.fullmatch(r"(.*)\.(lora_A|lora_B)(?:\.[^.]+)?\.weight", name)
        if m is None:
            raise ValueError(f"LoRA adapter {path!r}: unexpected tensor {name!r}")
        module = m.group(1).removeprefix(_PREFIX)
        pairs.setdefault(module, {})[m.group(2)] = tensor
    modules: dict[str, LoRAWeights] = {}
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"lora_A", "lora_B"}:
            raise ValueError(f"LoRA adapter {path!r}: module {module!r} lacks lora_A or lora_B")
        a, b = ab["lora_A"], ab["lora_B"]
        r = int(_pattern_value(rank_pattern, module, r_default))
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != r or b.shape[1] != r:
            raise ValueError(
                f"LoRA adapter {path!r}: module {module!r} has lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)}, expected rank {r}"
            )
        if r > max_lora_rank:
            raise ValueError(
                f"LoRA adapter {path!r}: rank {r} (module {module!r}) is larger than max_lora_rank "
                f"({max_lora_rank}); start the engine with max_lora_rank >= {r}"
            )
        alpha = _pattern_value(alpha_pattern, module, alpha_default)
        scaling = alpha / math.sqrt(r) if rslora else alpha / r
        modules[module] = LoRAWeights(a.to(dtype).contiguous(), b.to(dtype).contiguous(), scaling)
    if not modules:
        raise ValueError(f"LoRA adapter {path!r} has no lora_A / lora_B tensors")
    return LoRAAdapter(path, modules)
