"""SmolLM3 (HuggingFaceTB/SmolLM3-3B), as HF's SmolLM3ForCausalLM: Llama's layer, except that the layers
`config.no_rope_layers` marks 0 (every 4th by default) use no rotary embedding (NoPE); a sliding window only
on those layers when `use_sliding_window` is set (`layer_types`)."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from pagedrs.distributed.group import TPGroup
from pagedrs.layers.rotary import RotaryEmbedding
from pagedrs.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel

__all__ = ["SmolLM3ForCausalLM"]


class SmolLM3ForCausalLM(LlamaForCausalLM):
    def make_model(
        self, config: PretrainedConfig, *, tp: TPGroup, dtype: torch.dtype, device: torch.device
    ) -> LlamaModel:
        n = config.num_hidden_layers
        interval = int(getattr(config, "no_rope_layer_interval", 4))
        uses_rope = getattr(config, "no_rope_layers", None) or [
            int((i + 1) % interval != 0) for i in range(n)
        ]

        def layer(i: int, rotary_emb: RotaryEmbedding | None, window: int | None) -> LlamaDecoderLayer:
            rope = rotary_emb if uses_rope[i] else None
            return LlamaDecoderLayer(
                config, i, rope, window, qk_norm=False, tp=tp, dtype=dtype, device=device
            )

        return LlamaModel(config, tp=tp, dtype=dtype, device=device, make_layer=layer)
