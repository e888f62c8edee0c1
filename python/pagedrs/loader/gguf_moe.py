"""Mixture-of-experts GGUF files as llama.cpp writes them (`llama` with experts = Mixtral, `qwen2moe`,
`qwen3moe`): the router (`ffn_gate_inp`), the experts stacked in one 3-D tensor per projection
(`ffn_gate_exps` / `ffn_up_exps` / `ffn_down_exps`, [E, rows, cols]) that loading splits into HF's
per-expert names, the shared expert (`ffn_*_shexp`, `ffn_gate_inp_shexp`), and the config fields
transformers' GGUF reader leaves at their defaults (the experts' sizes; Mixtral read as a Llama)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from pagedrs.loader.gguf_reader import field_value as _field

if TYPE_CHECKING:
    from gguf import GGUFReader

__all__ = [
    "MOE_BLOCK_NAMES",
    "apply_moe_metadata",
    "expert_pieces",
    "has_q8_0_experts",
    "is_stacked_experts",
    "q8_0_experts_only",
    "split_dense",
]

MOE_BLOCK_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_exps",
    "ffn_up_exps": "mlp.experts.up_exps",
    "ffn_down_exps": "mlp.experts.down_exps",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_STACKED = re.compile(r"\.mlp\.experts\.(gate|up|down)_exps\.weight$")
_EXPERT_PIECE = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
_Q8_0 = 8  # gguf.GGMLQuantizationType.Q8_0


def is_stacked_experts(name: str) -> bool:
    """Whether `name` (as `hf_tensor_name` gives it) is a 3-D stacked experts tensor."""
    return _STACKED.search(name) is not None


def expert_pieces(name: str, stacked: Any) -> list[tuple[str, Any]]:
    """A stacked experts tensor [E, ...] as HF's per-expert tensors: (name of expert e's projection,
    stacked[e]) for each e."""
    m = _STACKED.search(name)
    if m is None:
        raise ValueError(f"{name!r} is not a stacked experts tensor")
    prefix = name[: m.start()]
    return [(f"{prefix}.mlp.experts.{e}.{m.group(1)}_proj.weight", stacked[e]) for e in range(len(stacked))]


def apply_moe_metadata(config: Any, reader: GGUFReader, arch: str) -> Any:
    """The config with the MoE fields of the file's metadata: a `llama` file with experts becomes a
    MixtralConfig; qwen2moe / qwen3moe get their experts' (and shared expert's) sizes and llama.cpp's
    routing (top-k weights renormalized for qwen3moe, not for qwen2moe), every layer sparse. Any other
    config is returned as it is."""
    import transformers

    experts = _field(reader, f"{arch}.expert_count")
    if not experts:
        return config
    used = int(_field(reader, f"{arch}.expert_used_count"))
    if arch == "llama":
        fields = {k: v for k, v in config.to_dict().items() if k not in ("model_type", "architectures")}
        mixtral = transformers.MixtralConfig(
            **fields, num_local_experts=int(experts), num_experts_per_tok=used
        )
        mixtral.architectures = ["MixtralForCausalLM"]
        return mixtral
    config.num_experts, config.num_experts_per_tok = int(experts), used
    size = _field(reader, f"{arch}.expert_feed_forward_length")
    if size:
        config.moe_intermediate_size = int(size)
    shared = _field(reader, f"{arch}.expert_shared_feed_forward_length")
    if shared:
        config.shared_expert_intermediate_size = int(shared)
    config.norm_topk_prob = arch == "qwen3moe"
    config.decoder_sparse_step, config.mlp_only_layers = 1, []
    return config


def split_dense(name: str, w: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """A dequantized float32 tensor as (name, array) pairs: stacked experts split per expert."""
    if is_stacked_experts(name):
        return [(n, np.ascontiguousarray(a)) for n, a in expert_pieces(name, w)]
    return [(name, w)]


def has_q8_0_experts(reader: GGUFReader) -> bool:
    """Whether the file holds stacked experts (`ffn_*_exps`) in Q8_0."""
    return any(t.name.endswith("_exps.weight") and int(t.tensor_type) == _Q8_0 for t in reader.tensors)


def q8_0_experts_only(weights: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """`iter_gguf_weights`' tensors for a CUDA device: the experts' Q8_0 pieces kept quantized (the fused
    experts kernel multiplies them), every other tensor float32 (dequantized, as the GGUF cache folder
    holds it)."""
    for name, t in weights:
        keep = getattr(t, "ggml_type", None) == _Q8_0 and _EXPERT_PIECE.search(name) is not None
        read = getattr(t, "materialize", None)
        yield name, t if keep or read is None else read()
