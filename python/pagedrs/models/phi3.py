"""Phi-3 (microsoft/Phi-3-mini-4k-instruct, Phi-3-mini-128k-instruct, Phi-3-medium-*, Phi-3.5-mini).

A Llama-shaped decoder whose checkpoints already store the fused tensors pagedrs uses: `qkv_proj`
(q | k | v, with GQA sizes) and `gate_up_proj` (gate | up, SiLU-gated). So it is Llama's module with no
shard mapping; what differs is read from the config by the shared layers:

- RoPE (`get_rope`): "default", or "longrope" for the 128k variants (short/long factors, cos/sin scaled
  by the attention factor, sqrt(1 + ln(factor) / ln(original_max_position_embeddings)) unless given),
  and `partial_rotary_factor` when the config has one.
- Sliding window (`config.sliding_window`, 2047 in the 4k variant) on every layer's `Attention`, so the
  paged attention path masks keys more than `sliding_window - 1` positions behind the query (HF's rule).

Long vs short factors: HF transformers (5.x) picks them for the whole sequence from its current length
(long once `max(position) + 1 > original_max_position_embeddings`), and `generate` drops and recomputes
the KV cache on the step a sequence crosses that length, so every step equals a full forward with one
set of factors. Here the choice is per request from its context length after the step
(`token_seq_lens`): identical to HF while a request stays on one side of the threshold. A request whose
prefill chunks or decodes cross it keeps the K already cached with the short factors; matching HF there
needs the engine to recompute the request (as after a preemption) when it crosses.
"""

from __future__ import annotations

from pagedrs.models.llama import LlamaForCausalLM

__all__ = ["Phi3ForCausalLM"]


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3: HF names map 1:1 onto the parameters (`qkv_proj`, `gate_up_proj` loaded unsplit)."""

    stacked_params = ()
