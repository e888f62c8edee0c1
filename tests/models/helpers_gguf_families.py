"""Tiny Qwen3 / Gemma 2 / Gemma 3 GGUF files written with the `gguf` package the way llama.cpp's
convert_hf_to_gguf writes them: its tensor names (attn_q_norm, post_attention_norm, post_ffw_norm, and
ffn_norm as Gemma's pre-MLP norm), Gemma's norm weights stored with 1 added, the metadata keys it writes
(key_length, soft caps, sliding window), no Q/K permutation; Qwen3 with a byte-level BPE vocabulary,
Gemma with a sentencepiece one that asks for BOS (as the Gemma files do)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers

from tests.helpers import BOS_ID, EOS_ID, PAD_ID, load_hf_model, make_tokenizer

_BLOCK = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_LLAMA_NORMS = {"post_attention_layernorm": "ffn_norm"}
_GEMMA_NORMS = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_name(hf_name: str, gemma: bool) -> str:
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    parts = hf_name.split(".")
    module = ".".join(parts[3:-1])
    table = {**_BLOCK, **(_GEMMA_NORMS if gemma else _LLAMA_NORMS)}
    return f"blk.{parts[2]}.{table[module]}.{parts[-1]}"


def _byte_level_vocab(w: Any, vocab_size: int) -> None:
    tokens = [f"<extra_{i}>" for i in range(vocab_size)]
    for t, i in make_tokenizer().get_vocab().items():
        tokens[i] = t
    tokens[259] = "ab"  # transformers' GGUF reader wants at least one merge
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * 256 + [3] * (vocab_size - 256))
    w.add_token_merges(["a b"])
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_pad_token_id(PAD_ID)


def _sentencepiece_vocab(w: Any, vocab_size: int) -> None:
    """Byte-fallback pieces 0..255, <bos>/<eos>/<pad>/<unk> at the tiny configs' ids, then ▁ and the
    lowercase letters; llama.cpp's Gemma files set add_bos_token."""
    tokens = [f"<0x{b:02X}>" for b in range(256)] + ["<bos>", "<eos>", "<pad>", "<unk>", "\u2581"]
    tokens += [chr(c) for c in range(ord("a"), ord("z") + 1)]
    types = [6] * 256 + [3, 3, 3, 2] + [1] * (len(tokens) - 260)
    while len(tokens) < vocab_size:
        tokens.append(f"<unused{len(tokens)}>")
        types.append(5)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * 260 + [-float(i) for i in range(vocab_size - 260)])
    w.add_token_types(types)
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_pad_token_id(PAD_ID)
    w.add_unk_token_id(259)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)


def family_metadata(w: Any, cfg: transformers.PretrainedConfig, arch: str) -> None:
    """The shape, norm and rope keys llama.cpp writes for `arch`, from the HF config."""
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    params = cfg.rope_parameters
    theta = params["full_attention"]["rope_theta"] if arch == "gemma3" else params["rope_theta"]
    w.add_rope_freq_base(float(theta))
    if arch.startswith("gemma"):
        w.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)


def write_family_gguf(src: Path, out: Path, arch: str, qtype: str = "Q8_0") -> Path:
    """The HF folder `src` (a tiny "qwen3", "gemma2" or "gemma3" model) as a GGUF file at `out`: matrices
    in `qtype` ("Q8_0", "F16" or "F32"), norms and vectors float32."""
    import gguf

    hf = load_hf_model(src)
    cfg = hf.config
    state = hf.state_dict()
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    gemma = arch.startswith("gemma")
    w = gguf.GGUFWriter(str(out), arch)
    family_metadata(w, cfg, arch)
    (_sentencepiece_vocab if gemma else _byte_level_vocab)(w, cfg.vocab_size)
    for name, tensor in state.items():
        a = tensor.to(torch.float32).numpy()
        if gemma and name.endswith("norm.weight"):
            a = a + 1.0  # llama.cpp: Gemma's (1 + w) norms stored with the 1 added
        if a.ndim == 2 and qtype != "F32":
            qt = getattr(gguf.GGMLQuantizationType, qtype)
            q = gguf.quants.quantize(np.ascontiguousarray(a), qt)
            w.add_tensor(gguf_name(name, gemma), q, raw_shape=q.shape, raw_dtype=qt)
        else:
            w.add_tensor(gguf_name(name, gemma), np.ascontiguousarray(a, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def hf_gguf_model(path: Path) -> transformers.PreTrainedModel:
    """HF transformers' own GGUF load of `path` (its config reader, dequantization and renaming), float32."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = transformers.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    assert not result.unexpected_keys and set(result.missing_keys) <= {"lm_head.weight"}, result
    model.tie_weights()
    return model
