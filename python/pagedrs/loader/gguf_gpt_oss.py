"""gpt-oss GGUF files as llama.cpp writes them (convert_hf_to_gguf's GptOssModel, architecture "gpt-oss",
llama.cpp's LLM_ARCH_OPENAI_MOE).

Tensors: the router `ffn_gate_inp` (+ bias), the attention sinks `attn_sinks.weight`, `post_attention_norm`
(the norm before the experts), and the experts stacked per projection: HF's `gate_up_proj` [E, H, 2I], whose
columns interleave gate and up, is written de-interleaved as `ffn_gate_exps` / `ffn_up_exps` [E, I, H] (rows
of experts, any GGML type: MXFP4 in the released files, F16/F32/Q8_0 possible), `down_proj` transposed as
`ffn_down_exps` [E, H, I], each with a float32 `.bias` ([E, I] / [E, H]). Loading gives back HF's names:
the biases re-interleaved into `experts.gate_up_proj_bias`, the sinks as `self_attn.sinks`; the stacked
expert weights are split per expert by the shared GGUF MoE loader (`gguf_moe`).

Config: built here from the metadata (transformers' GGUF config reader fails on gpt-oss's `rope.scaling.*`
keys): the experts' width `expert_feed_forward_length`, `expert_count` / `expert_used_count`, the window
`attention.sliding_window` applied to the even layers (llama.cpp's swa pattern 2, HF's `layer_types`), YaRN
from `rope.scaling.{type,factor,original_context_length}` with HF gpt-oss's correction range (`truncate`
False: the checkpoints' setting; llama.cpp itself rounds the range outwards). The clamped SwiGLU's limit
and alpha have no key: HF's defaults (7.0, 1.702), the constants of llama.cpp's gpt-oss graph.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pagedrs.loader.gguf_reader import field_value as _field

if TYPE_CHECKING:
    import transformers
    from gguf import GGUFReader

__all__ = ["ARCH", "GPT_OSS_BLOCK_NAMES", "check_gpt_oss_tensors", "gpt_oss_config", "gpt_oss_weights"]

ARCH = "gpt-oss"
# llama.cpp's block tensor names that differ from the shared table's meaning (merged over it)
GPT_OSS_BLOCK_NAMES = {
    "attn_sinks": "self_attn.sinks",
    "ffn_gate_inp": "mlp.router",
    "post_attention_norm": "post_attention_layernorm",
}
_LAYER_TENSORS = (
    "attn_norm.weight",
    "post_attention_norm.weight",
    *(f"attn_{p}.{k}" for p in ("q", "k", "v", "output") for k in ("weight", "bias")),
    "attn_sinks.weight",
    "ffn_gate_inp.weight",
    "ffn_gate_inp.bias",
    *(f"ffn_{p}_exps.{k}" for p in ("gate", "up", "down") for k in ("weight", "bias")),
)


def _required(reader: GGUFReader, key: str, path: Path | str) -> Any:
    value = _field(reader, f"{ARCH}.{key}")
    if value is None:
        raise ValueError(f"{path}: gpt-oss GGUF metadata has no {ARCH}.{key}")
    return value


def check_gpt_oss_tensors(path: Path | str, reader: GGUFReader) -> None:
    """ValueError naming the first tensor a gpt-oss model needs that the file lacks (every layer's
    attention with biases and sinks, router with bias, the three stacked expert projections with biases)."""
    names = {t.name for t in reader.tensors}
    fused = sorted(n for n in names if ".ffn_gate_up_exps." in n)
    if fused:
        raise ValueError(
            f"{path}: GGUF tensor {fused[0]!r}: fused gate/up experts (convert_hf_to_gguf's "
            "--fuse-gate-up-exps) are not supported; convert without that option"
        )
    layers = int(_required(reader, "block_count", path))
    wanted = ["token_embd.weight", "output_norm.weight"]
    wanted += [f"blk.{i}.{name}" for i in range(layers) for name in _LAYER_TENSORS]
    for name in wanted:
        if name not in names:
            raise ValueError(f"{path}: gpt-oss GGUF file has no tensor {name!r}")


def _rope_parameters(reader: GGUFReader, path: Path | str) -> dict[str, Any]:
    theta = _field(reader, f"{ARCH}.rope.freq_base")
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": float(theta or 150000.0)}
    kind = _field(reader, f"{ARCH}.rope.scaling.type")
    if kind in (None, "none"):
        return params
    if kind != "yarn":
        raise ValueError(f"{path}: gpt-oss GGUF rope scaling {kind!r} is not YaRN, the only one gpt-oss uses")
    params.update(
        rope_type="yarn",
        factor=float(_required(reader, "rope.scaling.factor", path)),
        original_max_position_embeddings=int(_required(reader, "rope.scaling.original_context_length", path)),
        beta_fast=float(_field(reader, f"{ARCH}.rope.scaling.yarn_beta_fast") or 32.0),
        beta_slow=float(_field(reader, f"{ARCH}.rope.scaling.yarn_beta_slow") or 1.0),
        truncate=False,
    )
    return params


def gpt_oss_config(reader: GGUFReader, path: Path | str) -> transformers.GptOssConfig:
    """HF's GptOssConfig from a gpt-oss GGUF file's metadata (see the module docstring); the tensors
    checked first (`check_gpt_oss_tensors`)."""
    import transformers

    check_gpt_oss_tensors(path, reader)
    layers = int(_required(reader, "block_count", path))
    heads = int(_required(reader, "attention.head_count", path))
    hidden = int(_required(reader, "embedding_length", path))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab = _field(reader, f"{ARCH}.vocab_size") or (len(tokens) if tokens else None)
    if vocab is None:
        raise ValueError(f"{path}: gpt-oss GGUF file gives no vocabulary size")
    width = _field(reader, f"{ARCH}.expert_feed_forward_length") or _required(
        reader, "feed_forward_length", path
    )
    config = transformers.GptOssConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(width),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(_field(reader, f"{ARCH}.attention.head_count_kv") or heads),
        head_dim=int(_field(reader, f"{ARCH}.attention.key_length") or hidden // heads),
        num_local_experts=int(_required(reader, "expert_count", path)),
        num_experts_per_tok=int(_required(reader, "expert_used_count", path)),
        sliding_window=int(_required(reader, "attention.sliding_window", path)),
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        max_position_embeddings=int(_required(reader, "context_length", path)),
        rms_norm_eps=float(_required(reader, "attention.layer_norm_rms_epsilon", path)),
        rope_parameters=_rope_parameters(reader, path),
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
        tie_word_embeddings=all(t.name != "output.weight" for t in reader.tensors),
    )
    config.architectures = ["GptOssForCausalLM"]
    return config


def _dense(t: Any) -> torch.Tensor:
    read = getattr(t, "materialize", None)
    return read() if read is not None else torch.as_tensor(t)


def gpt_oss_weights(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """The GGUF loader's (HF name, tensor) stream of a gpt-oss file under HF's names: the sinks'
    `.weight` dropped, `experts.gate_exps.bias` + `experts.up_exps.bias` interleaved into HF's
    `experts.gate_up_proj_bias` [E, 2I] (gate at the even columns), `experts.down_exps.bias` as
    `experts.down_proj_bias`; every other tensor as it comes."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in weights:
        if name.endswith(".self_attn.sinks.weight"):
            yield name.removesuffix(".weight"), t
        elif name.endswith(".experts.down_exps.bias"):
            yield name.replace(".experts.down_exps.bias", ".experts.down_proj_bias"), t
        elif name.endswith((".experts.gate_exps.bias", ".experts.up_exps.bias")):
            prefix, piece = name.rsplit(".experts.", 1)
            pair = pending.setdefault(prefix, {})
            pair[piece.split("_", 1)[0]] = _dense(t)
            if len(pair) == 2:
                del pending[prefix]
                gate, up = pair["gate"], pair["up"]
                if gate.shape != up.shape:
                    raise ValueError(
                        f"{prefix}: expert gate bias {tuple(gate.shape)} and up bias {tuple(up.shape)} differ"
                    )
                yield f"{prefix}.experts.gate_up_proj_bias", torch.stack([gate, up], dim=-1).flatten(-2)
        else:
            yield name, t
    for prefix, pair in pending.items():
        missing = "up" if "gate" in pair else "gate"
        raise ValueError(f"{prefix}: expert {missing} bias missing (ffn_{missing}_exps.bias)")
