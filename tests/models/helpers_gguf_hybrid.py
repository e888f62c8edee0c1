"""Tiny Qwen3.5 (`qwen35`, `qwen35moe`) and Gemma 4 (`gemma4`, `write_gemma4_gguf`) GGUF files written
with the `gguf` package the way llama.cpp's convert_hf_to_gguf writes them (its Qwen3NextModel / _LinearAttentionVReorderBase / Qwen3_5TextModel
classes): gguf-py's own tensor-name map, the value heads reordered from grouped to tiled, -exp(A_log),
dt_bias as ssm_dt.bias, conv1d squeezed, zero-centred norms + 1, the experts stacked per projection, and the
metadata keys it writes (ssm.*, full_attention_interval, rope.dimension_count / dimension_sections,
nextn_predict_layers with one extra multi-token-prediction block). Some matrices are written Q8_0 or F16; the
HF reference model gets the same rounded values, so both sides hold identical weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers

from tests.models.helpers_gguf_families import _byte_level_vocab, _sentencepiece_vocab

# matrices written in Q8_0 (rows reordered; out_proj's columns moved by whole blocks) and in F16
Q8_0 = (
    "layers.0.linear_attn.in_proj_z.weight",
    "layers.0.linear_attn.out_proj.weight",
    "layers.3.self_attn.q_proj.weight",
    "layers.1.mlp.down_proj.weight",
    "layers.1.mlp.shared_expert.down_proj.weight",
)
F16 = ("layers.2.linear_attn.in_proj_qkv.weight", "layers.3.self_attn.o_proj.weight")


def _tiled(t: torch.Tensor, dim: int, cfg: Any, head_dim: int) -> torch.Tensor:
    """llama.cpp's `_reorder_v_heads`: value heads grouped by key head -> tiled, along `dim`."""
    shape = list(t.shape)
    r = cfg.linear_num_value_heads // cfg.linear_num_key_heads
    t = t.reshape(*shape[:dim], cfg.linear_num_key_heads, r, head_dim, *shape[dim + 1 :])
    return t.transpose(dim, dim + 1).reshape(shape)


def _reorder(name: str, t: torch.Tensor, cfg: Any) -> torch.Tensor:
    if ".linear_attn." not in name or cfg.linear_num_key_heads == cfg.linear_num_value_heads:
        return t
    qk = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim
    dv = cfg.linear_value_head_dim
    if name.endswith((".in_proj_qkv.weight", ".conv1d.weight")):
        return torch.cat([t[:qk], _tiled(t[qk:], 0, cfg, dv)])
    if name.endswith(".in_proj_z.weight"):
        return _tiled(t, 0, cfg, dv)
    if name.endswith((".in_proj_a.weight", ".in_proj_b.weight")):
        return _tiled(t, 0, cfg, 1)
    if name.endswith((".A_log", ".dt_bias")):
        return _tiled(t[:, None], 0, cfg, 1)[:, 0]
    if name.endswith(".out_proj.weight"):
        return _tiled(t, 1, cfg, dv)
    return t


def _converted(name: str, t: torch.Tensor, cfg: Any) -> list[tuple[str, torch.Tensor]]:
    """(HF name as the converter maps it, tensor) after Qwen3NextModel.modify_tensors' transforms."""
    t = _reorder(name, t, cfg)
    if name.endswith(".A_log"):
        return [(name, -torch.exp(t))]
    if name.endswith(".dt_bias"):
        return [(name.removesuffix(".dt_bias") + ".dt_proj.bias", t)]
    if ".conv1d." in name:
        return [(name, t.squeeze())]
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        return [(name, t + 1)]
    if name.endswith(".mlp.experts.gate_up_proj"):  # [E, 2 * I, H]: gate rows, then up rows
        half = t.shape[1] // 2
        base = name.removesuffix("gate_up_proj")
        return [(base + "gate_proj.weight", t[:, :half]), (base + "up_proj.weight", t[:, half:])]
    if name.endswith(".mlp.experts.down_proj"):
        return [(name + ".weight", t)]
    return [(name, t)]


def _round(
    hf: transformers.PreTrainedModel, q8_0: tuple[str, ...] = Q8_0, f16: tuple[str, ...] = F16
) -> dict[str, str]:
    """Gives the HF model's Q8_0 / F16 matrices their rounded values; {HF name: type} of those."""
    import gguf

    kinds: dict[str, str] = {}
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(q8_0):
                q = gguf.quants.quantize(p.numpy(), gguf.GGMLQuantizationType.Q8_0)
                deq = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0)
                p.copy_(torch.from_numpy(np.ascontiguousarray(deq, dtype=np.float32)))
                kinds[name] = "Q8_0"
            elif name.endswith(f16):
                p.copy_(p.half().float())
                kinds[name] = "F16"
    return kinds


def _metadata(w: Any, cfg: Any, arch: str, mtp: int) -> None:
    """The keys TextModel / Qwen2MoeModel / Qwen3NextModel / _Qwen35MRopeMixin / _Qwen35MtpMixin write."""
    w.add_context_length(cfg.max_position_embeddings)
    w.add_block_count(cfg.num_hidden_layers + mtp)
    w.add_embedding_length(cfg.hidden_size)
    if arch == "qwen35":
        w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    if arch == "qwen35moe":
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    w.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    w.add_ssm_state_size(cfg.linear_key_head_dim)
    w.add_ssm_group_count(cfg.linear_num_key_heads)
    w.add_ssm_time_step_rank(cfg.linear_num_value_heads)
    w.add_ssm_inner_size(cfg.linear_value_head_dim * cfg.linear_num_value_heads)
    interval = cfg.layer_types.index("full_attention") + 1
    w.add_full_attention_interval(interval)
    w.add_rope_dimension_count(int(cfg.head_dim * cfg.rope_parameters["partial_rotary_factor"]))
    w.add_rope_dimension_sections([11, 11, 10, 0])
    if mtp:
        w.add_nextn_predict_layers(mtp)


def write_qwen35_gguf(hf: transformers.PreTrainedModel, out: Path, arch: str) -> Path:
    """The tiny Qwen3.5 model `hf` (`arch` "qwen35" or "qwen35moe") as llama.cpp's converter writes it, with
    one multi-token-prediction block appended. Rounds `hf`'s Q8_0 / F16 matrices in place first."""
    import gguf

    cfg = hf.config
    kinds = _round(hf)
    names = gguf.get_tensor_name_map(
        gguf.MODEL_ARCH.QWEN35 if arch == "qwen35" else gguf.MODEL_ARCH.QWEN35MOE, 8
    )
    w = gguf.GGUFWriter(str(out), arch)
    _metadata(w, cfg, arch, mtp=1)
    _byte_level_vocab(w, cfg.vocab_size)
    for hf_name, tensor in hf.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        kind = kinds.get(hf_name, "F32")
        for name, t in _converted(hf_name, tensor.float(), cfg):
            gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
            assert gguf_name is not None, name
            a = np.ascontiguousarray(t.numpy(), dtype=np.float32)
            if kind == "Q8_0":
                q = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0)
                w.add_tensor(gguf_name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            else:
                w.add_tensor(gguf_name, a.astype(np.float16) if kind == "F16" else a)
    mtp = cfg.num_hidden_layers  # the converter's nextn block: never loaded
    w.add_tensor(
        f"blk.{mtp}.nextn.eh_proj.weight", np.zeros((cfg.hidden_size, 2 * cfg.hidden_size), np.float32)
    )
    w.add_tensor(f"blk.{mtp}.attn_norm.weight", np.ones(cfg.hidden_size, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


GEMMA4_Q8_0 = (
    "layers.0.self_attn.q_proj.weight",
    "layers.2.self_attn.o_proj.weight",
    "layers.5.mlp.down_proj.weight",
)
GEMMA4_F16 = ("layers.3.self_attn.k_proj.weight",)


class _Gemma4Vocab:
    """A GGUFWriter whose tokenizer model is "gemma4" (the tiny sentencepiece vocabulary, as Gemma4Model's
    set_vocab names it)."""

    def __init__(self, writer: Any) -> None:
        self.writer = writer

    def __getattr__(self, name: str) -> Any:
        return getattr(self.writer, name)

    def add_tokenizer_model(self, _model: str) -> None:
        self.writer.add_tokenizer_model("gemma4")


def _gemma4_metadata(w: Any, cfg: dict[str, Any], rope_dims: tuple[int, int] | None = None) -> None:
    """The keys TextModel / Gemma3Model / Gemma4Model write, each with its final (overriding) value; `cfg`:
    the HF config as a dict (the global layers' head size and KV heads under `per_layer_config`);
    `rope_dims`: (global, sliding) rotated dims to write instead of the head sizes."""
    layers = cfg["num_hidden_layers"]
    swa = [t == "sliding_attention" for t in cfg["layer_types"]]
    glob = cfg["per_layer_config"][str(swa.index(False))]
    first_shared = layers - cfg["num_kv_shared_layers"]
    rope = cfg["rope_parameters"]
    w.add_block_count(layers)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    n_ff = cfg["intermediate_size"]
    w.add_feed_forward_length([n_ff if i < first_shared else 2 * n_ff for i in range(layers)])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv([cfg["num_key_value_heads"] if s else glob["num_key_value_heads"] for s in swa])
    w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    w.add_sliding_window(cfg["sliding_window"])
    w.add_shared_kv_layers(cfg["num_kv_shared_layers"])
    w.add_embedding_length_per_layer_input(cfg["hidden_size_per_layer_input"])
    w.add_sliding_window_pattern(swa)
    w.add_key_length(glob["head_dim"])
    w.add_value_length(glob["head_dim"])
    w.add_key_length_swa(cfg["head_dim"])
    w.add_value_length_swa(cfg["head_dim"])
    n_rot, n_rot_swa = rope_dims or (glob["head_dim"], cfg["head_dim"])
    w.add_rope_dimension_count(n_rot)
    w.add_rope_dimension_count_swa(n_rot_swa)
    if cfg.get("enable_moe_block"):
        w.add_expert_count(cfg["num_experts"])
        w.add_expert_used_count(cfg["top_k_experts"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])


def _gemma4_name(names: Any, hf_name: str) -> str:
    """Gemma4Model's filter_tensors / modify_tensors naming: `.weight` added to the layer scalar and the
    experts, the router's scale and the per-expert scale as `.scale` tensors of ffn_gate_inp / ffn_down_exps."""
    bid = hf_name.split(".")[2] if hf_name.startswith("model.layers.") else None
    if hf_name.endswith("router.scale"):
        return f"blk.{bid}.ffn_gate_inp.scale"
    if hf_name.endswith("router.per_expert_scale"):
        return f"blk.{bid}.ffn_down_exps.scale"
    if hf_name.endswith("layer_scalar") or ".experts." in hf_name:
        hf_name += ".weight"
    name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    assert name is not None, hf_name
    return name


def write_gemma4_gguf(
    hf: transformers.PreTrainedModel, cfg: Any, out: Path, rope_dims: tuple[int, int] | None = None
) -> Path:
    """The tiny Gemma 4 text model `hf` as llama.cpp's Gemma4Model converter writes it: norms as they are,
    `layer_scalar` as `layer_output_scale.weight`, the global layers' `rope_freqs` (1 for the rotated pairs,
    1e30 for the others), a sentencepiece vocabulary of type "gemma4" without a space prefix. Rounds `hf`'s
    Q8_0 / F16 matrices in place first. `cfg`: the config `hf` was built
    from (HF's model makes its own per-layer); `rope_dims`: see `_gemma4_metadata`."""
    import gguf

    kinds = _round(hf, GEMMA4_Q8_0, GEMMA4_F16)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, cfg.to_dict()["num_hidden_layers"])
    w = gguf.GGUFWriter(str(out), "gemma4")
    d = cfg.to_dict()
    _gemma4_metadata(w, d, rope_dims)
    _sentencepiece_vocab(_Gemma4Vocab(w), d["vocab_size"])
    w.add_add_space_prefix(False)
    full_dim = d["per_layer_config"][str(d["layer_types"].index("full_attention"))]["head_dim"]
    n_rot = int(full_dim * d["rope_parameters"]["full_attention"]["partial_rotary_factor"] / 2)
    freqs = [1.0] * n_rot + [1e30] * (full_dim // 2 - n_rot)
    w.add_tensor("rope_freqs.weight", np.array(freqs, dtype=np.float32))
    for hf_name, tensor in hf.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.to_dict()["tie_word_embeddings"]:
            continue
        gguf_name = _gemma4_name(names, hf_name)
        a = np.ascontiguousarray(tensor.float().numpy(), dtype=np.float32)
        kind = kinds.get(hf_name, "F32")
        if kind == "Q8_0":
            q = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(gguf_name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(gguf_name, a.astype(np.float16) if kind == "F16" else a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
