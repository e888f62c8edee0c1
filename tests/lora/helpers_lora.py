"""PEFT adapters for the tiny test models, and HF transformers + PEFT greedy references.

    make_peft_adapter(base, out, seed=..., r=..., target_modules=..., **lora_config) -> Path
    PeftReference(base, adapter)(prompt, max_tokens) -> greedy token ids (unmerged; merged=True merges)

The adapters have random non-zero lora_B (PEFT starts B at zero, which would make the delta vanish)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from tests.helpers import load_hf_model

ATTN_MLP = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_peft_adapter(
    base: str | Path,
    out: str | Path,
    *,
    seed: int = 0,
    r: int = 8,
    lora_alpha: float = 16,
    target_modules: Sequence[str] = ATTN_MLP,
    **lora_config: Any,
) -> Path:
    """A PEFT LoRA adapter folder for the model at `base`, saved with `save_pretrained` in `out`."""
    from peft import LoraConfig, get_peft_model

    model = load_hf_model(base)
    cfg = LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=list(target_modules), **lora_config)
    peft_model = get_peft_model(model, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    out = Path(out)
    peft_model.save_pretrained(str(out))
    return out


class PeftReference:
    """Greedy continuations by HF transformers with the adapter loaded by `PeftModel.from_pretrained`
    (float32, batch of one, no eos stop)."""

    def __init__(self, base: str | Path, adapter: str | Path | None, *, merged: bool = False) -> None:
        model: Any = load_hf_model(base)
        if adapter is not None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, str(adapter))
            if merged:
                model = model.merge_and_unload()
        self.model = model.eval()

    def __call__(self, prompt: list[int], max_tokens: int) -> list[int]:
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_tokens,
                eos_token_id=[],
                pad_token_id=0,
            )
        return out[0, len(prompt) :].tolist()
