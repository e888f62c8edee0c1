"""Gemma 4 text GGUF files (`gemma4`) as llama.cpp's converter writes them, read back into HF's
Gemma4ForCausalLM names and config.

The converter stores Gemma 4's norm weights as they are (no + 1, unlike Gemma 2 / 3); `layer_scalar` is
`layer_output_scale.weight`; the per-layer input embeddings are `per_layer_token_embd`, `per_layer_model_proj`
and `per_layer_proj_norm`, a layer's `inp_gate` / `proj` / `post_norm`; the MoE block's router is
`ffn_gate_inp` (its scale `ffn_gate_inp.scale`), the experts `ffn_gate_up_exps` / `ffn_down_exps` (the
per-expert scale `ffn_down_exps.scale`). The config comes from the metadata: local / global head sizes
(`key_length_swa` / `key_length`), per-layer KV head counts, the sliding pattern (`sliding_window_pattern`),
`shared_kv_layers`, the per-layer widths of the double-wide MLP (`feed_forward_length` as an array), both
RoPE bases (`rope.freq_base` / `rope.freq_base_swa`), the dims each layer type rotates
(`rope.dimension_count` / `rope.dimension_count_swa`: llama.cpp's `n_rot`, the leading dims of a head, with
frequencies over those dims), and the global layers' partial RoPE from the `rope_freqs` tensor (1 for the
rotated pairs). A global layer without `attn_v` reuses k as v (`attention_k_eq_v`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from pagedrs.loader.gguf_reader import field_value as _field

if TYPE_CHECKING:
    import transformers
    from gguf import GGUFReader

__all__ = ["GEMMA4_GLOBAL_NAMES", "gemma4_add_bos", "gemma4_config", "gemma4_tensor_name"]

GEMMA4_GLOBAL_NAMES = {
    "per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
    "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
    "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight",
}
_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "inp_gate.weight": "per_layer_input_gate.weight",
    "proj.weight": "per_layer_projection.weight",
    "post_norm.weight": "post_per_layer_input_norm.weight",
    "layer_output_scale.weight": "layer_scalar",
    "ffn_gate_inp.weight": "router.proj.weight",
    "ffn_gate_inp.scale": "router.scale",
    "ffn_gate_up_exps.weight": "experts.gate_up_proj",
    "ffn_down_exps.weight": "experts.down_proj",
    "ffn_down_exps.scale": "router.per_expert_scale",
    "pre_ffw_norm_2.weight": "pre_feedforward_layernorm_2.weight",
    "post_ffw_norm_1.weight": "post_feedforward_layernorm_1.weight",
    "post_ffw_norm_2.weight": "post_feedforward_layernorm_2.weight",
}


def gemma4_tensor_name(gguf_name: str) -> str | None:
    """The HF name of a `gemma4` tensor beyond the common global ones, None for an unknown name."""
    if gguf_name in GEMMA4_GLOBAL_NAMES:
        return GEMMA4_GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _BLOCK:
        return f"model.layers.{parts[1]}.{_BLOCK[parts[2]]}"
    return None


def _required(reader: GGUFReader, key: str) -> Any:
    value = _field(reader, f"gemma4.{key}")
    if value is None:
        raise ValueError(f"gemma4 GGUF file has no gemma4.{key} in its metadata")
    return value


def _per_layer(value: Any, n: int) -> list[int]:
    return [int(v) for v in value] if isinstance(value, list) else [int(value)] * n


def _full_rope_fraction(reader: GGUFReader, head_dim: int) -> float:
    """The rotated fraction of a global head's `head_dim` rotary dims: `rope_freqs` holds 1 for each rotated
    pair (1e30 for the others), as the converter writes it for HF's proportional RoPE."""
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            return 2 * int(np.count_nonzero(np.asarray(t.data) < 1e29)) / head_dim
    return 1.0


def _rope_dims(reader: GGUFReader, key: str, head_dim: int) -> int:
    """The leading dims of a head that RoPE rotates (`gemma4.<key>`, the head size when absent)."""
    value = _field(reader, f"gemma4.{key}")
    n_rot = head_dim if value is None else int(value)
    if n_rot <= 0 or n_rot % 2 or n_rot > head_dim:
        raise ValueError(f"gemma4.{key}={n_rot} must be even and in (0, {head_dim}] (the head size)")
    return n_rot


def _rope_parameters(reader: GGUFReader, local_dim: int, global_dim: int) -> dict[str, Any]:
    """Per layer type, RoPE as llama.cpp applies it: the sliding layers' default RoPE over their first
    `rope.dimension_count_swa` dims, the global layers' proportional RoPE over their first
    `rope.dimension_count` dims (`rotary_dim`, only where it is not the whole head)."""
    local_rot = _rope_dims(reader, "rope.dimension_count_swa", local_dim)
    global_rot = _rope_dims(reader, "rope.dimension_count", global_dim)
    sliding: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": float(_field(reader, "gemma4.rope.freq_base_swa") or 10000.0),
    }
    if local_rot != local_dim:
        sliding["partial_rotary_factor"] = local_rot / local_dim
    full: dict[str, Any] = {
        "rope_type": "proportional",
        "partial_rotary_factor": _full_rope_fraction(reader, global_rot),
        "rope_theta": float(_field(reader, "gemma4.rope.freq_base") or 1_000_000.0),
    }
    if global_rot != global_dim:
        full["rotary_dim"] = global_rot
    return {"sliding_attention": sliding, "full_attention": full}


def gemma4_config(reader: GGUFReader) -> transformers.PretrainedConfig:
    """HF's Gemma4TextConfig from a `gemma4` file's metadata (see the module docstring)."""
    import transformers

    layers = int(_required(reader, "block_count"))
    swa = [bool(v) for v in _required(reader, "attention.sliding_window_pattern")]
    layer_types = ["sliding_attention" if s else "full_attention" for s in swa]
    kv = _per_layer(_required(reader, "attention.head_count_kv"), layers)
    ffn = _per_layer(_required(reader, "feed_forward_length"), layers)
    first_full = swa.index(False) if False in swa else 0
    shapes = {t.name: [int(d) for d in t.shape] for t in reader.tensors}
    global_dim = int(_required(reader, "attention.key_length"))
    local_dim = int(_field(reader, "gemma4.attention.key_length_swa") or global_dim)
    experts = _field(reader, "gemma4.expert_count")
    per_layer = int(_field(reader, "gemma4.embedding_length_per_layer_input") or 0)
    kw: dict[str, Any] = dict(
        vocab_size=shapes["token_embd.weight"][1],  # GGUF lists the fastest-varying dim first
        hidden_size=int(_required(reader, "embedding_length")),
        intermediate_size=ffn[0],
        use_double_wide_mlp=any(f == 2 * ffn[0] for f in ffn),
        num_hidden_layers=layers,
        layer_types=layer_types,
        num_attention_heads=int(_required(reader, "attention.head_count")),
        num_key_value_heads=kv[swa.index(True)] if True in swa else kv[0],
        num_global_key_value_heads=kv[first_full],
        head_dim=local_dim,
        global_head_dim=global_dim,
        attention_k_eq_v=f"blk.{first_full}.attn_v.weight" not in shapes,
        sliding_window=int(_required(reader, "attention.sliding_window")),
        num_kv_shared_layers=int(_field(reader, "gemma4.attention.shared_kv_layers") or 0),
        hidden_size_per_layer_input=per_layer,
        vocab_size_per_layer_input=shapes.get("per_layer_token_embd.weight", [0, 0])[1] or None,
        final_logit_softcapping=_field(reader, "gemma4.final_logit_softcapping"),
        max_position_embeddings=int(_required(reader, "context_length")),
        rms_norm_eps=float(_required(reader, "attention.layer_norm_rms_epsilon")),
        rope_parameters=_rope_parameters(reader, local_dim, global_dim),
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
        tie_word_embeddings="output.weight" not in shapes,
    )
    if kw["vocab_size_per_layer_input"] is None:
        del kw["vocab_size_per_layer_input"]
    if experts:
        kw.update(
            enable_moe_block=True,
            num_experts=int(experts),
            top_k_experts=int(_required(reader, "expert_used_count")),
            moe_intermediate_size=int(_required(reader, "expert_feed_forward_length")),
        )
    config = transformers.Gemma4TextConfig(**kw)
    config.architectures = ["Gemma4ForCausalLM"]
    return config


def gemma4_add_bos(tokenizer: Any, reader: GGUFReader) -> None:
    """Makes `tokenizer` (transformers' reading of a "gemma4" vocabulary, which adds no BOS) put BOS first
    when the file asks for it (`tokenizer.ggml.add_bos_token`, as the converter writes for Gemma 4)."""
    from tokenizers import processors

    bos_id = _field(reader, "tokenizer.ggml.bos_token_id")
    if not _field(reader, "tokenizer.ggml.add_bos_token") or bos_id is None:
        return
    if tokenizer("a").input_ids[:1] == [int(bos_id)]:
        return
    bos = tokenizer.convert_ids_to_tokens(int(bos_id))
    tokenizer.bos_token = bos
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, int(bos_id))]
    )
