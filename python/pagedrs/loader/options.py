"""How a model is loaded beyond its path: vLLM's loading arguments (`load_format`, `revision`,
`download_dir`, `gguf_file`, the Hub token, `trust_remote_code`, `tokenizer_mode`, `tokenizer_revision`, `quantization`) and the overrides of the
model's own config (`rope_scaling`, `rope_theta`, `disable_sliding_window`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["LoadOptions", "apply_overrides", "init_dummy_weights"]


@dataclass(frozen=True)
class LoadOptions:
    load_format: str = "auto"  # auto | safetensors | pt | gguf | dummy
    revision: str | None = None
    tokenizer_revision: str | None = None
    download_dir: str | None = None
    gguf_file: str | None = None  # the one .gguf file of a Hub repo (or local folder) to load
    token: str | bool | None = None  # Hub token (None: HF_TOKEN or the saved login, as huggingface_hub)
    trust_remote_code: bool = False
    tokenizer_mode: str = "auto"  # auto (fast) | slow
    overrides: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    quantization: str | None = None  # forced format (vLLM's `quantization=`); None: what config.json says


def apply_overrides(config: Any, overrides: dict[str, Any]) -> int | None:
    """Apply rope and sliding-window overrides to an HF config in place. Returns the context cap that
    `disable_sliding_window` sets (the window: vLLM's rule), else None."""
    from pagedrs.layers.rotary import rope_parameters

    if "rope_scaling" in overrides or "rope_theta" in overrides:
        params = rope_parameters(config)
        scaling = dict(overrides.get("rope_scaling") or {})
        if "type" in scaling and "rope_type" not in scaling:
            scaling["rope_type"] = scaling.pop("type")
        params.update(scaling)
        if overrides.get("rope_theta") is not None:
            params["rope_theta"] = float(overrides["rope_theta"])
        config.rope_parameters = params
    cap = None
    if overrides.get("disable_sliding_window"):
        window = getattr(config, "sliding_window", None)
        if window and getattr(config, "use_sliding_window", True) is not False:
            cap = int(window)
        if window is not None:
            config.sliding_window = None
    return cap


@torch.no_grad()
def init_dummy_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """load_format="dummy": every parameter uniform in [-1e-3, 1e-3] (vLLM's dummy weights), no file read."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for p in model.parameters():
        values = torch.empty(p.shape, dtype=torch.float32).uniform_(-1e-3, 1e-3, generator=gen)
        p.data.copy_(values.to(p.dtype))
