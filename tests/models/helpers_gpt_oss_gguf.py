"""A tiny random gpt-oss written as a GGUF file the way llama.cpp's convert_hf_to_gguf (GptOssModel,
architecture "gpt-oss") writes it: HF's interleaved `gate_up_proj` [E, H, 2I] split into `ffn_gate_exps` /
`ffn_up_exps` [E, I, H] (gate at the even, up at the odd columns) and `down_proj` transposed into
`ffn_down_exps` [E, H, I], each with its `.bias`; the router as `ffn_gate_inp` (+ bias), the sinks as
`attn_sinks.weight`, `post_attention_norm` for the norm before the experts; the metadata it writes
(sliding window, expert sizes and counts, YaRN rope scaling); a byte-level BPE vocabulary."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
import transformers

from tests.helpers import CHAT_TEMPLATE
from tests.models.helpers_gguf_families import _byte_level_vocab, family_metadata
from tests.models.helpers_gpt_oss import make_tiny_gpt_oss

_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.router": "ffn_gate_inp",
}
_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_tensors(hf: transformers.PreTrainedModel) -> dict[str, np.ndarray]:
    """HF gpt-oss's float32 state dict under llama.cpp's names and layouts."""
    out: dict[str, np.ndarray] = {}
    for name, tensor in hf.state_dict().items():
        a = tensor.float().numpy()
        if name in _GLOBAL:
            out[_GLOBAL[name]] = a
            continue
        parts = name.split(".")
        blk, tail = parts[2], ".".join(parts[3:])
        if tail == "self_attn.sinks":
            out[f"blk.{blk}.attn_sinks.weight"] = a
        elif tail == "mlp.experts.gate_up_proj":  # [E, H, 2I] -> rows [E, 2I, H], de-interleaved
            rows = a.swapaxes(-1, -2)
            out[f"blk.{blk}.ffn_gate_exps.weight"] = rows[:, 0::2]
            out[f"blk.{blk}.ffn_up_exps.weight"] = rows[:, 1::2]
        elif tail == "mlp.experts.gate_up_proj_bias":
            out[f"blk.{blk}.ffn_gate_exps.bias"] = a[:, 0::2]
            out[f"blk.{blk}.ffn_up_exps.bias"] = a[:, 1::2]
        elif tail == "mlp.experts.down_proj":  # [E, I, H] -> [E, H, I]
            out[f"blk.{blk}.ffn_down_exps.weight"] = a.swapaxes(-1, -2)
        elif tail == "mlp.experts.down_proj_bias":
            out[f"blk.{blk}.ffn_down_exps.bias"] = a
        else:
            module, kind = tail.rsplit(".", 1)
            out[f"blk.{blk}.{_LAYER[module]}.{kind}"] = a
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}


def _metadata(w: gguf.GGUFWriter, cfg: transformers.GptOssConfig) -> None:
    family_metadata(w, cfg, "gpt-oss")
    w.add_expert_count(cfg.num_local_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_sliding_window(cfg.sliding_window)
    w.add_expert_feed_forward_length(cfg.intermediate_size)
    rope = cfg.rope_parameters
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(float(rope["factor"]))
    w.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))


def write_gpt_oss_gguf(
    src: Path, out: Path, experts: str = "F32", others: str = "F32", drop: tuple[str, ...] = ()
) -> Path:
    """The HF gpt-oss folder `src` as a GGUF file at `out`: experts in `experts` ("F32", "Q8_0", "MXFP4",
    quantized by gguf-py), the other matrices in `others`, the router, norms, sinks and biases float32
    (as llama.cpp keeps them). `drop`: tensors left out."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    w = gguf.GGUFWriter(str(out), "gpt-oss")
    _metadata(w, hf.config)
    _byte_level_vocab(w, hf.config.vocab_size)
    w.add_chat_template(CHAT_TEMPLATE)
    for name, a in gguf_tensors(hf).items():
        if name in drop:
            continue
        qtype = experts if "_exps.weight" in name else others
        if a.ndim >= 2 and qtype != "F32" and name.endswith(".weight") and "ffn_gate_inp" not in name:
            qt = getattr(gguf.GGMLQuantizationType, qtype)
            q = gguf.quants.quantize(a, qt)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qt)
        else:
            w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def make_tiny_gpt_oss_gguf(
    root: Path, experts: str = "F32", others: str = "F32", drop: tuple[str, ...] = ()
) -> tuple[Path, Path]:
    """(HF source folder, GGUF file) of a tiny gpt-oss: helpers_gpt_oss's config with the SwiGLU limit
    llama.cpp's gpt-oss graph fixes (7.0; a GGUF file carries none)."""
    src = make_tiny_gpt_oss(root / "src", swiglu_limit=7.0)
    return src, write_gpt_oss_gguf(src, root / f"tiny-gpt-oss-{experts}.gguf", experts, others, drop)
